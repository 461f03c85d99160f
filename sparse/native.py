"""The store's native kernels (csrc/store.c), loaded through ctypes and registered as
torch.library operators (`torch.ops.genrec_sparse.*`, CPU kernels); the store's own
eager hot path calls the same Python functions directly (see "operators" below).

The library is built by the install command (setup.py: `pip install -e .`) beside this
file as `_store_kernels*.so`, for the instruction set in `ISA_FLAGS`; loading checks that
this CPU has it. Missing or unsuitable, `load()` raises `NativeKernelError` saying how to
fix it: there is no silent fallback. `SparseConfig.kernels = "reference"` chooses the
PyTorch implementation explicitly (same rows bit for bit, several times slower) and says
so once.

The operators act on a store's tier tensors in place through a tier descriptor
(`TierView`, laid out in csrc/store.c), and on its index through a native handle: they
are eager kernels (no fake / meta kernels), like the store they serve.

Legend: N = ids in a call, U = unique ids, D = embedding dim.
"""

from __future__ import annotations

import ctypes
import itertools
import platform
import sys
import weakref
from pathlib import Path

import torch

ISA_FLAGS = {"x86_64": ("avx2", "fma")}
"""CPU features the library is built for, by machine (see setup.py)."""

OPTIMIZERS = {"rowwise_adagrad": 0, "sgd": 1}
"""Optimizers the native step implements (Adam runs the PyTorch step on natively located rows)."""

NO_EXPIRY = -(1 << 63)
"""`expire_before` that expires nothing."""

_lib: ctypes.CDLL | None = None
_reference_noted = False


class NativeKernelError(RuntimeError):
    """The store's native kernels are missing or cannot run on this CPU."""


def _cpu_flags() -> set[str]:
    # genrec.dense.fused reads the same file for its own library; the ground floors import
    # nothing of each other, so each keeps this dozen lines.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    except OSError:
        pass
    return set()


def note_reference() -> None:
    """Say once per process that a store runs the PyTorch reference kernels."""
    global _reference_noted
    if not _reference_noted:
        _reference_noted = True
        print("genrec.sparse: kernels='reference': the store runs its PyTorch reference kernels (slower)",
              file=sys.stderr, flush=True)


_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "ix_new": ([], _P), "ix_free": ([_P], None), "ix_len": ([_P], _I), "ix_bytes": ([_P], _I),
    "ix_peak_bytes": ([_P], _I), "ix_reset_peak": ([_P], None),
    "ix_find": ([_P, _P, _P, _I, _P], None), "ix_candidates": ([_P, _P, _I, _P], None), "ix_insert": ([_P, _P, _P, _P, _I], _I),
    "ix_remove": ([_P, _P, _P, _I], _I), "ix_items": ([_P, _P, _P, _P], None),
    "fwd_lookup": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P], _I),
    "grad_accumulate": ([_P, _I, _P, _I, _P], None),
    "apply_rows": ([_P, _P, _I, _P, _I, ctypes.c_float, ctypes.c_float, ctypes.c_float, _I, _I], _I),
    "bwd_apply": ([_P, _P, _I, _P, _P, _I, _I, ctypes.c_float, ctypes.c_float, ctypes.c_float, _I, _I], _I),
    "clock_victims": ([_P, _P, _P, _I, _P, _I, _I, _I, _P], _I),
    "expired_slots": ([_P, _P, _I, _I, _I, _I, _P, _I, _P], _I),
    "lowest_rows": ([_P, _I, _I, _I, _P, _P], _I),
    "slab_rows_copy": ([_P, _I, _I, _P, _I, _P, _I], None),
    "slab_rows_copy_mt": ([_P, _I, _I, _P, _I, _P, _I, _I], None),
    "slab_rows_will_need": ([_P, _I, _I, _P, _I], _I),
}


