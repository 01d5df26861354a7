"""The README's and the doc pages' examples stay true: every ```python block of
README.md and docs/*.md runs, as written; the install error the README quotes is the
one setup.py prints; every link to a local file points at one (pages others add are
listed as expected)."""
import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(language: str, page: Path = ROOT / "README.md"):
    """(line number, code) of each block fenced as ```<language> (```  alone: language "")."""
    blocks, info, start, body = [], None, 0, []
    for number, text in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if info is None and text.startswith("```"):
            info, start, body = text[3:].strip(), number + 1, []
        elif info is not None and text.strip() == "```":
            if info == language:
                blocks.append((start, "\n".join(body) + "\n"))
            info = None
        elif info is not None:
            body.append(text)
    assert info is None, f"{page.name}: a code fence is not closed"
    return blocks


PYTHON_BLOCKS = [(f"{page.relative_to(ROOT)}:{line}", code) for page in PAGES
                 for line, code in fenced_blocks("python", page)]


def test_the_pages_have_their_examples():
    """The README's first call and the lifecycle in docs/allocator.md, at least (so the
    test below cannot pass by finding none)."""
    assert any(where.startswith("README.md:") for where, _ in PYTHON_BLOCKS)
    assert any(where.startswith("docs/allocator.md:") and "alloc_decode" in code and "pre_alloc" in code
               and "release" in code for where, code in PYTHON_BLOCKS)


