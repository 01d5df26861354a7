"""Installing swa_ext as a pip user does, in scratch virtual environments.

Each environment is a plain ``python -m venv`` of the interpreter running the tests,
with the pip that interpreter bundles, and the source is a copy of the files git
tracks (what a fresh clone holds), so nothing here touches the working tree's build.

- no torch installed: ``pip install .`` fails in seconds with one line naming the fix,
  and pulls no torch;
- torch installed: ``pip wheel .`` builds in pip's isolated environment against that
  torch (no second torch is installed there), and the wheel carries the README as its
  long description, the licence, the torch release it was compiled against and the
  Python floor; it holds the allocator, its SGLang integration and the simulator, not
  the benchmarks nor the test oracle. Installed beside torch alone it imports and
  allocates from outside the source tree, and ``swa-ext simulate`` and ``swa-ext bench``
  each say in one line what to install; with the ``sim`` extra the simulator runs.
  This compiles the extension (a minute or two on two cores).
"""
import email
import glob
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

# Under run-sanitized.sh the sanitizer runtimes are preloaded into every child process,
# pip and the compiler included; what this checks has nothing to sanitize.
pytestmark = pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                                reason="run-sanitized.sh preloads ASan into pip and the compiler; run it unsanitized")

ROOT = Path(__file__).resolve().parent.parent
VERSION = runpy.run_path(str(ROOT / "swa_ext" / "_version.py"))["__version__"]
TORCH_RELEASE = torch.__version__.split("+")[0]


def run(cmd, **kwargs):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)


def source_copy(dest: Path) -> Path:
    """The files of a fresh clone: tracked ones, and new ones git would not ignore."""
    listed = run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    assert listed.returncode == 0, f"git ls-files failed: {listed.stderr}"
    for name in filter(None, listed.stdout.split("\0")):
        src = ROOT / name
        if src.is_file():  # a file deleted but not yet committed is listed too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def new_venv(path: Path) -> Path:
    made = run([sys.executable, "-m", "venv", path])
    assert made.returncode == 0, made.stderr
    return path / "bin" / "python"


