"""The README's examples stay true: every ```python block runs, as written, and the
install error it quotes is the one setup.py prints."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def fenced_blocks(language: str):
    """(line number, code) of each block fenced as ```<language> (```  alone: language "")."""
    blocks, info, start, body = [], None, 0, []
    for number, text in enumerate(README.splitlines(), start=1):
        if info is None and text.startswith("```"):
            info, start, body = text[3:].strip(), number + 1, []
        elif info is not None and text.strip() == "```":
            if info == language:
                blocks.append((start, "\n".join(body) + "\n"))
            info = None
        elif info is not None:
            body.append(text)
    assert info is None, "README.md: a code fence is not closed"
    return blocks


PYTHON_BLOCKS = fenced_blocks("python")


def test_the_readme_has_its_examples():
    """The allocator example and the decode lifecycle, at least (so the test below
    cannot pass by finding none)."""
    assert len(PYTHON_BLOCKS) >= 2
    assert any("alloc_decode" in code and "pre_alloc" in code and "release" in code for _, code in PYTHON_BLOCKS)


@pytest.mark.parametrize("line,code", PYTHON_BLOCKS, ids=[f"README.md:{line}" for line, _ in PYTHON_BLOCKS])
def test_python_block_runs(line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


def _setup_constant(name: str) -> str:
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def test_the_quoted_install_error_is_the_real_one():
    quoted = [code.strip() for _, code in fenced_blocks("") if "no torch to compile against" in code]
    assert quoted == [_setup_constant("NO_TORCH")]
