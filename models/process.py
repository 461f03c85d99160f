"""Process-wide settings that every `genrec` command applies when it starts."""

from __future__ import annotations

import ctypes
import os
import sys


def passive_openmp_waits() -> None:
    """OpenMP threads that finish early sleep instead of spinning (unless the environment
    already chose): on a loaded machine spinning threads steal the cores the busy ones need
    (2 threads measured 5.1 s per step spinning, 0.91 s passive). Must run before torch is
    imported: OpenMP reads it once, when it starts."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_large_allocations() -> None:
    """Keep freed large blocks in the heap instead of returning them to the OS.

    glibc maps every allocation above its mmap threshold (128 KiB to 32 MiB) afresh and
    unmaps it on free, so each step's large temporaries (logits, attention tiles, row
    gathers) are page-faulted in again every step. A Beauty-sized full-softmax step (1,100
    queries x 12K items, D = 50, one thread, load average 1.0) took 452 ms with glibc's
    defaults against 235 ms with this (median of 3 each), with 12.6 s against 0.4 s of
    system time over 50 steps. GENREC_MALLOC_TUNING=0 leaves glibc's defaults."""
    if os.environ.get("GENREC_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): its own policy applies
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)


def quiet_known_warnings() -> None:
    """Silence a torch message every training run would print: torchrec calls
    `torch.fx.is_fx_tracing`, which warns that it also covers torch.export. It is not about
    anything the user can change."""
    import logging

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
