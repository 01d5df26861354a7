"""Builds swa_ext and its native core.

The extension is CPU-only unless torch is a CUDA build and a CUDA toolkit is found
(or USE_CUDA=1 forces it; USE_CUDA=0 forbids it), in which case the CUDA kernels in
csrc/cuda are compiled in as well.
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def native_extension():
    sources = sorted(glob.glob(os.path.join("csrc", "core", "*.cpp"))) + [os.path.join("csrc", "torch", "bindings.cpp")]
    cxx_flags = ["-O3", "-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    link_flags = []
    if os.environ.get("SWA_EXT_SANITIZE") == "1":  # for the sanitizer job of .ci/run
        cxx_flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1"]
        link_flags += ["-fsanitize=address,undefined"]
    return CppExtension("swa_ext._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)


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
