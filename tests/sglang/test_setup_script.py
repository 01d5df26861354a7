"""scripts/setup-sglang.sh, run again where SGLang is installed, prints a short summary:
the compiler's and pip's output go to build/setup-sglang.log, not to the terminal."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_setup_prints_a_summary_not_the_build():
    env = {**os.environ, "SWA_EXT_CUDA_VENV": sys.prefix}
    got = subprocess.run([ROOT / "scripts" / "setup-sglang.sh"], capture_output=True, text=True, env=env,
                         timeout=1800)
    lines = (got.stdout + got.stderr).splitlines()
    assert got.returncode == 0, "\n".join(lines[-40:])
    assert all(line.startswith("setup-sglang: ") for line in lines), lines
    assert len(lines) <= 4 and lines[-1].startswith("setup-sglang: ") and "sglang 0.5.23" in "\n".join(lines)
    log = (ROOT / "build" / "setup-sglang.log").read_text()
    assert "swa_ext CUDA build imports" in log  # the build's own output, kept in the log
