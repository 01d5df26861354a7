"""The benchmarks as the ``swa_ext_bench`` package, for a checkout: installed beside swa_ext
by scripts/setup-env.sh (``pip install --no-build-isolation --no-deps -e bench``), never part
of swa_ext's wheel. Its entry point gives ``swa-ext bench`` the micro-benchmarks; its one
native module is the native-call floor the micro-benchmarks time (floor.cpp)."""
import os
import runpy

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = runpy.run_path(os.path.join(HERE, "..", "swa_ext", "_version.py"))["__version__"]


def pybind11_include():
    """pybind11's headers (header-only: the floor links nothing): the pybind11 package's, a
    build requirement (bench/pyproject.toml), or else the copy torch ships."""
    try:
        import pybind11
        return pybind11.get_include()
    except ImportError:
        import torch
        return os.path.join(os.path.dirname(torch.__file__), "include")


FLOOR = Extension("swa_ext_bench._floor", [os.path.relpath(os.path.join(HERE, "floor.cpp"))],
                  include_dirs=[pybind11_include()],
                  extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"], language="c++")

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
    ext_modules=[FLOOR],
)