def load() -> ctypes.CDLL:
    """The loaded native library (raises NativeKernelError when it cannot be used)."""
    global _lib
    if _lib is not None:
        return _lib
    here = Path(__file__).parent
    built = sorted(here.glob("_store_kernels*.so"))
    fix = ("reinstall with the README's install command (`pip install -e .`, which needs a C compiler), "
           "or set the sparse config's kernels = \"reference\" to run the PyTorch kernels instead")
    if not built:
        raise NativeKernelError(f"the store's native kernels are not built (no _store_kernels*.so in {here}): {fix}")
    missing = [f for f in ISA_FLAGS.get(platform.machine(), ()) if f not in _cpu_flags()]
    if missing:
        raise NativeKernelError(f"{built[-1]} needs CPU features {missing}, which this CPU lacks: {fix}")
    try:
        lib = ctypes.CDLL(str(built[-1]))
    except OSError as e:
        raise NativeKernelError(f"cannot load {built[-1]}: {e}: {fix}") from None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _lib = lib
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# ---------------------------------------------------------------------------- operators
# The store's eager hot path calls these functions directly; the same functions are
# the CPU kernels of the torch.library operators below. Through the dispatcher a call
# boxes its arguments and calls back into Python: measured 0.1-0.15 ms per fwd_lookup
# (17 arguments), a few percent of a 16K-id training step.
def fwd_lookup(tiers, index, ids, counts, serve_mask, expire_before, open_from, step, inv, uniq, cnt, loc,
               out, ref0, ref1, ref_max, hits) -> int:
    lib = _lib or load()
    return lib.fwd_lookup(index, tiers.data_ptr(), ids.data_ptr(), _ptr(counts), ids.numel(), serve_mask,
                          expire_before, open_from, step, inv.data_ptr(), uniq.data_ptr(), cnt.data_ptr(),
                          loc.data_ptr(), _ptr(out), _ptr(ref0), _ptr(ref1), ref_max, _ptr(hits))


def grad_accumulate(inv, grad, acc) -> None:
    lib = _lib or load()
    lib.grad_accumulate(inv.data_ptr(), inv.numel(), grad.data_ptr(), grad.shape[1], acc.data_ptr())


def apply_rows(tiers, loc, grad, optimizer, lr, eps, weight_decay, set_update, now) -> None:
    lib = _lib or load()
    if lib.apply_rows(tiers.data_ptr(), loc.data_ptr(), loc.numel(), grad.data_ptr(), optimizer, lr, eps,
                      weight_decay, set_update, now):
        raise MemoryError("genrec.sparse: the native optimizer step could not allocate its scratch row")


def bwd_apply(tiers, inv, grad, loc, optimizer, lr, eps, weight_decay, set_update, now) -> None:
    """grad_accumulate then apply_rows in one native call, for a committed lookup's rows."""
    lib = _lib or load()
    if lib.bwd_apply(tiers.data_ptr(), inv.data_ptr(), inv.numel(), grad.data_ptr(), loc.data_ptr(), loc.numel(),
                     optimizer, lr, eps, weight_decay, set_update, now):
        raise MemoryError("genrec.sparse: the native backward could not allocate its scratch rows")


_ops = torch.library.Library("genrec_sparse", "DEF")
_ops.define("fwd_lookup(Tensor tiers, int index, Tensor ids, Tensor? counts, int serve_mask, int expire_before, "
            "int open_from, int step, Tensor(a!) inv, Tensor(b!) uniq, Tensor(c!) cnt, Tensor(d!) loc, "
            "Tensor(e!)? out, Tensor(f!)? ref0, Tensor(g!)? ref1, int ref_max, Tensor(h!)? hits) -> int")
_ops.define("grad_accumulate(Tensor inv, Tensor grad, Tensor(a!) acc) -> ()")
_ops.define("apply_rows(Tensor tiers, Tensor loc, Tensor grad, int optimizer, float lr, float eps, "
            "float weight_decay, int set_update, int now) -> ()")
_ops.define("bwd_apply(Tensor tiers, Tensor inv, Tensor grad, Tensor loc, int optimizer, float lr, float eps, "
            "float weight_decay, int set_update, int now) -> ()")
_ops.impl("fwd_lookup", fwd_lookup, "CPU")
_ops.impl("grad_accumulate", grad_accumulate, "CPU")
_ops.impl("apply_rows", apply_rows, "CPU")
_ops.impl("bwd_apply", bwd_apply, "CPU")