@pytest.mark.parametrize("where,code", PYTHON_BLOCKS, ids=[where for where, _ in PYTHON_BLOCKS])
def test_python_block_runs(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_local_links_point_at_files(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"


def test_the_readme_links_every_doc_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def _setup_constant(name: str) -> str:
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def test_the_quoted_install_error_is_the_real_one():
    quoted = [code.strip() for _, code in fenced_blocks("", ROOT / "docs" / "install.md")
              if "no torch to compile against" in code]
    assert quoted == [_setup_constant("NO_TORCH")]


# -- the shell commands of README.md and docs/*.md, run as written --------------------

def shell_blocks():
    """(page:line, the block's commands: continuation lines joined, comments dropped)."""
    blocks = []
    for page in PAGES:
        for line, code in fenced_blocks("bash", page):
            joined = code.replace("\\\n", " ")
            commands = [re.sub(r"\s+#.*$", "", c).strip() for c in joined.splitlines()]
            blocks.append((f"{page.relative_to(ROOT)}:{line}", [c for c in commands if c and not c.startswith("#")]))
    return blocks


def _cuda_venv() -> Path:
    return Path(os.environ.get("SWA_EXT_CUDA_VENV", ROOT / ".venv-cuda"))


def _sglang_missing():
    py = _cuda_venv() / "bin" / "python"
    if not py.exists() or subprocess.run([py, "-c", "import sglang.srt.mem_cache.allocator.swa"],
                                         capture_output=True).returncode:
        return f"needs SGLang in {_cuda_venv()}: scripts/setup-sglang.sh first"
    return None


def _tool_missing(name):
    return None if shutil.which(name) else f"needs {name}"


# How each command is run: "run" (every run), "slow" (with --slow: minutes of CPU), or
# "not run"; and what it needs (why it cannot run here, or None). A block of a server
# deployment is one entry, by its first command.
PD_DEMO = ("needs a model (MODEL) and the servers running; scripts/run-pd-demo.sh runs these on the CPU "
           "with a tiny model (tests/sglang/test_pd_pair.py)")
INSTALLS = "installs into the environment it runs in; tests/test_install.py installs the wheel into scratch venvs"
COMMANDS = {
    "scripts/run-simulator.sh": ("slow", lambda: None),
    "scripts/run-tests.sh": ("not run", lambda: "the test command itself, which runs this test"),
    "pip install torch==2.13.0": ("not run", lambda: INSTALLS),
    "pip install .": ("not run", lambda: INSTALLS),
    "pip install '.[sim]'": ("not run", lambda: INSTALLS),
    "mkdir -p out": ("run", lambda: None),
    ".venv/bin/swa-ext bench --json out/bench.json --markdown out/bench.md --plot out/bench.png": ("slow", lambda: None),
    ".venv/bin/python -m swa_ext_bench.bench_evict": ("slow", lambda: None),
    "cmake -S . -B build/core && cmake --build build/core --target swa_planning_cost && build/core/swa_planning_cost":
        ("slow", lambda: _tool_missing("cmake")),
    "scripts/run-sglang-bench.sh swa_ext_bench --json out/sglang-ref.json --markdown out/sglang-ref.md": ("slow", _sglang_missing),
    ".venv/bin/swa-ext simulate --trace swa_ext/data/mooncake_conversation_trace_2000.jsonl --time-scale 0.1 "
    "--model gpt-oss-20b": ("slow", lambda: None),
    ".venv/bin/swa-ext simulate --policy sglang --policy swa_ext --max-running-requests 1024": ("slow", lambda: None),
}
DEPLOYMENT_BLOCKS = {
    "python -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port 30000 "
    "--disaggregation-mode prefill --disaggregation-transfer-backend mooncake --disaggregation-bootstrap-port 8998",
    "curl -s http://127.0.0.1:8000/generate -H 'Content-Type: application/json' "
    "-d '{\"text\": \"The capital of France is\", \"sampling_params\": {\"temperature\": 0, "
    "\"max_new_tokens\": 32}}'",
    "export TRITON_INTERPRET=1 SGLANG_HOST_IP=127.0.0.1",
    "SWA_EXT_SGLANG=shared python -m sglang.launch_server --model-path MODEL --host 127.0.0.1 "
    "--port 30001 --base-gpu-id 1 --disaggregation-mode decode --disaggregation-transfer-backend mooncake "
    "--disaggregation-bootstrap-port 8998",
}


def shell_commands():
    """(page:line, command, its entry in COMMANDS); a deployment block is one command."""
    out = []
    for where, commands in shell_blocks():
        first = " ".join(commands[0].split())
        if first in DEPLOYMENT_BLOCKS:
            out.append((where, "\n".join(commands), ("not run", lambda: PD_DEMO)))
            continue
        for command in commands:
            key = " ".join(command.split())
            out.append((where, command, COMMANDS.get(key, ("unknown", lambda: None))))
    return out


SHELL_COMMANDS = shell_commands()


def test_every_shell_command_is_known():
    """A new command in a page gets its entry in COMMANDS, so it is run or says why not."""
    unknown = [f"{where}: {command}" for where, command, (how, _) in SHELL_COMMANDS if how == "unknown"]
    assert not unknown, unknown
    assert len(SHELL_COMMANDS) >= len(COMMANDS) + len(DEPLOYMENT_BLOCKS)


def test_the_commands_name_what_exists():
    """Each command's program is there: a script of the checkout, executable, or a venv
    program as the text names it (so a renamed script fails here at once)."""
    for where, command, _ in SHELL_COMMANDS:
        program = command.split()[0]
        if program.startswith("scripts/"):
            assert os.access(ROOT / program, os.X_OK), f"{where}: {program} is not an executable script"


@pytest.mark.parametrize("where,command,entry", SHELL_COMMANDS,
                         ids=[f"{where} {command.split()[0]}" for where, command, _ in SHELL_COMMANDS])
def test_shell_command_runs(where, command, entry, request):
    how, needs = entry
    missing = needs()
    if missing:
        pytest.skip(f"{where}: {missing}")
    if how == "slow" and not request.config.getoption("--slow"):
        pytest.skip("slow: run with --slow")
    got = subprocess.run(["bash", "-c", f"set -e\nmkdir -p out\n{command}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=3600, env={**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", "1")})
    assert got.returncode == 0, f"{where}:\n{got.stdout[-3000:]}\n{got.stderr[-3000:]}"
    assert "Traceback" not in got.stderr, got.stderr[-3000:]
    if command == "scripts/run-simulator.sh":
        # What the README says the quick start prints is what it prints.
        quoted = [line for _, code in fenced_blocks("") for line in code.splitlines()
                  if line.startswith(("conclusion: ", "transfer: ", "against full"))]
        assert len(quoted) == 3 and all(line in got.stdout.splitlines() for line in quoted), got.stdout[-3000:]






def test_the_cli_is_where_the_readme_says():
    """The quick start names the venv's swa-ext (and activating the venv), and
    run-simulator.sh passes its arguments on to swa-ext simulate."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`.venv/bin/swa-ext simulate --help`" in readme and "`source .venv/bin/activate`" in readme
    assert "arguments after it go to\n`swa-ext simulate`" in readme
    program = ROOT / ".venv" / "bin" / "swa-ext"
    if not program.exists():
        pytest.skip(f"{program} not built here: scripts/setup-env.sh")
    direct = subprocess.run([program, "simulate", "--help"], capture_output=True, text=True, timeout=300)
    assert direct.returncode == 0 and direct.stdout.startswith("usage: swa-ext simulate")
    through = subprocess.run([ROOT / "scripts" / "run-simulator.sh", "--help"], capture_output=True, text=True,
                             timeout=1800)
    assert through.returncode == 0 and through.stdout == direct.stdout
