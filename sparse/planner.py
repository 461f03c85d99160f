"""A small planner: size each table's device and host tiers from memory budgets.

Tables whose whole shard (rows per rank) fits in what is left of the device budget are
planned "memory": device_rows >= rows, so they never spill and behave like an in-memory
EmbeddingCollection (same code path, no SSD traffic). The rest are "tiered": the
remaining device and host budgets are split between them in proportion to their sizes,
and rows beyond that live on the SSD tier.

Unbounded tables (num_embeddings None) need an expected row count per table.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Literal

from .config import SparseConfig
from .optim import row_width

# Per-row bookkeeping beside the row itself: slot id (8), metadata (24), and the native id
# index (8-byte entries at load 0.68-0.85: at most 12 bytes, csrc/store.c). The CLOCK byte
# of the memory tiers is within the rounding.
_OVERHEAD_BYTES = 8 + 24 + 12


@dataclass
class TablePlan:
    name: str
    rows_per_rank: int
    bytes_per_row: int
    placement: Literal["memory", "tiered"]
    device_rows: int
    host_rows: int

    @property
    def ssd_rows(self) -> int:
        return max(0, self.rows_per_rank - self.device_rows - self.host_rows)


def plan_tables(config: SparseConfig, *, device_bytes: int, host_bytes: int, world_size: int = 1,
                expected_rows: dict[str, int] | None = None, verbose: bool = True) -> tuple[SparseConfig, list[TablePlan]]:
    """Return a copy of `config` with device_rows / host_rows set per table, and the plan."""
    expected_rows = expected_rows or {}
    sizes = {}
    for t in config.tables:
        total = t.num_embeddings if t.num_embeddings is not None else expected_rows.get(t.name)
        if total is None:
            raise ValueError(f"table {t.name!r} is unbounded: pass expected_rows[{t.name!r}] to plan it")
        sizes[t.name] = (-(-total // world_size), row_width(t) * 4 + _OVERHEAD_BYTES)
    plans: dict[str, TablePlan] = {}
    device_left = device_bytes
    for name in sorted(sizes, key=lambda n: sizes[n][0] * sizes[n][1]):
        rows, bpr = sizes[name]
        if rows * bpr <= device_left:
            device_left -= rows * bpr
            plans[name] = TablePlan(name, rows, bpr, "memory", rows, 0)
    tiered = [n for n in sizes if n not in plans]
    total_tiered = sum(sizes[n][0] * sizes[n][1] for n in tiered)
    for name in tiered:
        rows, bpr = sizes[name]
        share = rows * bpr / total_tiered
        device_rows = min(rows, int(device_left * share) // bpr)
        host_rows = min(rows - device_rows, int(host_bytes * share) // bpr)
        plans[name] = TablePlan(name, rows, bpr, "tiered", device_rows, host_rows)
    out = copy.deepcopy(config)
    for t in out.tables:
        t.device_rows, t.host_rows = plans[t.name].device_rows, plans[t.name].host_rows
    ordered = [plans[t.name] for t in config.tables]
    if verbose:
        print(format_plan(ordered), file=sys.stderr)
    return out, ordered


def format_plan(plans: list[TablePlan]) -> str:
    lines = [f"{'table':<16} {'placement':<9} {'rows/rank':>12} {'device':>12} {'host':>12} {'ssd':>12} {'B/row':>6}"]
    for p in plans:
        lines.append(f"{p.name:<16} {p.placement:<9} {p.rows_per_rank:>12} {p.device_rows:>12} {p.host_rows:>12} "
                     f"{p.ssd_rows:>12} {p.bytes_per_row:>6}")
    return "\n".join(lines)
