"""Build: a pure-Python package, plus the CUDA extension kd_kernels._C when it can be built.

KD_KERNELS_BUILD_CUDA=auto (default): build it when torch with CUDA and nvcc are present
    and csrc/ has sources; otherwise install pure Python and say why.
KD_KERNELS_BUILD_CUDA=1: build it or fail.   KD_KERNELS_BUILD_CUDA=0: never build it.
torch is imported only to build the extension, so a CPU install needs no torch at build time.

The GPU install is editable, from the repository root:
    KD_KERNELS_BUILD_CUDA=1 python -m pip install --no-build-isolation -e ".[triton]"
setuptools (>= 64) builds extensions of an editable install in place, so kd_kernels/_C*.so
sits in the source tree, which is what Python imports when run from the repository root.
"""
import glob
import os
import sys

from setuptools import find_packages, setup

MODE = os.environ.get("KD_KERNELS_BUILD_CUDA", "auto").lower()
if MODE not in ("auto", "0", "1"):
    sys.exit(f"KD_KERNELS_BUILD_CUDA: expected auto, 0 or 1, got {MODE!r}")


def _cuda_build():
    """(ext_modules, cmdclass), or why there is no extension."""
    sources = sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/*.cpp"))
    if not sources:
        return None, "csrc/ has no CUDA sources yet"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as error:
        return None, f"torch is not importable at build time ({error}); use pip install --no-build-isolation"
    if torch.version.cuda is None or CUDA_HOME is None:
        return None, "torch has no CUDA or nvcc was not found (CUDA_HOME unset)"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    extension = CUDAExtension(
        "kd_kernels._C", sources,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
    )
    return ([extension], {"build_ext": BuildExtension}), None


ext_modules, cmdclass = [], {}
if MODE != "0":
    built, reason = _cuda_build()
    if built:
        ext_modules, cmdclass = built
    elif MODE == "1":
        sys.exit(f"KD_KERNELS_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
    else:
        print(f"kd_kernels: installing without the CUDA extension: {reason}", file=sys.stderr)

setup(
    packages=find_packages(include=["kd_kernels", "kd_kernels.*", "orchestration", "orchestration.*"]),
    py_modules=["orchestrate"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
