"""Storage tiers: fixed-capacity memory tiers and a growable SSD tier of memory-mapped slabs.

SSD engine choice. The SSD tier is a set of fixed-size slab files mapped with
`torch.from_file(shared=True)`: a batch's rows are read and written with ordinary torch
fancy indexing or one native copy across slabs, the page cache merges writes, and
nothing new is installed. Measured on this machine (sparse/bench.py) it reads and writes
millions of rows/s of dim 64-128 warm; a key-value store such as sqlite or RocksDB would
cost a Python call (or a batch API with serialization) per row. Cold, a row is a page
fault: the slabs are advised for random access (one page read per row, not readahead).
Before a lookup touches its SSD rows, `will_need` asks the kernel for all their pages at
once (madvise MADV_WILLNEED queues the reads and returns), so the disk works at its full
queue depth where faults would come one per thread; the trainer does the same for the
next batch before each step, on a background thread, overlapping the reads with compute
(TableStore.read_ahead).
At `genrec bench sparse --quick` sizes, switching it off took offload_ratio_store_only
from 0.12 to 0.022 and offload_ratio (with the tower) from 0.78 to 0.40;
a preadv / io_uring engine would add O_DIRECT (a DRAM budget that excludes the page
cache) at the cost of its own row cache. Large copies also run on SSD_IO_THREADS threads.
Crash safety does not come from the live slabs: they are
a spill area that is recreated empty when a store opens (files of an earlier run that
match `SLAB_FILE` are removed then), and durability comes from snapshots (snapshot.py),
which are checksummed and published by an atomic manifest rename. A write-ahead log
on the live tier would double the write traffic of every spill for no gain, since an
exact continuation needs the dense model's checkpoint from the same moment anyway.

Every tier keeps, per slot: the packed row (fp32 [W]), its id (-1 = free), and its
metadata (int64 [3]: last access step, access count, last update event time).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import native
from .native import new_layout

META_LAST_ACCESS, META_FREQ, META_LAST_UPDATE = 0, 1, 2
NUM_META = 3
# Every file a store names as its slab: <prefix>.<rows|ids|meta>.<5 digits>.slab, with a
# prefix "tier" (older runs) or "tier.g<generation>" (TableStore: one per snapshot load).
SLAB_FILE = re.compile(r"tier(\.g\d+)?\.(rows|ids|meta)\.\d{5}\.slab")


_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14
SSD_IO_THREADS = 8
"""Threads that copy a large batch of SSD-tier rows: reads in flight at once. Measured on
this machine's disk, 4,096 cold rows of a 2M-row tier: 17-20K rows/s on one thread, 40K
on 8, 45-51K on 16-32, where starting the threads halved the warm (page-cache) rate."""
SSD_IO_MIN_ROWS = 1024
"""Smaller batches are copied on the calling thread (starting threads costs more)."""
MADV_RANDOM = 1
_MADV_WILLNEED = 3
_WILLNEED_CHUNK = 128 << 10
MADV_DONTNEED = 4
_MS_SYNC = 4
_libc = None
_adviser_pool: ThreadPoolExecutor | None = None


def _adviser() -> ThreadPoolExecutor:
    """The one thread that gives read-ahead advice in the background (Tier.will_need): with
    many pages advised, madvise blocks once the disk's request queue is full (256 requests
    here), and measured at `genrec bench sparse` full size that kept the training thread
    waiting 10-12 ms a step; on this thread the step computes meanwhile. FIFO, so advice is
    given in the order asked."""
    global _adviser_pool
    if _adviser_pool is None:
        _adviser_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genrec-ssd-advice")
    return _adviser_pool


def _forget_adviser() -> None:  # a forked child has the object but not its thread
    global _adviser_pool
    _adviser_pool = None


os.register_at_fork(after_in_child=_forget_adviser)


def _c_library():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc


def drop_file_cache(path: str | os.PathLike) -> None:
    """Write a file's dirty pages, then drop its pages from the page cache (posix_fadvise:
    pages a process maps stay; unmap them first, MADV_DONTNEED). For cold-read measurements."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def advise_pages(t: torch.Tensor, advice: int) -> int:
    """madvise(2) over every page that holds `t`'s storage (a CPU tensor): 0, or the errno
    of a refusal. Also for other layers' mapped files (the serving tables)."""
    storage = t.untyped_storage()
    if t.device.type != "cpu" or storage.nbytes() == 0:
        return 0
    start = storage.data_ptr() & ~(mmap.PAGESIZE - 1)
    end = (storage.data_ptr() + storage.nbytes() + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)
    return ctypes.get_errno() if _c_library().madvise(start, end - start, advice) else 0


