"""``python -m swa_ext``: the ``swa-ext`` command."""

from swa_ext.cli import main

raise SystemExit(main())
