"""help() on the allocator classes documents every public method and attribute.

The native methods' texts live in csrc/torch/docstrings.h; pybind11 puts its own
signature line in front of each, which says nothing about units or results, so it is
stripped before a text is judged.
"""
import inspect
import pydoc
from pathlib import Path
import re

import pytest
import torch

import swa_ext
from swa_ext import decode

CLASSES = [swa_ext.SWATokenToKVPoolAllocator, swa_ext.PagedTokenToKVPoolAllocator, swa_ext.TokenToKVPoolAllocator]
MIN_WORDS = 6


def _native_signature(doc: str):
    """pybind11's first line, ``name(self: T, arg: type = default, ...) -> R``, and the rest."""
    first, _, rest = doc.partition("\n")
    match = re.match(r"\w+\((.*)\) -> .*$", first)
    if not match:
        return None, doc
    return re.findall(r"(\w+): ", match.group(1)), rest


def documented(cls, name):
    """(the text that documents ``cls.name``, its parameter names or None for an attribute)."""
    attr = inspect.getattr_static(cls, name, None)
    for klass in cls.__mro__:  # getattr_static finds pybind11's methods on the native base
        if name in vars(klass):
            attr = vars(klass)[name]
            break
    if isinstance(attr, property) or type(attr).__name__ == "pybind11_property":
        return (attr.__doc__ or ""), None
    func = getattr(cls, name)
    doc = func.__doc__ or ""
    params, text = _native_signature(doc)
    if params is None:
        params = [p for p in inspect.signature(func).parameters if p != "self"]
    else:
        params = [p for p in params if p != "self"]
    return text, params


def public_names(cls):
    return sorted(n for n in dir(cls) if not n.startswith("_"))


CASES = [(cls, name) for cls in CLASSES for name in public_names(cls)]


@pytest.mark.parametrize("cls,name", CASES, ids=[f"{c.__name__}.{n}" for c, n in CASES])
def test_every_public_member_has_a_docstring_naming_its_arguments(cls, name):
    text, params = documented(cls, name)
    words = re.findall(r"[A-Za-z_]\w*", text)
    assert len(words) >= MIN_WORDS, f"{cls.__name__}.{name}: no docstring beyond the signature: {text!r}"
    for param in params or ():
        assert re.search(rf"\b{param}\b", text), f"{cls.__name__}.{name}: the docstring never names {param!r}"


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_constructor_arguments_are_documented(cls):
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    text = (cls.__doc__ or "") + (cls.__init__.__doc__ or "")
    for param in params:
        assert re.search(rf"\b{param}\b", text), f"{cls.__name__}: the class docstring never names {param!r}"


def test_the_public_surface_is_all_covered():
    """The parametrised test above sees the methods the README lists (so it cannot pass
    by finding nothing)."""
    names = set(public_names(swa_ext.SWATokenToKVPoolAllocator))
    assert {"alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode", "free", "free_swa_segment",
            "translate_loc_from_full_to_swa", "evict_out_of_window", "backup_state", "dtype",
            "full_attn_allocator", "swa_attn_allocator", "full_to_swa_index_mapping"} <= names
    assert {"alloc", "alloc_extend", "alloc_decode", "free_page_ids", "free_pages", "dtype"} <= set(
        public_names(swa_ext.PagedTokenToKVPoolAllocator))


def test_help_explains_what_a_user_needs_for_a_decode_step():
    text = pydoc.render_doc(swa_ext.SWATokenToKVPoolAllocator, renderer=pydoc.plaintext)
    for attr in ("dtype", "full_attn_allocator", "swa_attn_allocator"):
        assert re.search(rf"^ \|  {attr}\n \|      \w", text, re.M), f"help() does not show {attr} with a text"
    decode_doc, _ = documented(swa_ext.SWATokenToKVPoolAllocator, "alloc_decode")
    # What last_loc is, the lengths' units, the refusal, who writes the row.
    for phrase in ("last_loc", "seq_lens[j] - 2", "including the new token", "None", "req_to_token", "ValueError"):
        assert phrase in decode_doc, phrase
    for name in ("alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode"):
        doc, _ = documented(swa_ext.SWATokenToKVPoolAllocator, name)
        assert "None" in doc and "nothing changed" in doc, name


def test_pool_views_are_the_documented_classes():
    alloc = swa_ext.SWATokenToKVPoolAllocator(256, 128, 16, torch.bfloat16, "cpu")
    assert type(alloc.full_attn_allocator) is swa_ext.PagedTokenToKVPoolAllocator
    assert alloc.full_attn_allocator.dtype is torch.bfloat16 and alloc.dtype is torch.bfloat16
    token = swa_ext.SWATokenToKVPoolAllocator(256, 128, 1, torch.float16, "cpu")
    assert type(token.swa_attn_allocator) is swa_ext.TokenToKVPoolAllocator


@pytest.mark.parametrize("name", decode.__all__)
def test_decode_functions_are_documented(name):
    obj = getattr(decode, name)
    words = re.findall(r"[A-Za-z_]\w*", obj.__doc__ or "")
    assert len(words) >= MIN_WORDS, name


@pytest.mark.parametrize("cls", [swa_ext.SWATokenToKVPoolAllocator, swa_ext.PagedTokenToKVPoolAllocator,
                                 swa_ext.TokenToKVPoolAllocator])
def test_help_on_the_constructor_is_its_own(cls):
    """help(cls.__init__) shows the Python signature, with dtype, and not the native
    one underneath (which has no dtype)."""
    text = pydoc.render_doc(cls.__init__, renderer=pydoc.plaintext)
    assert "swa_ext._C" not in text and "dtype" in text.split("\n\n", 1)[1]


def test_size_is_explained_as_the_smaller_pool():
    assert "min(size_full, size_swa)" in inspect.getdoc(swa_ext.SWATokenToKVPoolAllocator.__init__)


ROOT = Path(__file__).resolve().parent.parent
# A reference to a README section, as a text would write it: README, "CUDA" or README: "CUDA".
README_SECTION = re.compile(r'README[,:]? \\?"([^"\\]+)\\?"')


def test_texts_point_at_sections_and_pages_that_exist():
    """Docstrings and comments that send the reader to a README section or a doc page name
    one that exists (the CUDA notes moved from a README section to docs/cuda.md)."""
    headings = {line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("#")}
    texts = [*ROOT.glob("swa_ext/**/*.py"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("csrc/**/*.h"),
             *ROOT.glob("csrc/**/*.cpp")]
    assert ROOT / "csrc/torch/docstrings.h" in texts
    for path in texts:
        text = path.read_text(encoding="utf-8")
        for section in README_SECTION.findall(text):
            assert section in headings, f"{path.relative_to(ROOT)} names README section {section!r}, which is not one"
        for page in re.findall(r"\bdocs/[\w.-]+\.md\b", text):
            assert (ROOT / page).is_file(), f"{path.relative_to(ROOT)} names {page}, which does not exist"