def _advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux to back a large CPU tensor with transparent huge pages (before it is first
    touched). A tier's slots are read at random, so with 4 KB pages nearly every row costs a
    TLB miss; where THP runs in "madvise" mode (a common default) nothing else turns them
    on. A no-op where madvise or THP is unavailable."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < 2 * _HUGE_PAGE or not os.path.exists("/sys/kernel/mm/transparent_hugepage"):
        return
    start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (t.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
    _c_library().madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing


def remove_slab_files(directory: str) -> None:
    """Delete the slab files an earlier store left in `directory`, and nothing else."""
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if SLAB_FILE.fullmatch(name):
                os.remove(os.path.join(directory, name))


def _reserve(path: str, nbytes: int) -> None:
    """Create the slab file with its blocks allocated. A mapping of a sparse file meets a
    full disk at its first write to a new page, as a SIGBUS that kills the process with no
    word of why; allocating up front makes it an OSError here, naming the directory (the
    store and its last snapshot are untouched: the caller has changed nothing yet)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise _tier_error(path, nbytes, e) from e
    error = None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        # A filesystem that cannot reserve blocks: the mapping grows as before.
        error = None if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL) else e
    finally:
        os.close(fd)
    if error is not None:
        os.remove(path)  # the file this call created
        raise _tier_error(path, nbytes, error) from error


def _tier_error(path: str, nbytes: int, e: OSError) -> OSError:
    return OSError(e.errno, f"genrec.sparse: cannot create a {nbytes / 2**20:.1f} MiB SSD-tier slab in "
                            f"{os.path.dirname(path) or '.'}: {os.strerror(e.errno)}; free space there or point "
                            "sparse.ssd_dir at another directory")


class _SlabArray:
    """A 2-D array of rows in equal slabs: one in-memory tensor, or files mapped in memory."""

    def __init__(self, width: int, dtype: torch.dtype, slab_rows: int, path_prefix: str | None,
                 device: torch.device, fill: float | int, unlink: bool = False, native_io: bool = False) -> None:
        """native_io: gather / scatter over several CPU slabs in one native call."""
        self.width, self.dtype, self.slab_rows = width, dtype, slab_rows
        self.path_prefix, self.device, self.fill = path_prefix, device, fill
        self.unlink = unlink
        self.native_io = native_io and device.type == "cpu"
        self.slabs: list[torch.Tensor] = []
        self._addrs = torch.zeros(0, dtype=torch.int64)

    def add_slab(self) -> None:
        if self.path_prefix is None and self.fill == 0 and self.device.type == "cpu":
            # An anonymous mapping of its own: the kernel zeroes each page at its first touch,
            # so a tier takes memory and time for the rows it has held, not for its capacity.
            # (The demo's 1M-row host tiers took 15 s to fill at start; calloc would hand
            # back, and clear, heap memory that earlier tensors freed.)
            nbytes = self.slab_rows * self.width * self.dtype.itemsize
            mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            slab = torch.frombuffer(mapping, dtype=self.dtype).view(self.slab_rows, self.width)
            _advise_huge_pages(slab)
        elif self.path_prefix is None:
            slab = torch.empty((self.slab_rows, self.width), dtype=self.dtype, device=self.device)
            _advise_huge_pages(slab)
            slab.fill_(self.fill)
        else:
            path = self._path(len(self.slabs))
            if os.path.exists(path):
                os.remove(path)  # live slabs are never reused across runs (see module doc)
            numel = self.slab_rows * self.width
            _reserve(path, numel * self.dtype.itemsize)
            slab = torch.from_file(path, shared=True, size=numel, dtype=self.dtype).view(self.slab_rows, self.width)
            # Rows are read at random: left to the kernel, a fault on a cold row reads ahead
            # (measured ~500 KB read per cold row of a 1 GB tier); at random a fault reads
            # one page (4.3 KB per row measured). Advice only.
            _c_library().madvise(slab.data_ptr(), numel * self.dtype.itemsize, MADV_RANDOM)
            if self.unlink:
                # The mapping keeps the inode: the file works as before but has no name, so
                # the kernel frees its blocks when the process ends, kill -9 included.
                os.remove(path)
            if self.fill != 0:
                slab.fill_(self.fill)
        self.slabs.append(slab)
        self._addrs = torch.tensor([t.data_ptr() for t in self.slabs], dtype=torch.int64)

    def drop_last_slab(self) -> None:
        """Undo the last add_slab (a tier whose other arrays could not grow with it)."""
        self.slabs.pop()
        if self.path_prefix is not None and not self.unlink and os.path.exists(self._path(len(self.slabs))):
            os.remove(self._path(len(self.slabs)))
        self._addrs = torch.tensor([t.data_ptr() for t in self.slabs], dtype=torch.int64)

    def _path(self, i: int) -> str:
        return f"{self.path_prefix}.{i:05d}.slab"

    def drop_page_cache(self) -> None:
        """Write the file-backed slabs to disk and evict them from the page cache, so the
        next reads of them come from the disk (the cold-read benchmarks; Linux). Dirty
        pages are written first (msync); the mapping lets go of its pages (madvise), then
        the cache drops them (fadvise). A no-op for memory slabs and unlinked files."""
        if self.path_prefix is None or self.unlink:
            return
        libc = _c_library()
        for i, slab in enumerate(self.slabs):
            nbytes = slab.numel() * slab.element_size()
            if libc.msync(slab.data_ptr(), nbytes, _MS_SYNC) or libc.madvise(slab.data_ptr(), nbytes, MADV_DONTNEED):
                err = ctypes.get_errno()
                raise OSError(err, f"genrec.sparse: cannot evict {self._path(i)}: {os.strerror(err)}")
            drop_file_cache(self._path(i))

    def will_need(self, slots_N: torch.Tensor) -> int:
        """Start reading the pages of these rows of file-backed slabs into the page cache,
        without waiting (native.slab_rows_will_need); the page ranges advised. Memory slabs
        need nothing: 0."""
        if self.path_prefix is None or not self.slabs or not slots_N.numel():
            return 0
        return native.slab_rows_will_need(self._addrs, self.slab_rows, self.width * self.dtype.itemsize, slots_N)

    def will_need_slabs(self, lo: int, hi: int) -> None:
        """Start reading file-backed slabs [lo, hi) whole, without waiting: the kernel reads a
        range in large requests, where a pass over slabs advised random faults a page at a
        time. A full pass over a cold 3M-row SSD tier (iter_rows, a snapshot's reads)
        measured 1.0-1.25 GB/s of rows with it, 42-46 MB/s without."""
        if self.path_prefix is None:
            return
        for slab in self.slabs[lo:hi]:
            # in pieces: Linux reads at most the device's readahead window per call (read_ahead_kb)
            start, end = slab.data_ptr(), slab.data_ptr() + slab.numel() * slab.element_size()
            for a in range(start & ~(mmap.PAGESIZE - 1), end, _WILLNEED_CHUNK):
                _c_library().madvise(a, min(_WILLNEED_CHUNK, end - a), _MADV_WILLNEED)

    def destroy(self) -> None:
        """Drop every slab and delete its file (a store replaced by a snapshot load)."""
        if self.path_prefix is not None and not self.unlink:
            for i in range(len(self.slabs)):
                if os.path.exists(self._path(i)):
                    os.remove(self._path(i))
        self.slabs = []
        self._addrs = torch.zeros(0, dtype=torch.int64)

    @property
    def num_rows(self) -> int:
        return len(self.slabs) * self.slab_rows

    def _groups(self, slots_N: torch.Tensor):
        """Yield (positions in slots_N, rows within slab, slab) per slab touched."""
        slab_N = torch.div(slots_N, self.slab_rows, rounding_mode="floor")
        order_N = torch.argsort(slab_N, stable=True)
        ids, counts = torch.unique_consecutive(slab_N[order_N], return_counts=True)
        start = 0
        for s, c in zip(ids.tolist(), counts.tolist()):
            pos = order_N[start : start + c]
            start += c
            yield pos, slots_N[pos] - s * self.slab_rows, self.slabs[s]

    def _io_threads(self, n: int) -> int:
        """Threads for a native copy of n rows: several for a large batch of file-backed
        rows (cold ones are page faults, one in flight per thread), else one."""
        return SSD_IO_THREADS if self.path_prefix is not None and n >= SSD_IO_MIN_ROWS else 1

    def gather(self, slots_N: torch.Tensor) -> torch.Tensor:
        threads = self._io_threads(slots_N.numel()) if self.native_io else 1
        if len(self.slabs) == 1 and threads == 1:
            return self.slabs[0].index_select(0, slots_N.to(self.slabs[0].device))
        out = torch.empty(slots_N.numel(), self.width, dtype=self.dtype, device=self.device)
        if self.native_io:
            native.slab_rows_copy(self._addrs, self.slab_rows, slots_N.contiguous(), out, scatter=False,
                                  threads=threads)
            return out
        for pos, local, slab in self._groups(slots_N):
            out[pos] = slab.index_select(0, local)
        return out

    def scatter(self, slots_N: torch.Tensor, values_NW: torch.Tensor) -> None:
        threads = self._io_threads(slots_N.numel()) if self.native_io else 1
        if len(self.slabs) == 1 and threads == 1:
            s = self.slabs[0]
            # index_put_ measured ~20% faster than index_copy_ for row scatters on CPU.
            s.index_put_((slots_N.to(s.device),), values_NW.to(s.device, s.dtype))
            return
        if self.native_io:
            values_NW = values_NW.to(self.device, self.dtype).reshape(slots_N.numel(), self.width).contiguous()
            native.slab_rows_copy(self._addrs, self.slab_rows, slots_N.contiguous(), values_NW, scatter=True,
                                  threads=threads)
            return
        for pos, local, slab in self._groups(slots_N):
            slab.index_put_((local,), values_NW[pos].to(slab.device, slab.dtype))


class Tier:
    """One storage tier. `capacity=None` means growable (SSD), slab by slab."""

    def __init__(self, name: str, width: int, capacity: int | None, device: torch.device,
                 path_prefix: str | None = None, slab_rows: int = 1 << 18, unlink_files: bool = False,
                 native_io: bool = False) -> None:
        """unlink_files: slab files lose their names once mapped (see _SlabArray.add_slab).
        native_io: multi-slab gathers and scatters in one native call (native stores)."""
        self.name = name
        self.growable = capacity is None
        rows_per_slab = slab_rows if capacity is None else max(capacity, 1)
        cpu = torch.device("cpu")

        def array(kind, width, dtype, dev, fill):
            prefix = path_prefix and f"{path_prefix}.{kind}"
            return _SlabArray(width, dtype, rows_per_slab, prefix, dev, fill, unlink_files, native_io)

        self.rows = array("rows", width, torch.float32, device, 0.0)
        self.ids = array("ids", 1, torch.int64, cpu, -1)
        self.meta = array("meta", NUM_META, torch.int64, cpu, 0)
        self.capacity = capacity
        self._advice: Future | None = None  # the newest background read-ahead (will_need)
        self._ahead: list[torch.Tensor] = []  # the keys of the last two (note_read_ahead)
        self.layout = new_layout()  # changes whenever a slab is added or dropped (native.TierView)
        # Free slots: a stack popped from the end, in a buffer that grows by doubling, so
        # freeing k slots costs O(k), not a copy of every free slot.
        self._free = torch.empty(0, dtype=torch.int64)
        self._num_free = 0
        if capacity != 0:
            self._grow()
        self.num_used = 0

    def drop_page_cache(self) -> None:
        """See _SlabArray.drop_page_cache: rows, ids and metadata (after the advice in flight)."""
        self.wait_advice()
        for array in (self.rows, self.ids, self.meta):
            array.drop_page_cache()

    def will_need(self, slots_N: torch.Tensor, background: bool = False) -> int:
        """See _SlabArray.will_need: the rows, ids and metadata of these slots, here or, with
        `background`, on the adviser thread (the call returns at once). The slots advised:
        0 for a memory tier."""
        arrays = [a for a in (self.ids, self.rows, self.meta) if a.path_prefix is not None and a.slabs]
        if not arrays or not slots_N.numel():
            return 0
        def advise():
            for array in arrays:
                array.will_need(slots_N)

        if background:  # the job holds the arrays, so no slab is unmapped under it (destroy waits)
            self._advice = _adviser().submit(advise)
        else:
            advise()
        return int(slots_N.numel())

    def note_read_ahead(self, key: torch.Tensor) -> None:
        """Remember the ids a background read-ahead was asked for (batch t + 1, asked before
        step t): the last two are kept, for `was_read_ahead`."""
        self._ahead = [*self._ahead[-1:], key]

    def was_read_ahead(self, key: torch.Tensor) -> bool:
        """Whether a kept read-ahead was for exactly these ids (then it and any before it are
        forgotten). Its lookup need not advise their pages again: a syscall per page, about 4
        ms of a 17 ms offloaded step of 8,192 ids; rows moved to this tier since are cached."""
        i = next((i for i, a in enumerate(self._ahead) if a.numel() == key.numel() and torch.equal(a, key)), None)
        if i is not None:
            del self._ahead[: i + 1]
        return i is not None

    def wait_advice(self) -> None:
        """Wait for the background read-ahead asked so far (will_need) to be given."""
        if self._advice is not None:
            self._advice.result()
            self._advice = None

    def will_need_slabs(self, lo: int, hi: int, rows: bool = True) -> None:
        """See _SlabArray.will_need_slabs: ids and metadata, and rows unless `rows` is False."""
        for array in (self.ids, self.meta, self.rows) if rows else (self.ids, self.meta):
            array.will_need_slabs(lo, hi)

    def _grow(self) -> None:
        base = self.rows.num_rows
        added = []
        try:
            for array in (self.rows, self.ids, self.meta):
                array.add_slab()
                added.append(array)
        except BaseException:
            # All three or none: a slab left in one array alone (a full disk at the ids file)
            # would number that array's slots apart from the others'.
            for array in added:
                array.drop_last_slab()
            raise
        self.layout = new_layout()
        # Pop order: slots freed earlier first, then the new slab's, lowest slot first.
        new_F = torch.arange(self.rows.num_rows - 1, base - 1, -1, dtype=torch.int64)
        self._free = torch.cat([new_F, self.free_F])
        self._num_free = int(self._free.numel())

    @property
    def num_slots(self) -> int:
        return self.rows.num_rows

    @property
    def free_F(self) -> torch.Tensor:
        """The free slots, bottom of the stack first (a view: copy before freeing more)."""
        return self._free[: self._num_free]

    def num_free(self) -> int:
        return self._num_free if not self.growable else 1 << 62

    def reserve(self, n: int) -> None:
        """Grow a growable tier until it has n free slots (a full disk raises here)."""
        while self.growable and self._num_free < n:
            self._grow()

    def reserve_for(self, n: int, caches: list[Tier], top: int, mark_div: int, freed: int = 0) -> None:
        """Grow this (SSD) tier by all that placing n rows in cache `top` can push down to it,
        before any row leaves its slot (TableStore._promote), so that a full disk fails the
        call with every row still in place instead of rows already out of the caches and
        nowhere: the rows and each cache's watermark of extra victims (capacity // mark_div;
        the host's twice: it takes the device's victims and its overflow in two placements).
        Nothing when cache `top` has room for them all. `freed`: this tier's slots the call
        frees before placing (the promoted rows' own), which the pushed-down rows reuse."""
        if n > caches[top].num_free():
            self.reserve(n + caches[0].capacity // mark_div + 2 * (caches[1].capacity // mark_div) - freed)

    def alloc(self, n: int) -> torch.Tensor:
        self.reserve(n)
        assert self._num_free >= n, f"{self.name}: alloc past capacity"
        slots = self._free[self._num_free - n : self._num_free].flip(0)  # a copy
        self._num_free -= n
        self.num_used += n
        return slots

    def free(self, slots_N: torch.Tensor) -> None:
        if slots_N.numel() == 0:
            return
        self.ids.scatter(slots_N, torch.full((slots_N.numel(), 1), -1, dtype=torch.int64))
        n, top = int(slots_N.numel()), self._num_free
        if top + n > self._free.numel():
            grown = torch.empty(max(top + n, 2 * self._free.numel()), dtype=torch.int64)
            grown[:top] = self._free[:top]
            self._free = grown
        self._free[top : top + n] = slots_N
        self._num_free = top + n
        self.num_used -= n

    def write(self, slots_N, ids_N, rows_NW, meta_N3) -> None:
        self.rows.scatter(slots_N, rows_NW)
        self.ids.scatter(slots_N, ids_N.unsqueeze(1))
        self.meta.scatter(slots_N, meta_N3)

    def used_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, ids) of every occupied slot."""
        if self.num_slots == 0:
            e = torch.empty(0, dtype=torch.int64)
            return e, e
        ids_S = torch.cat([s.view(-1) for s in self.ids.slabs])
        used_S = (ids_S >= 0).nonzero().squeeze(1)
        return used_S, ids_S[used_S]

    def all_meta(self) -> torch.Tensor:
        return torch.cat(self.meta.slabs) if self.meta.slabs else torch.empty(0, NUM_META, dtype=torch.int64)

    def destroy(self) -> None:
        self.wait_advice()
        for array in (self.rows, self.ids, self.meta):
            array.destroy()
        self.layout = new_layout()
        self._free = torch.empty(0, dtype=torch.int64)
        self._num_free = 0
        self.num_used = 0
