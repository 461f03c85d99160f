"""A tiny synthetic-ad-log job config shared by the training and evaluation tests, and a
filesystem that fills up."""

import builtins
import errno
import io
import os
import socket
from pathlib import Path

from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict

FEATURES = ["item_id", "action", "advertiser_id", "category_id"]


def tiny_config(data: Path, out: Path, **train) -> JobConfig:
    raw = {
        "data": {
            "path": str(data),
            "features": {"sparse": FEATURES, "labels": ["click", "conversion"]},
            "loader": {"batch_size": 8, "max_seq_len": 24, "mode": "ranking", "num_candidates": 2},
        },
        "sparse": {"tables": [
            {"name": f, "embedding_dim": 16, "feature_names": [f], "learning_rate": 0.05,
             "device_rows": 64, "host_rows": 128}
            for f in FEATURES
        ]},
        "dense": {"embedding_dim": 16, "num_layers": 1, "num_heads": 2, "attention_dim": 8, "linear_dim": 8,
                  "max_seq_len": 32, "dropout": 0.0},
        "model": {"retrieval": True, "ranking": True, "num_negatives": 16, "min_target_action": None},
        "train": {"out_dir": str(out), "max_steps": 6, "checkpoint_every": 3, "log_every": 1,
                  "precision": "fp32", "tensorboard": False, "eval_max_users": 16, **train},
    }
    return from_dict(JobConfig, raw)


class FullDisk:
    """Stands in for `open` in one module (monkeypatched there): writes to files whose path
    contains `match` fail with ENOSPC once `budget` bytes have gone through it in all, the
    bytes before that reaching the disk, as on a filesystem that fills up mid-write. A real
    full filesystem needs root to make; this injects the same error at a chosen byte."""

    def __init__(self, budget: int, match: str = "") -> None:
        self.budget = budget
        self.match = match
        self.written = 0
        self.failed_on: str | None = None
        """The file whose write hit the full disk."""

    def __call__(self, file, mode="r", *args, **kwargs):
        if not any(c in mode for c in "wax") or self.match not in str(file):
            return builtins.open(file, mode, *args, **kwargs)
        raw = _FillingFile(file, mode.replace("b", "").replace("t", ""), self)
        return raw if "b" in mode else io.TextIOWrapper(io.BufferedWriter(raw), encoding=kwargs.get("encoding"))


class _FillingFile(io.FileIO):
    def __init__(self, file, mode: str, disk: FullDisk) -> None:
        super().__init__(file, mode)
        self.disk = disk

    def write(self, data) -> int:
        data = bytes(data)
        room = self.disk.budget - self.disk.written
        if len(data) <= room:
            n = super().write(data)
            self.disk.written += n
            return n
        if room > 0:
            self.disk.written += super().write(data[:room])
        self.disk.failed_on = str(self.name)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.name))


def free_port() -> int:
    """A loopback port free now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
