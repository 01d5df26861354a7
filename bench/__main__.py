"""``python -m swa_ext_bench [args]``: the micro-benchmarks (same as ``swa-ext bench``)."""

import sys

from .micro import main

sys.exit(main())
