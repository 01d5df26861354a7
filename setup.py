"""Builds swa_ext and its native core.

The extension holds the CUDA kernels (csrc/cuda) when torch is a CUDA build and a CUDA
toolkit is found, or when USE_CUDA=1 forces it; USE_CUDA=0 builds for the CPU only.
TORCH_CUDA_ARCH_LIST defaults to "9.0" (Hopper).

The extension compiles against the torch it will run with, the one installed in the
target environment; pyproject.toml says why no torch is a build requirement.
"""
import glob
import os
import runpy
import site
import sys

# torch 2.13.0, the release this project pins and tests, supports Python 3.10 and newer.
MIN_PYTHON = (3, 10)
if sys.version_info < MIN_PYTHON:
    sys.exit(f"swa_ext needs Python {'.'.join(map(str, MIN_PYTHON))} or newer, "
             f"this is {sys.version.split()[0]}")

# torch finds the toolkit when its module is imported; prefer the real one over an
# nvcc wrapper on PATH.
if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

NO_TORCH = ("swa_ext: no torch to compile against: install torch into this environment first; "
            "if it is installed, build without isolation (pip install --no-build-isolation ., "
            "python -m build --no-isolation)")


def import_target_torch():
    """The installed torch, also from inside pip's isolated build environment.

    That environment runs this interpreter but hides its site-packages; they are put
    back after the build environment's own packages (setuptools, ninja), without their
    .pth files. A frontend that builds in another interpreter (python -m build, uv)
    still finds no torch: then one line names the fix.
    """
    try:
        import torch
        return torch
    except ImportError:
        pass
    sys.path.extend(d for d in site.getsitepackages() if d not in sys.path)
    try:
        import torch
    except ImportError:
        sys.exit(NO_TORCH)
    return torch


torch = import_target_torch()
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = runpy.run_path(os.path.join(ROOT, "swa_ext", "_version.py"))["__version__"]
# The one SGLang release swa_ext's plugin serves (it refuses others at start-up).
SGLANG_VERSION = runpy.run_path(os.path.join(ROOT, "swa_ext", "sglang_seams.py"))["SUPPORTED_VERSION"]


def want_cuda():
    flag = os.environ.get("USE_CUDA", "")
    if flag in ("0", "1"):
        return flag == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def cuda_header_dirs():
    """Headers of the nvidia wheels (cuBLAS, cuSPARSE...) that torch's CUDA headers include."""
    site_packages = os.path.dirname(os.path.dirname(torch.__file__))
    return sorted(d for d in glob.glob(os.path.join(site_packages, "nvidia", "*", "include")) if os.path.isdir(d))


def native_extension():
    sources = sorted(glob.glob(os.path.join("csrc", "core", "*.cpp"))) + [
        os.path.join("csrc", "torch", "bindings.cpp"), os.path.join("csrc", "torch", "argument_errors.cpp")] + sorted(
        glob.glob(os.path.join("csrc", "sglang", "*.cpp")))
    cxx_flags = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    link_flags = []
    # For the sanitizer jobs of .ci/run (scripts/run-sanitized.sh): 1, AddressSanitizer and
    # UndefinedBehaviorSanitizer; "thread", ThreadSanitizer.
    sanitizers = {"1": "address,undefined", "thread": "thread"}.get(os.environ.get("SWA_EXT_SANITIZE", ""))
    if sanitizers:
        cxx_flags += [f"-fsanitize={sanitizers}", "-fno-omit-frame-pointer", "-O1"]
        link_flags += [f"-fsanitize={sanitizers}"]
    if not want_cuda():
        return CppExtension("swa_ext._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    sources += [os.path.join("csrc", "torch", "cuda_executor.cpp"), os.path.join("csrc", "cuda", "kernels.cu")]
    return CUDAExtension(
        "swa_ext._C",
        sources,
        include_dirs=cuda_header_dirs(),
        define_macros=[("SWA_EXT_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
        extra_link_args=link_flags,
    )


def torch_requirement():
    """The torch release the extension was compiled against: libtorch's C++ ABI changes
    between releases, so pip is told that another torch breaks this build. A local
    label (+cpu, +cu128) is left out: any build of that release matches."""
    return "torch==" + torch.__version__.split("+")[0]


def long_description():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


setup(
    name="swa_ext",
    version=VERSION,
    description="KV cache page allocator for hybrid sliding-window-attention LLMs (drop-in for SGLang's SWA allocator)",
    long_description=long_description(),
    long_description_content_type="text/markdown",
    author="the swa_ext authors",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: C++",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # The allocator, its SGLang integration and the simulator; the benchmarks (bench/) and the
    # test oracle stay in the checkout.
    packages=["swa_ext", "swa_ext.sglang", "swa_ext.simulator"],
    package_data={"swa_ext": ["data/*.csv", "data/*.json", "data/*.jsonl", "data/LICENSE-*"]},
    ext_modules=[native_extension()],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=" + ".".join(map(str, MIN_PYTHON)),
    install_requires=[torch_requirement()],
    # swa-ext simulate's progress bars and plots (swa_ext.simulator.EXTRA_MODULES); the
    # SGLang the plugin serves.
    extras_require={"sim": ["numpy", "tqdm", "matplotlib"], "sglang": [f"sglang=={SGLANG_VERSION}"]},
    entry_points={
        "console_scripts": ["swa-ext = swa_ext.cli:main"],
        # SGLang loads it in each of its processes; it acts only when SWA_EXT_SGLANG is set.
        "sglang.srt.plugins": ["swa_ext = swa_ext.sglang_plugin:plugin"],
    },
)
