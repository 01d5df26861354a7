"""The benchmarks as the ``swa_ext_bench`` package, for a checkout: installed beside swa_ext
by scripts/setup-env.sh (``pip install --no-build-isolation --no-deps -e bench``), never part
of swa_ext's wheel. Its entry point gives ``swa-ext bench`` the micro-benchmarks."""
import os
import runpy

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = runpy.run_path(os.path.join(HERE, "..", "swa_ext", "_version.py"))["__version__"]

setup(
    name="swa_ext_bench",
    version=VERSION,
    description="Benchmarks of swa_ext against an SGLang-style baseline and SGLang's own allocator",
    license="Apache-2.0",
    packages=["swa_ext_bench", "swa_ext_bench.micro"],
    package_dir={"swa_ext_bench": "."},
    python_requires=">=3.10",
    install_requires=[f"swa_ext[sim]=={VERSION}"],
    entry_points={"swa_ext.commands": ["bench = swa_ext_bench.micro:main"]},
)
