"""SGLang's plugin hook for swa_ext (entry point group ``sglang.srt.plugins``).

SGLang calls ``plugin()`` in each of its processes. It imports nothing of SGLang's and
changes nothing unless ``SWA_EXT_SGLANG`` is set (swa_ext.sglang says what each value
replaces).
"""
import os

MODE_VARIABLE = "SWA_EXT_SGLANG"
MODES = ("1", "all", "lockstep")


def plugin():
    """Installs swa_ext's allocators in this SGLang process as SWA_EXT_SGLANG says."""
    mode = os.environ.get(MODE_VARIABLE, "").strip()
    if mode in ("", "0"):
        return
    if mode not in MODES:
        raise ValueError(f"{MODE_VARIABLE}: expected one of {', '.join(MODES)} (or unset, or 0), got {mode!r}")
    from . import sglang

    sglang.install(single_pool=mode != "1", lockstep=mode == "lockstep")
