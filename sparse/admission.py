"""Admission: which ids get a row, from sighting counters kept for ids not yet admitted.

An id that is not admitted yet is counted per training forward. The sighting that
brings its count to `admit_min_count` and every later one while it is still not
admitted admit it with probability `admit_probability`: one deterministic draw per
(id, batch), from (table seed, id, count before the batch, store step), so a batch with k such
sightings admits it with 1 - (1 - p)^k whatever the sharding or the order in the batch,
and a count forgotten (below) does not bring back a draw that already refused the id.

Counters are bounded, since every id seen once would otherwise cost memory (and
snapshot bytes) forever: a counter whose last sighting is older than `ttl_seconds` of
event time is forgotten, and at most `admit_max_pending` counters live on a rank; past
that the least recently seen (by step) leave first, then those with fewer sightings,
then the lower ids. Every choice is a pure function of the stream, so a resumed run
forgets exactly what the uninterrupted one does.

Legend: N = ids in a call, P = live counters.
"""

from __future__ import annotations

import torch

from .config import TableConfig
from .hashing import TensorHashMap, lowest_k, splitmix64, uniform01

# Per counter: sightings so far, event time of the last sighting, store step of it.
COUNT, LAST_SEEN, LAST_STEP = 0, 1, 2
NUM_STATE = 3
_COUNT_BITS = 24


class PendingCounters(TensorHashMap):
    """id -> int64 [NUM_STATE] for ids seen in training but not admitted."""

    def __init__(self, cfg: TableConfig) -> None:
        super().__init__(value_width=NUM_STATE)
        if cfg.admit_max_pending < 1:
            raise ValueError(f"table {cfg.name!r}: admit_max_pending must be >= 1, got {cfg.admit_max_pending}")
        self.cfg = cfg

    def _stale(self, last_seen_N: torch.Tensor, now: int | None) -> torch.Tensor:
        if self.cfg.ttl_seconds is None or now is None:
            return torch.zeros_like(last_seen_N, dtype=torch.bool)
        return last_seen_N < now - self.cfg.ttl_seconds

    def admit(self, ids_N: torch.Tensor, counts_N: torch.Tensor, now: int | None, step: int) -> torch.Tensor:
        """Count the sightings of ids without a row; bool [N]: admitted now."""
        cfg = self.cfg
        if cfg.admit_min_count <= 1 and cfg.admit_probability >= 1.0:
            return torch.ones_like(ids_N, dtype=torch.bool)
        slots_N = self.find_slots(ids_N)
        have_N = slots_N >= 0
        state_N3 = self.values_C[slots_N.clamp(min=0)]
        # A counter past the TTL that no sweep has dropped yet counts as forgotten.
        live_N = have_N & ~self._stale(state_N3[:, LAST_SEEN], now)
        prev_N = torch.where(live_N, state_N3[:, COUNT], 0)
        total_N = prev_N + counts_N
        ok_N = total_N >= cfg.admit_min_count
        if cfg.admit_probability < 1.0:
            # Sightings numbered prev+1 .. total; those from min_count on each get a chance.
            chances_N = (total_N - prev_N.clamp(min=cfg.admit_min_count - 1)).clamp(min=0)
            # Keyed on the store step too: a count that lapsed (TTL) or was dropped
            # (admit_max_pending) restarts at 0, and a draw from (id, count) alone would
            # repeat the number that already refused the id, batch after batch.
            key_N = splitmix64(splitmix64(ids_N) ^ prev_N) ^ step
            u_N = uniform01(cfg.seed + 0x51ED, key_N, 1)[:, 0]
            ok_N &= u_N < 1.0 - (1.0 - cfg.admit_probability) ** chances_N.to(torch.float64)
        new_N3 = torch.stack([total_N, torch.full_like(total_N, now or 0), torch.full_like(total_N, step)], dim=1)
        keep_N = have_N & ~ok_N
        self.set_existing(slots_N[keep_N], new_N3[keep_N])
        self.remove_slots(slots_N[have_N & ok_N])
        self.insert_new(ids_N[~have_N & ~ok_N], new_N3[~have_N & ~ok_N])
        self._cap()
        return ok_N

    def expire(self, now: int) -> int:
        """Forget counters whose last sighting is older than the TTL; returns how many."""
        slots_P = self.live_slots()
        stale_P = self._stale(self.values_C[slots_P, LAST_SEEN], now)
        self.remove_slots(slots_P[stale_P])
        return int(stale_P.sum())

    def _cap(self) -> None:
        cap = self.cfg.admit_max_pending
        if self.num_live <= cap:
            return
        slots_P = self.live_slots()
        state_P3 = self.values_C[slots_P]
        score_P = (state_P3[:, LAST_STEP] << _COUNT_BITS) | state_P3[:, COUNT].clamp(max=(1 << _COUNT_BITS) - 1)
        # Drop 1/64 of the cap beyond the excess, so a full map is not rescanned every step.
        excess = self.num_live - cap + cap // 64
        self.remove_slots(slots_P[lowest_k(score_P, self.keys_C[slots_P], excess)])
