"""Builds the native kernels at install time (`pip install -e .` or `pip install .`).

dense/csrc/hstu_tile.c (C + OpenMP) and sparse/csrc/store.c (C) have no Python or torch
headers; each is built as a shared library beside its package and loaded through ctypes. The instruction set is
chosen here, not with -march=native, so a library built on one machine runs on any CPU of
the same family that has those features: genrec.dense.fused checks them when it loads.
Everything else about the project is in pyproject.toml.
"""

import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ISA = {"x86_64": ["-mavx2", "-mfma"], "AMD64": ["-mavx2", "-mfma"]}.get(platform.machine(), [])


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


setup(
    ext_modules=[Extension(
        "genrec.dense._hstu_tile", sources=["dense/csrc/hstu_tile.c"],
        # -ffast-math only at compile time: linked into a shared library it would also set
        # flush-to-zero for the whole process.
        extra_compile_args=["-O3", "-ffast-math", "-fopenmp", *ISA], extra_link_args=["-fopenmp", "-lm"],
    ), Extension(
        "genrec.sparse._store_kernels", sources=["sparse/csrc/store.c"],
        # The store's kernels reproduce the PyTorch reference bit for bit: no fast-math, and
        # no fused multiply-add contraction (each product and sum rounds on its own).
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", *ISA],
        extra_link_args=["-pthread", "-lm"],
    )],
    cmdclass={"build_ext": BuildNative},
)
