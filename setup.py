"""Builds the native kernels at install time (`pip install -e .` or `pip install .`).

dense/csrc/hstu_tile.c with topk_scan.c (C + OpenMP) and sparse/csrc/store.c (C) have no
Python or torch headers; each is built as a shared library beside its package and loaded
through ctypes (the dense kernels twice on x86: for AVX2 and for AVX-512). The instruction set is
chosen here, not with -march=native, so a library built on one machine runs on any CPU of
the same family that has those features: genrec.dense.fused checks them when it loads.
Everything else about the project is in pyproject.toml.
"""

import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

X86 = platform.machine() in ("x86_64", "AMD64")
ISA = ["-mavx2", "-mfma"] if X86 else []
# The HSTU kernels are also built for AVX-512 (16 floats a vector against 8);
# genrec.dense.fused loads that build on CPUs that have its features, the AVX2 one elsewhere.
AVX512 = [*ISA, "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mprefer-vector-width=512"]


class BuildNative(build_ext):
    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # the compiler's own output is printed above
            raise SystemExit(
                f"genrec: building the native kernel {ext.name} failed ({e}). It needs a C compiler with "
                "OpenMP (gcc, or clang with libomp); set CC to choose one, then reinstall."
            ) from None

    def get_export_symbols(self, ext):
        return []  # a ctypes library, not a Python module: there is no PyInit_ symbol


def hstu_tile(name: str, suffix: str, isa: list[str]) -> Extension:
    # -ffast-math only at compile time: linked into a shared library it would also set
    # flush-to-zero for the whole process.
    return Extension(f"genrec.dense.{name}", sources=[f"dense/csrc/hstu_tile{suffix}.c", f"dense/csrc/topk_scan{suffix}.c"],
                     extra_compile_args=["-O3", "-ffast-math", "-fopenmp", *isa],
                     extra_link_args=["-fopenmp", "-lm"])


setup(
    ext_modules=[hstu_tile("_hstu_tile", "", ISA),
                 *([hstu_tile("_hstu_tile_avx512", "_avx512", AVX512)] if X86 else []), Extension(
        "genrec.sparse._store_kernels", sources=["sparse/csrc/store.c"],
        # The store's kernels reproduce the PyTorch reference bit for bit: no fast-math, and
        # no fused multiply-add contraction (each product and sum rounds on its own).
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", *ISA],
        extra_link_args=["-pthread", "-lm"],
    )],
    cmdclass={"build_ext": BuildNative},
)
