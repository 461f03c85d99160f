"""Memory-mapped tables: how the kernel reads them, and a bounded cache of their hot rows.

An artifact's tables stay memory-mapped (`artifact.ServingTable`), so a lookup reads rows
from the page cache, or from disk once the kernel has dropped them.

Reading. A lookup touches rows scattered over the whole table, and the kernel's default
readahead answers each fault on a mapped file with a large window: 1,024 random rows of a
cold 512 MB fp32 table read the whole file (503 MB, 0.48 s) where one page per row is 4.3
MB (30 ms). Tables are therefore advised MADV_RANDOM once loaded (`advise_random`).

Caching. When a table is larger than memory, the page cache is shared with everything else
the machine reads (the item index's scan among them) and hot rows are evicted with cold
ones; `RowCache` keeps the rows requests actually read in the process's own memory, already
widened to fp32, up to a bound. It is direct-mapped on the row's position in the table: one
vectorised probe per lookup, no per-id Python work. Neither the OS page cache (no bound per table, no say in
what stays) nor a library LRU keyed per id (a Python call per row: ~1 us x 1,024 history
rows) does this, hence written here.

The cached rows are the table's own rows, which never change while it is served (a live
delta patches on top: `ServingTable.patch` is read after this cache), so an entry never
goes stale; a cache belongs to one table's (ids, rows) pair.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

import torch

from genrec.sparse import native
from genrec.sparse.tiers import MADV_DONTNEED, MADV_RANDOM, advise_pages, drop_file_cache

log = logging.getLogger(__name__)

SLOT_BYTES_OVERHEAD = 8
"""Per slot beside its fp32 row: the int64 position it holds."""


def _mapped_file(address: int) -> Path | None:
    """The file whose mapping holds `address` in this process (/proc/self/maps), if any."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return Path(parts[5].strip()) if len(parts) == 6 and parts[5].startswith("/") else None
    return None


def advise_random(*tensors: torch.Tensor | None) -> None:
    """Advise the kernel that these (mapped) tensors are read at random: no readahead."""
    for t in tensors:
        if t is not None and (err := advise_pages(t, MADV_RANDOM)):
            log.debug("madvise(MADV_RANDOM) refused: %s", os.strerror(err))  # advice only


def evict(root: Path, *tensors: torch.Tensor | None) -> None:
    """Make the next reads of these mapped tensors (files under `root`) come from disk:
    their pages are unmapped from this process (posix_fadvise alone keeps pages that a
    process maps) and then dropped from the page cache. For cold measurements."""
    root = Path(root).resolve()
    for t in tensors:
        if t is not None:
            # On anonymous (or written private) memory MADV_DONTNEED discards the contents:
            # only a file's mapping, read-only in practice, is given it.
            mapped = _mapped_file(t.untyped_storage().data_ptr())
            if mapped is None or root not in mapped.parents:
                raise ValueError(f"evict: a tensor is not a mapping of a file under {root} (it maps {mapped})")
            if err := advise_pages(t, MADV_DONTNEED):
                raise OSError(err, f"evict: madvise(MADV_DONTNEED) on {mapped}: {os.strerror(err)}")
    for path in root.rglob("*"):
        if path.is_file():
            drop_file_cache(path)


def will_need_rows(t: torch.Tensor | None, pos: torch.Tensor) -> None:
    """Start reading the pages of rows `pos` of a mapped [N, D] table, without waiting: the
    disk then serves them at its queue depth, where the gather's faults come one at a time.
    A syscall per row (~1-2 us), so for tables likely read from the disk only."""
    global _read_ahead
    if t is None or not pos.numel() or not _read_ahead:
        return
    row_bytes = t.shape[1] * t.element_size()
    try:
        native.slab_rows_will_need(torch.tensor([t.data_ptr()]), t.shape[0], row_bytes, pos)
    except native.NativeKernelError as e:
        # Advice only: a server without the store's kernels (another CPU, no build) answers
        # the same, its misses faulted in one at a time.
        _read_ahead = False
        log.warning("hot-row caches read their misses without read-ahead: %s", e)


_read_ahead = True


def disk_read_bytes() -> int:
    """Bytes this process has caused to be read from storage so far (/proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


class RowCache:
    """fp32 rows of one table by position, in `capacity` slots (a power of two)."""

    def __init__(self, num_rows: int, dim: int, max_bytes: int):
        slots = max(1, max_bytes // (4 * dim + SLOT_BYTES_OVERHEAD))
        slots = min(slots, max(1, num_rows))  # never more slots than rows
        self.capacity = 1 << (slots.bit_length() - 1)
        self.mask = self.capacity - 1
        self.held_N = torch.full((self.capacity,), -1, dtype=torch.int64)
        self.rows_ND = torch.zeros(self.capacity, dim)
        self.hits = 0
        self.misses = 0
        # Two batch workers may look up at once: a probe must not see a slot's position
        # written and its row not yet. Only the vectorised probe and fill hold the lock.
        self._lock = threading.Lock()

    def nbytes(self) -> int:
        return self.held_N.nbytes + self.rows_ND.nbytes

    def lookup(self, pos: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fp32 [len(pos), D]: cached rows where held, `read(positions)` (fp32 rows) for the
        rest, which then take their slots."""
        slot = pos & self.mask
        with self._lock:
            hit = self.held_N[slot] == pos
            out = self.rows_ND[slot]  # a copy; rows that missed are overwritten below
            miss = (~hit).nonzero().squeeze(1)
            self.hits += pos.numel() - miss.numel()
            self.misses += miss.numel()
        if miss.numel() == 0:
            return out
        fresh = read(pos[miss])
        out[miss] = fresh
        mslot, mpos = slot[miss], pos[miss]
        with self._lock:
            # Two missed positions may share a slot: the position written last wins, and
            # only the rows of the positions that won are written, so a slot's row is
            # always its position's.
            self.held_N[mslot] = mpos
            won = (self.held_N[mslot] == mpos).nonzero().squeeze(1)
            self.rows_ND[mslot[won]] = fresh[won]
        return out

    def stats(self) -> dict[str, int]:
        return {"capacity_rows": self.capacity, "bytes": self.nbytes(), "hits": self.hits, "misses": self.misses}
