"""The README's and the doc pages' examples stay true: every ```python block of
README.md and docs/*.md runs, as written; the install error the README quotes is the
one setup.py prints; every link to a local file points at one (pages others add are
listed as expected)."""
import ast
import re
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
    quoted = [code.strip() for _, code in fenced_blocks("") if "no torch to compile against" in code]
    assert quoted == [_setup_constant("NO_TORCH")]
