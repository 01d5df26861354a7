"""``python -m swa_ext_bench [args]``: the micro-benchmarks, as ``swa-ext bench`` runs them
(its errors and Ctrl-C read the same), also where the package is importable but not installed."""

import sys

from swa_ext.cli import run_command

from .micro import main

sys.exit(run_command(main, sys.argv[1:]))
