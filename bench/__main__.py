"""``python -m swa_ext_bench [args]``: the micro-benchmarks, as ``swa-ext bench`` runs them
(its errors and Ctrl-C read the same)."""

import sys

from swa_ext.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
