"""The package version: one home, read by setup.py, ``swa_ext.__version__`` and ``swa-ext --version``."""
__version__ = "0.2.0"
