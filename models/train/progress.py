"""Training progress: a tqdm bar, a metrics.jsonl log, TensorBoard scalars (rank 0 only).

Usage:

    progress = ProgressLogger(run_dir, total_steps=10_000, rank=rank, start_step=resumed_step)
    rate = RateMeter()
    for step in range(resumed_step + 1, 10_001):
        ...
        if step % log_every == 0:
            progress.log(step, {"loss": loss.item(), "lr": lr,
                                **rate.tick(samples=num_samples, tokens=num_tokens),
                                "cache/hit_rate": store.hit_rate()})
    progress.close()

Each `log` call appends one line to run_dir/metrics.jsonl, e.g.

    {"step": 200, "time": 1717000000.1, "loss": 4.21, "lr": 0.001, "samples_per_s": 812.5, ...}

and writes each metric as a TensorBoard scalar under run_dir/tensorboard/ (needs the
`tensorboard` package). The metrics are whatever scalars the trainer passes (it averages
the losses over ranks; rates count every rank; store hit rates are rank 0's); other
ranks' loggers do nothing, so every rank may call `log`.
On resume, lines are appended: steps replayed after the last checkpoint appear twice,
and the last line for a step is the one that counts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


def _scalar(key: str, value: Any) -> float | int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {tuple(value.shape)}, not a scalar")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"metric {key!r} must be a number, got {type(value).__name__}")
    return value


def _drop_partial_line(path: Path) -> None:
    """Cut `path` back to its last complete line: a write cut short (a full disk, a crash)
    leaves a record without its newline, which the next run's first line would otherwise
    extend into one line that parses as neither. Its step was not checkpointed (a record is
    written before its step's checkpoint), so the resumed run logs it again."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 65536))  # a record is a few hundred bytes: its start is in here
            tail = f.read()
            if tail and not tail.endswith(b"\n"):
                f.truncate(size - len(tail) + tail.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


class ProgressLogger:
    """Progress bar + jsonl + TensorBoard for one training run; see the module docstring."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        total_steps: int,
        rank: int,
        enable_tensorboard: bool = True,
        start_step: int = 0,
    ) -> None:
        self.enabled = rank == 0
        self._bar = None
        self._jsonl = None
        self._writer = None
        if not self.enabled:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "TensorBoard logging needs the `tensorboard` package: pip install tensorboard "
                    "(or turn TensorBoard logging off)"
                ) from e
            self._writer = SummaryWriter(log_dir=str(out / "tensorboard"), flush_secs=30)
        _drop_partial_line(out / "metrics.jsonl")
        self._jsonl = open(out / "metrics.jsonl", "a", encoding="utf-8")
        self._bar = tqdm(total=total_steps, initial=start_step, file=sys.stderr, dynamic_ncols=True,
                         unit="step", desc="train")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record `metrics` (str -> number or 1-element tensor) at `step`."""
        if not self.enabled:
            return
        values = {k: _scalar(k, v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **values}
        # One line per call, flushed, so a killed run keeps every line it logged.
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for k, v in values.items():
                self._writer.add_scalar(k, v, global_step=step)
        self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)
        self._bar.update(step - self._bar.n)

    def write(self, message: str) -> None:
        """Print a line above the bar (rank 0), e.g. an evaluation summary."""
        if self.enabled:
            self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        if not self.enabled:
            return
        self._bar.close()
        self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
        self.enabled = False

    def __enter__(self) -> ProgressLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RateMeter:
    """Per-second rates of counters since the previous `tick` (or construction).

    rate.tick(samples=256, tokens=51_200) -> {"samples_per_s": ..., "tokens_per_s": ...}
    Counts are summed over calls between ticks when passed to `add`.
    """

    def __init__(self) -> None:
        self._since = time.perf_counter()
        self._counts: dict[str, float] = {}

    def add(self, **counts: float) -> None:
        for k, v in counts.items():
            self._counts[k] = self._counts.get(k, 0) + v

    def tick(self, **counts: float) -> dict[str, float]:
        self.add(**counts)
        now = time.perf_counter()
        elapsed = max(now - self._since, 1e-9)
        rates = {f"{k}_per_s": v / elapsed for k, v in self._counts.items()}
        self._since, self._counts = now, {}
        return rates
