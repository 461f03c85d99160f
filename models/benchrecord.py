"""What every `genrec bench` JSON records about where and when it was measured.

    record = start_record()          # before the bench: load average, time
    figures = bench.run(quick=True)
    figures["conditions"] = finish_record(record)

A figure is only comparable with another taken under the same conditions: the commit, the
library versions, the CPU (model and the vector flags kernels are built for), the thread
settings, and how loaded the machine was before and after (a 2-core machine with a load
of 2 is already oversubscribed).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parents[1]
_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "fma", "neon", "asimd")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu() -> dict:
    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = [f for f in _FLAGS if f in value.split()]
                break
    except OSError:
        pass
    return {"model": model, "flags": flags, "logical_cpus": os.cpu_count()}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def start_record() -> dict:
    # The commit at the start: the code that runs is the one imported then, whatever the
    # working tree holds by the end.
    return {"started_unix": time.time(), "load_average_before": list(os.getloadavg()), "git_commit": _git_commit()}


def finish_record(record: dict) -> dict:
    return {
        **record,
        "seconds": time.time() - record["started_unix"],
        "load_average_after": list(os.getloadavg()),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "fbgemm_gpu": _version("fbgemm-gpu-cpu") or _version("fbgemm-gpu"),
                     "torchrec": _version("torchrec")},
        "cpu": _cpu(),
        "threads": {"torch": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
    }
