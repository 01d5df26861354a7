"""``swa-ext bench``: micro-benchmarks of the native allocator against the SGLang-style
torch baseline, SGLang's own allocator and the native-call floor (docs/benchmarks.md).

Four modules, each importing only those before it: ``cases`` (the calls measured),
``measure`` (timing and rows), ``report`` (goals, markdown, JSON, plot), ``cli``.
"""

from .cases import DEFAULT_BATCH_SIZES, DEFAULT_PAGE_SIZES, OPS, SMOKE_ITERS, SMOKE_MAX_BATCH, _Case
from .cli import main
from .measure import _measure, _progress, _row, floor, run
from .report import GOALS, goals, plot, report, to_markdown

__all__ = ["OPS", "DEFAULT_BATCH_SIZES", "DEFAULT_PAGE_SIZES", "GOALS", "run", "goals", "to_markdown", "plot",
           "report", "main"]
