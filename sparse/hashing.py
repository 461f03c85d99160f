"""Stable 64-bit hashing and a vectorized open-addressing hash map held in tensors (and,
on it, `ReferenceIndex`: the store's id index under kernels="reference").

Everything here is plain torch int64 arithmetic (wrapping multiplication, masked
logical shifts), so results are identical across processes, machines and world sizes:
sharding (`owner_rank`), initialization (`uniform01`) and the id index all build on it.
For the same reason selections by score (eviction, dropping counters) break ties on the
id (`lowest_k`), never on where a row happens to sit in memory.

Legend: N = number of query ids, C = table capacity (a power of two).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """Reinterpret an unsigned 64-bit Python int as a signed int64 constant."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MUL1 = _i64(0xBF58476D1CE4E5B9)
_MUL2 = _i64(0x94D049BB133111EB)
_INDEX_SALT = _i64(0x2545F4914F6CDD1D)


def _lshr(x: torch.Tensor, k: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; mask off the sign-extended bits for a logical shift.
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x_N: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer of int64 inputs; int64 output (all 64 bits used)."""
    z = x_N.to(torch.int64) + _GOLDEN
    z = (z ^ _lshr(z, 30)) * _MUL1
    z = (z ^ _lshr(z, 27)) * _MUL2
    return z ^ _lshr(z, 31)


def owner_rank(ids_N: torch.Tensor, world_size: int) -> torch.Tensor:
    """Rank that owns each id: splitmix64(id) mod world_size (stable across runs)."""
    if world_size == 1:
        return torch.zeros_like(ids_N)
    return _lshr(splitmix64(ids_N), 1) % world_size


def uniform01(seed: int, ids_N: torch.Tensor, num_columns: int) -> torch.Tensor:
    """float64 [N, num_columns] uniforms in [0, 1), a pure function of (seed, id, column)."""
    base_N1 = splitmix64(ids_N.to(torch.int64) ^ splitmix64(torch.tensor([seed]))).unsqueeze(1)
    cols_1K = torch.arange(num_columns, dtype=torch.int64).unsqueeze(0) * _GOLDEN
    bits_NK = _lshr(splitmix64(base_N1 + cols_1K), 11)  # top 53 bits -> exact in float64
    return bits_NK.to(torch.float64) * (1.0 / (1 << 53))


LFU_FREQ_BITS = 22


def lfu_score(freq_N: torch.Tensor, last_access_N: torch.Tensor) -> torch.Tensor:
    """LFU's eviction score (lower leaves first): the count above the last access in one
    int64, the count saturated at 2^22 - 1 (more sightings rank level, then by last access)
    and the last access at 2^41 - 1, so that the sum never wraps (a wrapped score put the
    most used row first in line). As csrc/store.c's lfu_score."""
    last_bits = 63 - LFU_FREQ_BITS
    return (freq_N.clamp(max=(1 << LFU_FREQ_BITS) - 1) * (1 << last_bits)
            + last_access_N.clamp(max=(1 << last_bits) - 1))


def rank_order(score_N: torch.Tensor, ids_N: torch.Tensor) -> torch.Tensor:
    """Permutation sorting by (score, id) ascending: with unique ids a total order that
    any process rebuilds from the same rows, whatever their slots."""
    order_N = torch.argsort(ids_N)
    return order_N[torch.argsort(score_N[order_N], stable=True)]


def lowest_k(score_N: torch.Tensor, ids_N: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k lowest (score, id) pairs, lowest first (O(N) select, then a sort
    of the candidates only)."""
    n = int(score_N.numel())
    k = min(k, n)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64)
    cand_M = torch.arange(n)
    if k < n:
        kth = torch.kthvalue(score_N, k).values
        cand_M = (score_N <= kth).nonzero().squeeze(1)
    return cand_M[rank_order(score_N[cand_M], ids_N[cand_M])[:k]]


def _splitmix64_(z: torch.Tensor) -> torch.Tensor:
    """In-place splitmix64 finalizer (z already offset); saves the temporaries of the
    functional form, which dominate row initialization at scale."""
    t = torch.empty_like(z)
    for shift, mul in ((30, _MUL1), (27, _MUL2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(t)
        if mul is not None:
            z.mul_(mul)
    return z


def uniform01_f32(seed: int, ids_N: torch.Tensor, num_columns: int) -> torch.Tensor:
    """float32 [N, num_columns] uniforms in [0, 1), a pure function of (seed, id, column):
    each 64-bit hash yields two 24-bit uniforms (exact in float32)."""
    n_pairs = (num_columns + 1) // 2
    base_N1 = splitmix64(ids_N.to(torch.int64) ^ splitmix64(torch.tensor([seed]))).unsqueeze(1)
    z_NP = base_N1 + torch.arange(1, n_pairs + 1, dtype=torch.int64).unsqueeze(0) * _GOLDEN
    _splitmix64_(z_NP)
    hi_NP = _lshr(z_NP, 40)
    lo_NP = z_NP.bitwise_and_((1 << 24) - 1)
    u_NK = torch.stack([hi_NP, lo_NP], dim=2).view(ids_N.numel(), 2 * n_pairs)[:, :num_columns]
    return u_NK.to(torch.float32).mul_(1.0 / (1 << 24))


EMPTY = -1
_PROBE_WINDOW = 16
TOMBSTONE = -2


class TensorHashMap:
    """int64 key -> int64 value map with linear probing, every operation vectorized.

    Keys must be >= 0 (EMPTY and TOMBSTONE are negative). Deletion leaves tombstones;
    the map rehashes itself when live + tombstones pass 1/2 of the capacity, so probe
    chains stay short (the probe loop runs max-chain-length times, not once per key, and
    each round only over the keys still probing). `value_width=K` stores int64 [K] per
    key (values_C is [C, K]) instead of one int64.
    """

    def __init__(self, capacity: int = 1024, value_width: int | None = None) -> None:
        self.value_width = value_width
        self._allocate(1 << max(4, (max(capacity, 1) * 2 - 1).bit_length()))

    def _allocate(self, cap: int) -> None:
        self.keys_C = torch.full((cap,), EMPTY, dtype=torch.int64)
        shape = (cap,) if self.value_width is None else (cap, self.value_width)
        self.values_C = torch.zeros(shape, dtype=torch.int64)
        self.num_live = 0
        self.num_tombstones = 0

    @property
    def capacity(self) -> int:
        return int(self.keys_C.numel())

    def __len__(self) -> int:
        return self.num_live

    def _home(self, keys_N: torch.Tensor) -> torch.Tensor:
        # Salted as csrc/store.c's mix64: unsalted, the home slot's low bits are the bits
        # `owner_rank` reads, constant on a rank (2 ranks: every home slot even or every odd).
        return _lshr(splitmix64(keys_N ^ _INDEX_SALT), 1) & (self.capacity - 1)

    def find_slots(self, keys_N: torch.Tensor) -> torch.Tensor:
        """Slot index of each key in the table, -1 where absent."""
        if keys_N.numel() == 0 or self.num_live == 0:
            return torch.full_like(keys_N, -1)
        mask = self.capacity - 1
        pos_N = self._home(keys_N)
        # First probe for everyone at once (most keys sit in their home slot), then loop
        # over the few that need to probe further.
        found_N = self.keys_C[pos_N]
        hit_N = found_N == keys_N
        slots_N = torch.where(hit_N, pos_N, -1)
        pending_P = (~hit_N & (found_N != EMPTY)).nonzero().squeeze(1)
        want_P = keys_N[pending_P]
        pos_P = (pos_N[pending_P] + 1) & mask
        # The rest probe a window of slots per round: one gather instead of one round per
        # slot (rounds cost fixed op overhead; the few keys past the window loop again).
        # A present key never lies past an EMPTY in its chain, so any hit is the key.
        window_1K = torch.arange(_PROBE_WINDOW, dtype=torch.int64).unsqueeze(0)
        while pending_P.numel() > 0:
            pos_PK = (pos_P.unsqueeze(1) + window_1K) & mask
            found_PK = self.keys_C[pos_PK]
            hit_PK = found_PK == want_P.unsqueeze(1)
            hit_P = hit_PK.any(dim=1)
            hit_idx = hit_P.nonzero().squeeze(1)
            first = hit_PK[hit_idx].to(torch.uint8).argmax(dim=1)
            slots_N[pending_P[hit_idx]] = pos_PK[hit_idx, first]
            keep_P = ~hit_P & ~(found_PK == EMPTY).any(dim=1)
            pending_P, want_P = pending_P[keep_P], want_P[keep_P]
            pos_P = (pos_P[keep_P] + _PROBE_WINDOW) & mask
        return slots_N

    def get(self, keys_N: torch.Tensor, default: int = -1) -> torch.Tensor:
        slots_N = self.find_slots(keys_N)
        out_N = torch.full((keys_N.numel(), *self.values_C.shape[1:]), default, dtype=torch.int64)
        ok_N = slots_N >= 0
        out_N[ok_N] = self.values_C[slots_N[ok_N]]
        return out_N

    def insert_new(self, keys_N: torch.Tensor, values_N: torch.Tensor) -> None:
        """Insert keys known to be absent and unique."""
        n = int(keys_N.numel())
        if n == 0:
            return
        if (self.num_live + self.num_tombstones + n) * 2 > self.capacity:
            self._rehash(self.num_live + n)
        mask = self.capacity - 1
        pos_P = self._home(keys_N)
        want_P, val_P = keys_N, values_N
        while want_P.numel() > 0:
            free_P = self.keys_C[pos_P] < 0
            # Several pending keys may target the same free slot: write, read back, and
            # let the losers probe on.
            cand = free_P.nonzero().squeeze(1)
            was_tomb_P = self.keys_C[pos_P[cand]] == TOMBSTONE
            self.keys_C[pos_P[cand]] = want_P[cand]
            won_c = self.keys_C[pos_P[cand]] == want_P[cand]
            won_idx = cand[won_c]
            self.values_C[pos_P[won_idx]] = val_P[won_idx]
            self.num_tombstones -= int(was_tomb_P[won_c].sum())
            done_P = torch.zeros_like(free_P)
            done_P[won_idx] = True
            keep_P = ~done_P
            want_P, val_P, pos_P = want_P[keep_P], val_P[keep_P], (pos_P[keep_P] + 1) & mask
        self.num_live += n

    def set_existing(self, slots_N: torch.Tensor, values_N: torch.Tensor) -> None:
        self.values_C[slots_N] = values_N

    def remove_slots(self, slots_N: torch.Tensor) -> None:
        if slots_N.numel() == 0:
            return
        self.keys_C[slots_N] = TOMBSTONE
        self.num_live -= int(slots_N.numel())
        self.num_tombstones += int(slots_N.numel())

    def live_slots(self) -> torch.Tensor:
        return (self.keys_C >= 0).nonzero().squeeze(1)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        live_C = self.keys_C >= 0
        return self.keys_C[live_C], self.values_C[live_C]

    def clear(self) -> None:
        self.keys_C.fill_(EMPTY)
        self.num_live = 0
        self.num_tombstones = 0

    def _rehash(self, min_live: int) -> None:
        keys_L, values_L = self.items()
        # Load in [1/4, 1/2) after a rehash: 32-64 bytes per live key, short probe chains.
        self._allocate(1 << max(4, (max(min_live, 1) * 2).bit_length()))
        self.insert_new(keys_L, values_L)


class ReferenceIndex(TensorHashMap):
    """The PyTorch id index (kernels="reference") behind native.NativeIndex's interface;
    the tier descriptor those calls take is not needed here (keys are stored)."""

    def get(self, ids_N: torch.Tensor, tiers=None) -> torch.Tensor:
        return super().get(ids_N)

    def insert(self, ids_N: torch.Tensor, loc_N: torch.Tensor, tiers=None) -> None:
        self.insert_new(ids_N, loc_N)

    def remove(self, ids_N: torch.Tensor, tiers=None) -> None:
        slots_N = self.find_slots(ids_N)
        self.remove_slots(slots_N[slots_N >= 0])

    def items(self, tiers=None) -> tuple[torch.Tensor, torch.Tensor]:
        return super().items()

    @property
    def nbytes(self) -> int:
        return (self.keys_C.numel() + self.values_C.numel()) * 8