# ---------------------------------------------------------------------------- the store's view
_layouts = itertools.count(1)


def new_layout() -> int:
    """A fresh layout number: a tier takes one whenever its slabs change (see TierView)."""
    return next(_layouts)


class TierView:
    """The int64 [17] tier descriptor of csrc/store.c for a store's three tiers, with the
    slab address arrays it points into (kept alive here). Rebuilt only when a tier's
    layout number changes (a slab added, a tier replaced)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.desc = torch.zeros(17, dtype=torch.int64)
        self._keep: list[torch.Tensor] = []

    def of(self, tiers, dim: int) -> torch.Tensor:
        key = tuple(t.layout for t in tiers)
        if key == self.key:
            return self.desc
        keep, d = [], [0] * 17
        for t, tier in enumerate(tiers):
            d[t], d[3 + t] = len(tier.ids.slabs), tier.ids.slab_rows
            for k, array in ((6, tier.rows), (9, tier.ids), (12, tier.meta)):
                addrs = torch.tensor([s.data_ptr() for s in array.slabs] or [0], dtype=torch.int64)
                keep.append(addrs)
                d[k + t] = addrs.data_ptr()
        d[15], d[16] = tiers[0].rows.width, dim
        self.desc, self._keep, self.key = torch.tensor(d, dtype=torch.int64), keep, key
        return self.desc


class NativeIndex:
    """id -> loc (slot << 2 | tier) in native memory (8 bytes per entry, see csrc/store.c).
    Entries are checked against the tiers' id slabs, so every call takes the store's tier
    descriptor, and a row must leave the index before its slot is freed."""

    def __init__(self) -> None:
        lib = load()
        self.handle = lib.ix_new()
        if not self.handle:
            raise MemoryError("genrec.sparse: cannot allocate the native index")
        weakref.finalize(self, lib.ix_free, self.handle)

    def __len__(self) -> int:
        return _lib.ix_len(self.handle)

    @property
    def nbytes(self) -> int:
        return _lib.ix_bytes(self.handle)

    def peak_nbytes(self, reset: bool = False) -> int:
        """Most bytes held at once (a growing segment holds its old and new tables)."""
        peak = _lib.ix_peak_bytes(self.handle)
        if reset:
            _lib.ix_reset_peak(self.handle)
        return peak

    def get(self, ids_N: torch.Tensor, tiers: torch.Tensor) -> torch.Tensor:
        ids_N = ids_N.contiguous()
        out_N = torch.empty_like(ids_N)
        _lib.ix_find(self.handle, tiers.data_ptr(), ids_N.data_ptr(), ids_N.numel(), out_N.data_ptr())
        return out_N

    def candidates(self, ids_N: torch.Tensor) -> torch.Tensor:
        """Each id's probable location, or -1, read from the index alone (see ix_candidates
        in csrc/store.c): for read-ahead advice only."""
        ids_N = ids_N.contiguous()
        out_N = torch.empty_like(ids_N)
        _lib.ix_candidates(self.handle, ids_N.data_ptr(), ids_N.numel(), out_N.data_ptr())
        return out_N

    def insert(self, ids_N: torch.Tensor, loc_N: torch.Tensor, tiers: torch.Tensor) -> None:
        ids_N, loc_N = ids_N.contiguous(), loc_N.contiguous()
        r = _lib.ix_insert(self.handle, tiers.data_ptr(), ids_N.data_ptr(), loc_N.data_ptr(), ids_N.numel())
        if r == -2:
            raise ValueError("genrec.sparse: a tier slot past 2^40 cannot be indexed (shard the table over more ranks)")
        if r:
            raise MemoryError(f"genrec.sparse: the native index cannot grow past {len(self)} rows")

    def remove(self, ids_N: torch.Tensor, tiers: torch.Tensor) -> None:
        ids_N = ids_N.contiguous()
        _lib.ix_remove(self.handle, tiers.data_ptr(), ids_N.data_ptr(), ids_N.numel())

    def items(self, tiers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        ids_N, loc_N = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        _lib.ix_items(self.handle, tiers.data_ptr(), ids_N.data_ptr(), loc_N.data_ptr())
        return ids_N, loc_N


CLOCK_MAX = {"lru": 1, "lfu": 7}
"""Cap on a slot's CLOCK count by cache policy: 1 is CLOCK (recency), 7 generalized CLOCK
(a row seen often survives that many turns of the hand)."""


def clock_victims(tier, ref_S: torch.Tensor, hand: torch.Tensor, k: int, step: int, ref_max: int) -> torch.Tensor:
    """Up to k CLOCK victim slots of a one-slab memory tier (see csrc/store.c)."""
    out = torch.empty(k, dtype=torch.int64)
    m = _lib.clock_victims(tier.ids.slabs[0].data_ptr(), tier.meta.slabs[0].data_ptr(), ref_S.data_ptr(),
                           tier.capacity, hand.data_ptr(), k, step, ref_max, out.data_ptr())
    return out[:m]


def slab_rows_copy(slab_addrs: torch.Tensor, slab_rows: int, slots_N: torch.Tensor, buf: torch.Tensor,
                   scatter: bool, threads: int = 1) -> None:
    """Rows at `slots_N` of a multi-slab array into `buf` [N, ...] (or `buf` into them,
    `scatter`), in one native call (see csrc/store.c); `threads` > 1 splits the rows over
    that many threads (memory-mapped files: reads in flight at once). The caller checks
    dtypes and shapes."""
    row_bytes = buf[0].numel() * buf.element_size() if buf.shape[0] else 0
    if threads > 1:
        load().slab_rows_copy_mt(slab_addrs.data_ptr(), slab_rows, row_bytes, slots_N.data_ptr(), slots_N.numel(),
                                 buf.data_ptr(), int(scatter), threads)
        return
    load().slab_rows_copy(slab_addrs.data_ptr(), slab_rows, row_bytes, slots_N.data_ptr(), slots_N.numel(),
                          buf.data_ptr(), int(scatter))


def slab_rows_will_need(slab_addrs: torch.Tensor, slab_rows: int, row_bytes: int, slots_N: torch.Tensor) -> int:
    """Start reading the pages of the rows at `slots_N` of memory-mapped slabs into the
    page cache without waiting (see csrc/store.c); the number of page ranges advised."""
    slots_N = slots_N.contiguous()
    return load().slab_rows_will_need(slab_addrs.data_ptr(), slab_rows, row_bytes, slots_N.data_ptr(),
                                      slots_N.numel())


def lowest_rows(tiers: torch.Tensor, k: int, lfu: bool, open_from: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loc, ids) of the k rows of all tiers with the lowest (policy score, id), lowest
    first, skipping rows looked up at or after open_from (see csrc/store.c)."""
    loc_K, ids_K = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=torch.int64)
    m = _lib.lowest_rows(tiers.data_ptr(), k, int(lfu), open_from, loc_K.data_ptr(), ids_K.data_ptr())
    if m < 0:
        raise MemoryError(f"genrec.sparse: cannot allocate the {k}-row heap of a max_rows drop")
    return loc_K[:m], ids_K[:m]


def expired_slots(tier, expire_before: int, open_from: int, chunk: int = 1 << 16):
    """Yield slots (global to the tier) of expired rows, at most `chunk` at a time, slab
    by slab: the sweep holds no temporary the size of the table. The caller may free the
    yielded slots before asking for more."""
    out = torch.empty(chunk, dtype=torch.int64)
    nxt = torch.zeros(1, dtype=torch.int64)
    for s, (ids_slab, meta_slab) in enumerate(zip(tier.ids.slabs, tier.meta.slabs)):
        start = 0
        while start < tier.ids.slab_rows:
            m = _lib.expired_slots(ids_slab.data_ptr(), meta_slab.data_ptr(), tier.ids.slab_rows, start,
                                   expire_before, open_from, out.data_ptr(), chunk, nxt.data_ptr())
            start = int(nxt[0])
            if m:
                yield out[:m] + s * tier.ids.slab_rows

