"""SGLang's plugin hook for swa_ext (entry point group ``sglang.srt.plugins``).

SGLang calls ``plugin()`` in each of its processes. It imports nothing of SGLang's and
changes nothing unless ``SWA_EXT_SGLANG`` is set (swa_ext.sglang says what each value
replaces); ``SWA_EXT_SHARED=1`` beside it makes the hybrid allocator swa_ext's shared
mode, one budget for full and SWA pages (docs/sglang.md).
"""
import os

MODE_VARIABLE = "SWA_EXT_SGLANG"
MODES = ("1", "all", "lockstep")
SHARED_VARIABLE = "SWA_EXT_SHARED"


def _flag(name):
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}: expected 1 (or unset, or 0), got {value!r}")
    return value == "1"


def plugin():
    """Installs swa_ext's allocators in this SGLang process as SWA_EXT_SGLANG and SWA_EXT_SHARED say."""
    mode = os.environ.get(MODE_VARIABLE, "").strip()
    shared = _flag(SHARED_VARIABLE)
    if mode in ("", "0"):
        if shared:
            raise ValueError(f"{SHARED_VARIABLE}=1 selects swa_ext's shared mode: set {MODE_VARIABLE}=1 beside it")
        return
    if mode not in MODES:
        raise ValueError(f"{MODE_VARIABLE}: expected one of {', '.join(MODES)} (or unset, or 0), got {mode!r}")
    from . import sglang

    sglang.install(single_pool=mode != "1", lockstep=mode == "lockstep", shared=shared)