def pip_env():
    # The wheel cache would let one test's wheel stand in for another's build.
    return dict(os.environ, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1", MAX_JOBS="2")


def build_output(text: str):
    """The lines the build itself printed, from pip's '[N lines of output]' box."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "lines of output]" in line)
    end = next(i for i in range(start, len(lines)) if "[end of output]" in lines[i])
    return [line.strip() for line in lines[start + 1:end] if line.strip()]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return source_copy(tmp_path_factory.mktemp("clone"))


def test_pip_install_without_torch_fails_in_one_line(source, tmp_path):
    py = new_venv(tmp_path / "venv")
    started = time.monotonic()
    got = run([py, "-m", "pip", "install", source], env=pip_env(), timeout=300)
    took = time.monotonic() - started
    assert got.returncode != 0
    said = build_output(got.stdout + got.stderr)
    assert len(said) == 1, said
    assert said[0].startswith("swa_ext: no torch to compile against") and "--no-build-isolation" in said[0]
    assert "Traceback" not in got.stdout + got.stderr
    assert took < 120, f"failing took {took:.0f} s"
    # Nothing, torch above all, was installed on the way.
    assert run([py, "-c", "import torch"]).returncode != 0
    assert "torch" not in run([py, "-m", "pip", "list"]).stdout.lower()


def _other_python(minor: int):
    """A working python3.<minor>: on PATH, or one of pyenv's (whose shim may be inactive)."""
    name = f"python3.{minor}"
    candidates = [shutil.which(name)] + sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/{name}")))
    for candidate in filter(None, candidates):
        if run([candidate, "-c", "import venv"]).returncode == 0:
            return candidate
    pytest.skip(f"needs a working {name} (on PATH or under ~/.pyenv) to show what that Python gets")


def test_pip_install_on_python_3_9_says_3_10_is_needed(source, tmp_path):
    made = run([_other_python(9), "-m", "venv", tmp_path / "venv"])
    assert made.returncode == 0, made.stderr
    got = run([tmp_path / "venv" / "bin" / "python", "-m", "pip", "install", source], env=pip_env(), timeout=300)
    assert got.returncode != 0
    said = build_output(got.stdout + got.stderr)
    assert len(said) == 1 and said[0].startswith("swa_ext needs Python 3.10 or newer, this is 3.9"), said


@pytest.mark.skipif(torch.version.cuda is not None,
                    reason="needs a CPU torch: a scratch copy of a CUDA torch is several GB and compiles the kernels")
def test_isolated_wheel_builds_against_the_installed_torch(source, tmp_path):
    py = new_venv(tmp_path / "venv")
    installed = run([py, "-m", "pip", "install", f"torch=={torch.__version__}"], env=pip_env(), timeout=600)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    wheels = tmp_path / "wheels"
    # -vv shows what pip installs into its isolated build environment, and the compiler lines.
    built = run([py, "-m", "pip", "wheel", "--no-deps", "-vv", "-w", wheels, source], env=pip_env(), timeout=1200)
    log = built.stdout + built.stderr
    assert built.returncode == 0, log[-5000:]
    build_env = [line for line in log.splitlines() if "Successfully installed" in line]
    assert build_env and "setuptools" in build_env[0] and "torch" not in build_env[0], build_env
    # Every compile used the torch headers of the environment installed into.
    includes = set(re.findall(r"-I(\S*)/torch/include\s", log))
    assert includes == {str(tmp_path / "venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
                            / "site-packages")}, includes

    (wheel,) = wheels.glob("swa_ext-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = f"swa_ext-{VERSION}.dist-info"
        meta = email.message_from_string(zf.read(f"{info}/METADATA").decode("utf-8"))
        licence = zf.read(f"{info}/licenses/LICENSE").decode()
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    assert meta["Name"] == "swa_ext" and meta["Version"] == VERSION
    assert meta["License"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert licence == (ROOT / "LICENSE").read_text() and "Apache License" in licence
    assert "the swa_ext authors" in licence and meta["Author"] == "the swa_ext authors"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (ROOT / "README.md").read_text(encoding="utf-8").strip()
    requires = meta.get_all("Requires-Dist")
    assert f"torch=={TORCH_RELEASE}" in requires and meta.get_all("Provides-Extra") == ["sim", "sglang"]
    # Nothing but torch without the extras; swa_ext[sglang] is the one SGLang the plugin serves.
    assert [r for r in requires if "extra ==" not in r] == [f"torch=={TORCH_RELEASE}"], requires
    assert sorted(r.split(";")[0].strip() for r in requires if "extra ==" in r) == [
        "matplotlib", "numpy", "sglang==0.5.23", "tqdm"]
    assert meta["Requires-Python"] == ">=3.10"
    assert any(n.startswith("swa_ext/_C") and n.endswith(".so") for n in names)
    assert "swa_ext/data/swa_model_configs.json" in names
    # The benchmarks and the test oracle stay in the checkout.
    assert not [n for n in names if n.startswith("swa_ext_bench") or n.endswith("reference.py")], names
    for part in ("__init__", "scenario", "node", "runs", "report"):
        assert f"swa_ext/simulator/{part}.py" in names, part
    # Every bundled data file: the simulator's traces (the Mooncake sample and its licence too).
    for data in (ROOT / "swa_ext" / "data").iterdir():
        assert f"swa_ext/data/{data.name}" in names, data.name
    for part in ("__init__", "adapters", "lockstep", "installer", "hooks"):
        assert f"swa_ext/sglang/{part}.py" in names, part
    assert "swa_ext/sglang_plugin.py" in names and "swa_ext/sglang_seams.py" in names
    # SGLang finds the plugin through this entry point (README: "Using swa_ext in SGLang").
    assert "[sglang.srt.plugins]\nswa_ext = swa_ext.sglang_plugin:plugin" in entry_points

    done = run([py, "-m", "pip", "install", wheel], env=pip_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probe = (
        "import json, torch, swa_ext\n"
        "a = swa_ext.SWATokenToKVPoolAllocator(1024, 256, 16, torch.bfloat16, 'cpu')\n"
        "out = a.alloc(32)\n"
        "print(json.dumps({'file': swa_ext.__file__, 'slots': out.tolist(), 'swa': a.swa_available_size()}))\n"
    )
    used = run([py, "-c", probe], cwd=tmp_path)
    assert used.returncode == 0, used.stderr
    got = json.loads(used.stdout)
    assert got["file"].startswith(str(tmp_path / "venv")), got["file"]
    assert got["slots"] == list(range(16, 48)) and got["swa"] == 256 - 32
    # torch (and what torch itself pulls in) is all the wheel installed.
    assert run([py, "-c", "import tqdm"]).returncode != 0 and run([py, "-c", "import matplotlib"]).returncode != 0
    assert run([py, "-m", "pip", "check"]).returncode == 0
    swa_ext_cmd = tmp_path / "venv" / "bin" / "swa-ext"
    simulate = run([swa_ext_cmd, "simulate", "--help"], cwd=tmp_path)
    assert simulate.returncode == 1 and simulate.stdout == "" and "Traceback" not in simulate.stderr
    # Its last line; torch itself warns above it, at import, that numpy is missing.
    assert simulate.stderr.splitlines()[-1] == ("swa-ext simulate: error: the simulator needs numpy, tqdm, "
                                                "matplotlib: pip install 'swa_ext[sim]'"), simulate.stderr
    bench = run([swa_ext_cmd, "bench"], cwd=tmp_path)
    assert bench.returncode == 2 and "not installed" in bench.stderr.splitlines()[-1], bench.stderr

    extra = run([py, "-m", "pip", "install", f"{wheel}[sim]"], env=pip_env(), timeout=600)
    assert extra.returncode == 0, extra.stdout[-3000:] + extra.stderr[-3000:]
    assert run([swa_ext_cmd, "simulate", "--help"], cwd=tmp_path).returncode == 0
    assert run([py, "-m", "pip", "check"]).returncode == 0
