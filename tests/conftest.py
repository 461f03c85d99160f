"""Session-wide test settings that must hold before anything imports Triton.

Triton decides at import whether its kernels run compiled (GPU) or interpreted, and torch
imports it on its own whenever it is installed. The tests run the HSTU Triton kernels on
CPU under Triton's interpreter (tests/dense/test_dense_triton.py), so it is switched on
here, first; the one test that compiles them for a GPU does so in a subprocess with it off.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
