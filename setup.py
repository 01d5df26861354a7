"""Builds swa_ext and its native core.

The extension holds the CUDA kernels (csrc/cuda) when torch is a CUDA build and a CUDA
toolkit is found, or when USE_CUDA=1 forces it; USE_CUDA=0 builds for the CPU only.
TORCH_CUDA_ARCH_LIST defaults to "9.0" (Hopper).
"""
import glob
import os

# torch finds the toolkit when its module is imported; prefer the real one over an
# nvcc wrapper on PATH.
if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


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
    sources = sorted(glob.glob(os.path.join("csrc", "core", "*.cpp"))) + [os.path.join("csrc", "torch", "bindings.cpp")]
    cxx_flags = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    link_flags = []
    if os.environ.get("SWA_EXT_SANITIZE") == "1":  # for the sanitizer job of .ci/run
        cxx_flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1"]
        link_flags += ["-fsanitize=address,undefined"]
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


setup(
    name="swa_ext",
    version="0.1.0",
    description="KV cache page allocator for hybrid sliding-window-attention LLMs (drop-in for SGLang's SWA allocator)",
    packages=["swa_ext", "swa_ext_bench"],
    package_dir={"swa_ext": "swa_ext", "swa_ext_bench": "bench"},
    package_data={"swa_ext": ["data/*.csv", "data/*.json"]},
    ext_modules=[native_extension()],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch", "numpy", "tqdm", "matplotlib"],
    entry_points={"console_scripts": ["swa-ext = swa_ext.cli:main"]},
)
