"""One table's rows on one rank: id index, admission, three tiers, eviction, TTL, updates.

Tiers are exclusive: a row lives in one of device (tier 0), host (1) or SSD (2); the id index
maps id -> (slot << 2 | tier). A training lookup brings the batch's rows up to the device tier
(up to its capacity), pushing the policy's worst rows down one tier (a host eviction writes
the row back to SSD). Rows of the current lookup are never chosen as cache victims.

A training step is every forward since the last backward (a model looks up history, then
negatives, then runs one backward): rows looked up in any forward of the open step are
not dropped, by `max_rows` or TTL, before that step's backward has applied their
gradients. Every choice of rows that changes values (max_rows and TTL drops) orders by
(policy score, id), never by slot, so a store rebuilt from a snapshot chooses exactly as
the original would. Which rows leave a cache (device -> host -> SSD) changes only where
rows sit: the native kernels pick them by CLOCK, the reference by exact policy order.

Kernels. kernels="native" runs the index, the fused lookup (dedup + locate + touch + gather),
the fused optimizer step, CLOCK victims and the TTL sweep in C (csrc/store.c via native.py);
"reference" the same steps in PyTorch, bit for bit alike (tests/sparse/test_sparse_native.py).

Index memory at scale (native). An entry is 8 bytes (22 fingerprint bits + location) in 256
independently growing segments kept 68-85% full while a table grows (60% while it churns):
9.4-13.3 bytes per row, measured 10.3 on 500K rows (`genrec bench sparse`); a rebuild holds
one segment twice. 1B rows on a rank: about 11 GB of index in DRAM, beside 8 GB of id slabs
and 24 GB of metadata that live with the rows in their tier (SSD rows: in mapped files). A
lookup confirms a fingerprint match against the id slab (an SSD id: a page read, read
ahead); locations have 40 slot bits per tier (10^12 rows).

Legend: U = unique ids in a call, W = packed row width (values + optimizer state).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from . import native, optim
from .admission import PendingCounters
from .config import TableConfig
from .hashing import ReferenceIndex, lfu_score, lowest_k, rank_order
from .tiers import META_FREQ, META_LAST_ACCESS, META_LAST_UPDATE, NUM_META, Tier


class _FusedGrad:
    """What a fused training lookup's backward needs (TableStore.train_forward)."""

    def __init__(self, moves: int, inv_N, uniq_U, loc_U, admitted_U, now: int | None) -> None:
        self.moves, self.inv_N, self.uniq_U, self.loc_U = moves, inv_N, uniq_U, loc_U
        self.admitted_U, self.now = admitted_U, now


class TableStore:
    def __init__(self, cfg: TableConfig, ssd_dir: str, slab_rows: int, device: torch.device,
                 unlink_slabs: bool = False, generation: int = 0, kernels: str = "native") -> None:
        """ssd_dir: this table's own directory for SSD slabs. unlink_slabs: slab files lose
        their names once mapped (a temporary SSD tier: nothing to clean after kill -9).
        generation: names this store's slabs apart from those of the store it may replace
        (a snapshot load builds the new one beside the old). kernels: "native" (the
        index, lookup, optimizer step, victims and TTL sweep of csrc/store.c) or
        "reference" (the same in PyTorch: same rows bit for bit, slower)."""
        if kernels not in ("native", "reference"):
            raise ValueError(f"sparse config: kernels must be 'native' or 'reference', got {kernels!r}")
        self.cfg, self.dim, self.width, self.device = cfg, cfg.embedding_dim, optim.row_width(cfg), device
        self.ssd_dir, self.slab_rows, self.unlink_slabs, self.generation = ssd_dir, slab_rows, unlink_slabs, generation
        cpu = torch.device("cpu")
        self.tiers = [
            Tier("device", self.width, cfg.device_rows, device),
            Tier("host", self.width, cfg.host_rows, cpu),
            Tier("ssd", self.width, None, cpu, path_prefix=os.path.join(ssd_dir, f"tier.g{generation}"),
                 slab_rows=slab_rows, unlink_files=unlink_slabs, native_io=kernels == "native"),
        ]
        # When the device tier is process memory too (CPU), a host hit is as fast as a
        # device hit: leave it in place instead of moving it up and another row down
        # (measured: moves dominated step time on Zipf streams). On CUDA host hits move up.
        self.keep_host_hits = device.type == "cpu"
        # A full cache evicts capacity // mark_div rows beyond the need (a low watermark): 1/32 for the reference's
        # O(capacity) search, so it runs every few steps; 1/256 for CLOCK, whose rows go to SSD slots freed a step or
        # two ago, pages still cached (at 1/32 a host eviction read 35 MB of cold pages at `bench sparse` full size).
        self.kernels, self.native, self.mark_div = kernels, kernels == "native", 256 if kernels == "native" else 32
        # Native row kernels read and write tier memory directly: CPU tiers only (on CUDA the
        # device tier's rows go through PyTorch; the index stays native).
        self.native_rows = self.native and device.type == "cpu"
        self.index = native.NativeIndex() if self.native else ReferenceIndex()
        if not self.native:
            native.note_reference()
        self.view = native.TierView()
        # CLOCK state of the two memory tiers (native victims): a count per slot, a hand.
        self.clock_max = native.CLOCK_MAX[cfg.cache_policy]
        self.clock_ref = [torch.zeros(t.capacity or 1, dtype=torch.uint8) for t in self.tiers[:2]]
        self.clock_hand = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        self.pending = PendingCounters(cfg)
        self.step = 0  # counts training lookups (forwards), not steps: finer LRU order within a step
        self.window_start, self.step_done = 1, True  # the open step began at this lookup; done: backward ran
        self.version = 0  # bumped whenever any row changes tier or slot, and by every optimizer step
        self.moves = 0  # bumped whenever any row changes tier or slot (a native location's validity)
        self.last_locations = self.last_sweep = None
        # Since the last snapshot saved or loaded (deltas): its lookup count, and the ids removed
        # after it while track_removals (given up, None, past a table's worth).
        self.snapshot_step, self.track_removals, self._removed_count = 0, False, 0
        self.removed_since_snapshot: list[torch.Tensor] | None = []
        # Unique ids served per tier (the native lookup adds in place), and rows created.
        self.hits, self.misses = torch.zeros(3, dtype=torch.int64), 0

    # ---------------------------------------------------------------- locating rows
    def _tier_view(self) -> torch.Tensor:
        return self.view.of(self.tiers, self.dim)

    def _locate(self, ids_U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc_U = self.index.get(ids_U, self._tier_view())
        return loc_U & 3, loc_U >> 2  # (tier, slot); tier 3 / slot -1 where absent

    def _read(self, tier_U, slot_U, with_rows: bool = True):
        rows_UW = torch.empty(tier_U.numel(), self.width, device=self.device) if with_rows else None
        meta_U3 = torch.empty(tier_U.numel(), NUM_META, dtype=torch.int64)
        for t, tier in enumerate(self.tiers):
            pos = (tier_U == t).nonzero().squeeze(1)
            if pos.numel():
                if with_rows:
                    rows_UW[pos.to(self.device)] = tier.rows.gather(slot_U[pos]).to(self.device)
                meta_U3[pos] = tier.meta.gather(slot_U[pos])
        return rows_UW, meta_U3

    def _set_loc(self, ids_N: torch.Tensor, slots_N: torch.Tensor, t: int) -> None:
        """Index rows just written (ids in their slots) that have no entry."""
        self.version, self.moves = self.version + 1, self.moves + 1
        self.index.insert(ids_N, (slots_N << 2) | t, self._tier_view())

    def _detach(self, ids_N: torch.Tensor) -> None:
        """Take rows out of the index while their slots still hold them: a moving row
        leaves the index before its old slot is freed and returns once placed."""
        self.version, self.moves = self.version + 1, self.moves + 1
        self.index.remove(ids_N, self._tier_view())

    def _remove(self, ids_N, tier_N, slot_N) -> None:
        if self.removals_known:
            self.removed_since_snapshot.append(ids_N.detach().clone())
            self._removed_count += ids_N.numel()
            if self._removed_count > max(len(self.index), 1 << 20):
                self.removed_since_snapshot = None
        self._detach(ids_N)
        for t, tier in enumerate(self.tiers):
            tier.free(slot_N[tier_N == t])

    def _score(self, meta_N3: torch.Tensor) -> torch.Tensor:
        """Eviction priority: lower leaves first."""
        if self.cfg.cache_policy == "lfu":
            return lfu_score(meta_N3[:, META_FREQ], meta_N3[:, META_LAST_ACCESS])
        return meta_N3[:, META_LAST_ACCESS]

    def _open_from(self) -> int:
        """Rows looked up at or after this lookup count belong to the step whose backward
        has not run yet (none when the last step is done): they are never dropped."""
        return 1 << 62 if self.step_done else self.window_start

    def _in_open_step(self, meta_N3: torch.Tensor) -> torch.Tensor:
        return meta_N3[:, META_LAST_ACCESS] >= self._open_from()

    # ---------------------------------------------------------------- placement
    def _victims(self, t: int, k: int) -> torch.Tensor:
        """Slots of up to k rows of memory tier t to move down a tier. Native: CLOCK, which
        never scans the tier. Reference: the policy's k lowest (score, id). Which rows
        leave a cache changes only where rows sit, never their values."""
        tier = self.tiers[t]
        if tier.num_slots == 0 or k <= 0:
            return torch.empty(0, dtype=torch.int64)
        if self.native:
            return native.clock_victims(tier, self.clock_ref[t], self.clock_hand[t], k, self.step, self.clock_max)
        meta_S3 = tier.all_meta()
        ids_S = torch.cat([s.view(-1) for s in tier.ids.slabs])
        cand_M = ((ids_S >= 0) & (meta_S3[:, META_LAST_ACCESS] < self.step)).nonzero().squeeze(1)
        return cand_M[lowest_k(self._score(meta_S3[cand_M]), ids_S[cand_M], k)]

    def _place(self, ids_N, rows_NW, meta_N3, t: int) -> None:
        """Put rows (absent from every tier slot, maybe present in the index) into tier t,
        cascading victims and overflow downwards."""
        n = int(ids_N.numel())
        if n == 0:
            return
        tier = self.tiers[t]
        if not tier.growable:
            free = tier.num_free()
            if n > free:
                victims = self._victims(t, n - free + tier.capacity // self.mark_div)
                if victims.numel():
                    v_ids = tier.ids.gather(victims).squeeze(1)
                    v_rows, v_meta = tier.rows.gather(victims), tier.meta.gather(victims)
                    self._detach(v_ids)
                    tier.free(victims)
                    self._place(v_ids, v_rows, v_meta, t + 1)
                free = tier.num_free()
            if free < n:
                # Keep the best-scoring incoming rows here; the rest go one tier down.
                order = rank_order(self._score(meta_N3), ids_N).flip(0)
                rest = order[free:]
                self._place(ids_N[rest], rows_NW[rest.to(rows_NW.device)], meta_N3[rest], t + 1)
                keep = order[:free]
                ids_N, rows_NW, meta_N3 = ids_N[keep], rows_NW[keep.to(rows_NW.device)], meta_N3[keep]
                n = free
            if n == 0:
                return
        slots_N = tier.alloc(n)
        tier.write(slots_N, ids_N, rows_NW, meta_N3)
        # CLOCK (native victims): rows of this lookup arrive with their count (capped), demoted ones with 0.
        if self.native and t < 2:
            fresh_N = meta_N3[:, META_LAST_ACCESS] >= self.step
            self.clock_ref[t][slots_N] = (meta_N3[:, META_FREQ].clamp(max=self.clock_max) * fresh_N).to(torch.uint8)
        self._set_loc(ids_N, slots_N, t)

    def _top_tier(self) -> int:
        # A zero-capacity device tier is skipped: host rows are not copied out and back each step.
        return 0 if self.tiers[0].capacity else 1

    def _promote(self, ids_P, tier_P, slot_P, rows_PW, meta_P3) -> None:
        """Move rows found below the device tier up to it (freeing their old slots)."""
        target = self._top_tier()
        self.tiers[2].reserve_for(len(ids_P), self.tiers[:2], target, self.mark_div, int((tier_P == 2).sum()))
        self._detach(ids_P)
        for t in (1, 2):
            self.tiers[t].free(slot_P[tier_P == t])
        self._place(ids_P, rows_PW, meta_P3, target)

    # ---------------------------------------------------------------- TTL / max_rows
    def _expired(self, meta_N3: torch.Tensor, now: int | None) -> torch.Tensor:
        if self.cfg.ttl_seconds is None or now is None:
            return torch.zeros(meta_N3.shape[0], dtype=torch.bool)
        return meta_N3[:, META_LAST_UPDATE] < now - self.cfg.ttl_seconds

    def expire(self, now: int) -> int:
        """Drop every row (any tier) not updated within ttl_seconds before `now`, except
        rows of the open step, and forget admission counters not seen within it.
        Returns the number of rows dropped."""
        if self.cfg.ttl_seconds is None:
            return 0
        dropped = 0
        self.pending.expire(now)
        if self.native:
            for t, tier in enumerate(self.tiers):
                for slots_M in native.expired_slots(tier, now - self.cfg.ttl_seconds, self._open_from()):
                    self._remove(tier.ids.gather(slots_M).squeeze(1), torch.full_like(slots_M, t), slots_M)
                    dropped += int(slots_M.numel())
            self.last_sweep = now
            return dropped
        for t, tier in enumerate(self.tiers):
            slots_S, ids_S = tier.used_slots()
            if slots_S.numel() == 0:
                continue
            meta_S3 = tier.meta.gather(slots_S)
            old = self._expired(meta_S3, now) & ~self._in_open_step(meta_S3)
            self._remove(ids_S[old], torch.full_like(ids_S[old], t), slots_S[old])
            dropped += int(old.sum())
        self.last_sweep = now
        return dropped

    def _enforce_max_rows(self) -> None:
        cap = self.cfg.max_rows
        if cap is None or self.num_rows <= cap:
            return
        # Drop a little below the cap (1/64 of it): a full table does not rescan every tier each step.
        excess = self.num_rows - cap + cap // 64
        if self.native:  # one scan with a heap of `excess` rows, no table-sized temporaries
            loc_K, ids_K = native.lowest_rows(self._tier_view(), excess, self.cfg.cache_policy == "lfu",
                                              self._open_from())
            self._remove(ids_K, loc_K & 3, loc_K >> 2)
            return
        parts = [(t, *tier.used_slots()) for t, tier in enumerate(self.tiers)]
        tier_N, slot_N, ids_N = (torch.cat(x) for x in zip(*[(torch.full_like(s, t), s, i) for t, s, i in parts]))
        _, meta_N3 = self._read(tier_N, slot_N, with_rows=False)
        # Rows of the open step stay even past the cap: dropping one before its backward
        # would lose its gradient. The next step's lookups bring the table back under it.
        cand_M = (~self._in_open_step(meta_N3)).nonzero().squeeze(1)
        drop = cand_M[lowest_k(self._score(meta_N3[cand_M]), ids_N[cand_M], excess)]
        self._remove(ids_N[drop], tier_N[drop], slot_N[drop])

    # ---------------------------------------------------------------- public ops
    @property
    def num_rows(self) -> int:
        return sum(t.num_used for t in self.tiers)

    def default_values(self, ids_N: torch.Tensor) -> torch.Tensor:
        if self.cfg.default_row == "init":
            return optim.initial_values(self.cfg, ids_N).to(self.device)
        return torch.zeros(ids_N.numel(), self.dim, device=self.device)

    def _begin_lookup(self, now: int | None) -> None:
        """Open the step if a backward closed the last one; count the lookup; sweep TTL."""
        if self.step_done:  # the first forward since a backward opens a new step
            self.window_start, self.step_done = self.step + 1, False
        self.step += 1
        self.last_locations = None
        ttl = self.cfg.ttl_seconds
        if ttl is not None and now is not None and (self.last_sweep is None or now - self.last_sweep >= max(ttl // 4, 1)):
            self.expire(now)

    def read_ahead(self, ids_N: torch.Tensor, background: bool = True) -> int:
        """Start the disk reads of the SSD-tier pages (rows, ids, metadata) a lookup of these ids will
        touch, all at once, without waiting (Tier.will_need; on its thread if `background`): the
        SSD rows advised. A lookup advises its own ids too, unless they were read ahead (Tier.was_read_ahead)."""
        loc_N = self.index.candidates(ids_N) if self.native and self.tiers[2].num_used else None
        if background:
            self.tiers[2].note_read_ahead(ids_N)
        return 0 if loc_N is None else self.tiers[2].will_need(loc_N[(loc_N & 3) == 2] >> 2, background)  # absent: -1

    def _native_lookup(self, ids_N, counts_N, now, out: bool):
        """csrc/store.c's fused lookup: (U, committed, inv, uniq, cnt, loc); with `out`,
        also the rows [N, D] when it committed (see fwd_lookup)."""
        n = ids_N.numel()
        if n >= 1 << 31:  # the dedup table numbers unique ids in int32 (csrc/store.c)
            raise ValueError(f"genrec.sparse: one lookup takes fewer than 2^31 ids, got {n}; split the batch")
        if not self.tiers[2].was_read_ahead(ids_N):  # the lookup confirms SSD ids against their id pages
            self.read_ahead(ids_N, background=False)
        inv_N, uniq_N, cnt_N, loc_N = (torch.empty(n, dtype=torch.int64) for _ in range(4))
        out_ND = torch.empty(n, self.dim) if out else None
        top = self._top_tier()
        serve = (1 << top) | (2 if self.keep_host_hits else 0)
        ttl = self.cfg.ttl_seconds
        expire_before = now - ttl if ttl is not None and now is not None else native.NO_EXPIRY
        r = native.fwd_lookup(
            self._tier_view(), self.index.handle, ids_N.contiguous(), counts_N, serve, expire_before,
            self._open_from(), self.step, inv_N, uniq_N, cnt_N, loc_N, out_ND, *self.clock_ref, self.clock_max,
            self.hits)
        if r < -n - 1:
            raise MemoryError("genrec.sparse: the fused lookup could not allocate its scratch table")
        u = r if r >= 0 else -r - 1
        return u, r >= 0, inv_N, uniq_N[:u], cnt_N[:u], loc_N[:u], out_ND

    def lookup_train(self, ids_U: torch.Tensor, counts_U: torch.Tensor, now: int | None):
        """Rows of unique ids for a training forward. Returns (values [U, D], admitted [U])."""
        self._begin_lookup(now)
        if self.native_rows:
            u, done, _, _, _, loc_U, values_UD = self._native_lookup(ids_U, counts_U.contiguous(), now, out=True)
            if done:
                self.last_locations = (self.moves, loc_U)
                self._enforce_max_rows()  # on every path: where rows sit must not decide what stays
                return values_UD, torch.ones_like(ids_U, dtype=torch.bool)
            return self._lookup_moving(ids_U, counts_U, loc_U & 3, loc_U >> 2, now)
        tier_U, slot_U = self._locate(ids_U)
        top = self._top_tier()
        if self.cfg.ttl_seconds is None and ids_U.numel() and bool((tier_U == top).all()):
            return self._lookup_resident(ids_U, counts_U, slot_U, top)
        return self._lookup_moving(ids_U, counts_U, tier_U, slot_U, now)

    def train_forward(self, ids_N: torch.Tensor, now: int | None):
        """A training forward straight from raw ids (one rank, native CPU rows): returns
        (values [N, D], context for train_backward). Deduplicates, locates and gathers in
        one native call; a row to create, move or expire takes the general path."""
        self._begin_lookup(now)
        u, done, inv_N, uniq_U, cnt_U, loc_U, out_ND = self._native_lookup(ids_N, None, now, out=True)
        if done:
            ctx = _FusedGrad(self.moves, inv_N, uniq_U, loc_U, None, now)
            self._enforce_max_rows()  # on every path (a row dropped changes `moves`: the backward locates again)
            return out_ND, ctx
        values_UD, admitted_U = self._lookup_moving(uniq_U, cnt_U, loc_U & 3, loc_U >> 2, now)
        return values_UD.index_select(0, inv_N), _FusedGrad(-1, inv_N, uniq_U, None, admitted_U, now)

    def train_backward(self, ctx: _FusedGrad, grad_ND: torch.Tensor) -> None:
        """train_forward's backward: sum gradients per unique id (in the order of the
        ids, like index_add_), then one optimizer step per row, in place."""
        grad_ND = grad_ND.float().contiguous()
        if ctx.admitted_U is None and ctx.moves == self.moves and self.cfg.optimizer in native.OPTIMIZERS:
            # A committed lookup and no row moved since (another lookup's optimizer step may
            # have changed values: they are read in place): sum and step in one native call.
            self.close_step()
            native.bwd_apply(self._tier_view(), ctx.inv_N, grad_ND, ctx.loc_U, *self._native_step_args(ctx.now))
            return
        grad_UD = torch.empty(ctx.uniq_U.numel(), self.dim)  # every row is written (first-occurrence order)
        native.grad_accumulate(ctx.inv_N, grad_ND, grad_UD)
        if ctx.admitted_U is not None:
            keep = ctx.admitted_U.nonzero().squeeze(1)
            self.apply_grad(ctx.uniq_U[keep], grad_UD[keep], ctx.now)
            return
        self.apply_grad(ctx.uniq_U, grad_UD, ctx.now)

    def _lookup_moving(self, ids_U, counts_U, tier_U, slot_U, now: int | None):
        """The general training lookup: expire lazily, admit, create, refresh and move rows."""
        top = self._top_tier()
        exists_U = slot_U >= 0
        ex = exists_U.nonzero().squeeze(1)
        rows_EW, meta_E3 = self._read(tier_U[ex], slot_U[ex])
        old = self._expired(meta_E3, now) & ~self._in_open_step(meta_E3)
        if old.any():  # lazily expired since the last sweep: drop, then treat as new
            self._remove(ids_U[ex[old]], tier_U[ex[old]], slot_U[ex[old]])
            exists_U[ex[old]] = False
            ex, rows_EW, meta_E3 = ex[~old], rows_EW[~old.to(rows_EW.device)], meta_E3[~old]
        for t in range(3):
            self.hits[t] += int((tier_U[ex] == t).sum())
        admitted_U = exists_U.clone()
        new = (~exists_U).nonzero().squeeze(1)
        if new.numel():
            admitted_U[new] = self.pending.admit(ids_U[new], counts_U[new], now, self.step)
            new = new[admitted_U[new]]
            self.misses += int(new.numel())
        # Working set: existing rows then new rows, with their access metadata refreshed.
        ws = torch.cat([ex, new])
        new_meta = torch.zeros(new.numel(), NUM_META, dtype=torch.int64)
        new_meta[:, META_LAST_UPDATE] = now if now is not None else 0
        meta_A3 = torch.cat([meta_E3, new_meta])
        meta_A3[:, META_LAST_ACCESS] = self.step
        meta_A3[:, META_FREQ] += counts_U[ws]
        rows_AW = torch.cat([rows_EW, optim.initial_rows(self.cfg, ids_U[new]).to(self.device)])
        values_UD = torch.empty(ids_U.numel(), self.dim, device=self.device)
        values_UD[ws.to(self.device)] = rows_AW[:, : self.dim]
        rejected = (~admitted_U).nonzero().squeeze(1)
        if rejected.numel():
            values_UD[rejected.to(self.device)] = self.default_values(ids_U[rejected])
        # Rows staying where they are: refresh metadata in place. Others move up.
        tier_A = torch.cat([tier_U[ex], torch.full_like(new, 3)])
        stay = tier_A == top
        if self.keep_host_hits:
            stay |= tier_A == 1
        for t in (0, 1):
            here = (stay & (tier_A == t)).nonzero().squeeze(1)
            if here.numel():
                self.tiers[t].meta.scatter(slot_U[ws[here]], meta_A3[here])
                self._referenced(t, slot_U[ws[here]], counts_U[ws[here]])
        up = (~stay).nonzero().squeeze(1)
        self._promote(ids_U[ws[up]], tier_A[up], slot_U[ws[up]], rows_AW[up.to(self.device)], meta_A3[up])
        self._enforce_max_rows()
        return values_UD, admitted_U

    def _referenced(self, t: int, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """CLOCK's reference counts of rows read in place, as the native lookup bumps them."""
        if self.native:
            ref = self.clock_ref[t][slots].long() + counts
            self.clock_ref[t][slots] = ref.clamp(max=self.clock_max).to(torch.uint8)

    def _lookup_resident(self, ids_U, counts_U, slot_U, top: int):
        """Fast path: every id has a row in the top tier, no TTL: nothing moves but metadata."""
        tier = self.tiers[top]
        meta_C3 = tier.meta.slabs[0]
        meta_C3[:, META_LAST_ACCESS].index_fill_(0, slot_U, self.step)
        meta_C3[:, META_FREQ].index_add_(0, slot_U, counts_U)
        self._referenced(top, slot_U, counts_U)
        self.hits[top] += int(ids_U.numel())
        rows_UW = tier.rows.slabs[0].index_select(0, slot_U.to(tier.rows.slabs[0].device))
        # If no row moves or changes before this call's backward (same version), the
        # backward updates this copy and writes it back without locating or reading again.
        self.last_locations = (self.version, top, slot_U, rows_UW)
        self._enforce_max_rows()  # a row dropped changes the version: the backward then locates again
        return rows_UW[:, : self.dim].to(self.device), torch.ones_like(ids_U, dtype=torch.bool)

    def lookup_eval(self, ids_U: torch.Tensor, now: int | None) -> torch.Tensor:
        """Read-only lookup: unknown or expired ids read the default row."""
        tier_U, slot_U = self._locate(ids_U)
        ex = (slot_U >= 0).nonzero().squeeze(1)
        rows_EW, meta_E3 = self._read(tier_U[ex], slot_U[ex])
        live = ~self._expired(meta_E3, now)
        values_UD = self.default_values(ids_U)
        values_UD[ex[live].to(self.device)] = rows_EW[live.to(self.device), : self.dim]
        return values_UD

    def prefetch(self, ids_U: torch.Tensor) -> None:
        """Bring existing rows of upcoming ids to the device tier (values untouched)."""
        tier_U, slot_U = self._locate(ids_U)
        lowest_kept = 1 if self.keep_host_hits else self._top_tier()
        up = ((slot_U >= 0) & (tier_U > lowest_kept)).nonzero().squeeze(1)
        if up.numel():
            rows_PW, meta_P3 = self._read(tier_U[up], slot_U[up])
            self._promote(ids_U[up], tier_U[up], slot_U[up], rows_PW, meta_P3)

    def close_step(self) -> None:
        """A backward ran (or a step has no gradient to apply): the next lookup opens a new
        step, and locations taken before this no longer count as fresh."""
        self.step_done = True
        self.version += 1

    def _native_step_args(self, now: int | None) -> tuple:
        """(optimizer, lr, eps, weight decay, set_update, now) of the native optimizer step;
        rows get an update time only under a TTL."""
        cfg, stamp = self.cfg, self.cfg.ttl_seconds is not None and now is not None
        return (native.OPTIMIZERS[cfg.optimizer], cfg.learning_rate, cfg.eps, cfg.weight_decay, int(stamp),
                now if stamp else 0)

    def apply_grad(self, ids_A: torch.Tensor, grad_AD: torch.Tensor, now: int | None, locations=None) -> None:
        """One optimizer step on each row from its summed gradient, wherever it lives now.

        `locations` from the forward's fast path: (moves, loc_A) of a committed native lookup,
        valid while no row has moved since (values are read in place, so another lookup's
        optimizer step does not stale them), or (version, tier, slot_A, rows_AW) of the
        reference one, valid only if no row has moved or changed since (its rows are copies);
        otherwise the ids are located again."""
        self.close_step()
        fresh = locations is not None and locations[0] == (self.moves if len(locations) == 2 else self.version - 1)
        if self.native_rows and self.cfg.optimizer in native.OPTIMIZERS:
            grad_AD = grad_AD.float().contiguous()
            if fresh and len(locations) == 2:  # a committed native lookup: every id has its row
                loc_A = locations[1]
            else:
                loc_A = self.index.get(ids_A, self._tier_view())
                have = loc_A >= 0  # every id has a row in practice: open-step rows are never dropped
                if not bool(have.all()):
                    loc_A, grad_AD = loc_A[have], grad_AD[have]
            native.apply_rows(self._tier_view(), loc_A.contiguous(), grad_AD, *self._native_step_args(now))
            return
        if fresh and len(locations) == 4 and self.cfg.ttl_seconds is None:
            _, t, slot_A, rows_AW = locations
            optim.apply_update(self.cfg, rows_AW, grad_AD.to(rows_AW.device))
            self.tiers[t].rows.scatter(slot_A, rows_AW)
            return
        tier_A, slot_A = self._locate(ids_A)
        for t, tier in enumerate(self.tiers):
            pos = (tier_A == t).nonzero().squeeze(1)
            if pos.numel() == 0:
                continue
            slots = slot_A[pos]
            rows_PW = tier.rows.gather(slots).to(self.device)
            optim.apply_update(self.cfg, rows_PW, grad_AD[pos.to(grad_AD.device)].to(rows_PW.dtype))
            tier.rows.scatter(slots, rows_PW)
            if self.cfg.ttl_seconds is not None and now is not None:
                meta_P3 = tier.meta.gather(slots)
                meta_P3[:, META_LAST_UPDATE] = now
                tier.meta.scatter(slots, meta_P3)

    # ---------------------------------------------------------------- bulk (snapshots)
    def iter_rows(self, changed_only: bool = False):
        """Yield (ids [n], rows [n, W] on CPU, meta [n, 3]) of every materialized row, one
        slab at a time, so a snapshot of a table larger than memory streams through.
        `changed_only`: only rows looked up since the last snapshot, what a delta snapshot
        writes (a row changes only in an optimizer step after a lookup; moving between
        tiers changes none); their rows alone are read."""
        for tier in self.tiers:
            for s, (ids_slab, rows_slab, meta_slab) in enumerate(zip(tier.ids.slabs, tier.rows.slabs, tier.meta.slabs)):
                tier.will_need_slabs(s if s == 0 else s + 1, s + 2, rows=not changed_only)  # each slab once, one ahead
                keep = ids_slab.view(-1) >= 0
                if changed_only:
                    keep &= meta_slab[:, META_LAST_ACCESS] > self.snapshot_step
                used = keep.nonzero().squeeze(1)
                if used.numel():
                    yield ids_slab.view(-1)[used], rows_slab[used.to(rows_slab.device)].cpu(), meta_slab[used]

    @property
    def removals_known(self) -> bool:  # every id removed since the last snapshot is logged
        return self.track_removals and self.removed_since_snapshot is not None

    def removed_ids(self) -> torch.Tensor:
        """Ids removed since the last snapshot (each once; some may be back by now)."""
        assert self.removals_known, "a delta snapshot needs every removal since the last one"
        if not self.removed_since_snapshot:
            return torch.empty(0, dtype=torch.int64)
        return torch.unique(torch.cat(self.removed_since_snapshot))

    def mark_snapshot(self) -> None:
        """A snapshot of this store's present state was saved or loaded. Saved in an open
        step, that step's rows (updated after it) go into the next delta too."""
        step = self.step if self.step_done else self.window_start - 1
        self.snapshot_step, self.removed_since_snapshot, self._removed_count = step, [], 0

    def all_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [N], rows [N, W], meta [N, 3]) of every materialized row (in memory)."""
        parts = list(self.iter_rows())
        if not parts:
            return (torch.empty(0, dtype=torch.int64), torch.empty(0, self.width),
                    torch.empty(0, NUM_META, dtype=torch.int64))
        return tuple(torch.cat(x) for x in zip(*parts))

    # ---------------------------------------------------------------- snapshot loads
    def staging(self) -> TableStore:
        """An empty store for a snapshot load to fill, beside this one: no caches (they
        would double this table's device and host memory), its own SSD slabs. `adopt`
        takes it over once every file was read; until then this store is untouched."""
        cfg = dataclasses.replace(self.cfg, device_rows=0, host_rows=0)
        return TableStore(cfg, self.ssd_dir, self.slab_rows, self.device, self.unlink_slabs, self.generation + 1,
                          self.kernels)

    def stage(self, ids_N: torch.Tensor, rows_NW: torch.Tensor, meta_N3: torch.Tensor) -> None:
        """Add rows read from a snapshot (staging stores only: straight to SSD); their ids
        must not be staged yet (`unstage` them first)."""
        self._place(ids_N, rows_NW, meta_N3, 2)

    def unstage(self, ids_N: torch.Tensor) -> None:
        """Drop staged rows of these ids where present (a delta's removals, older rows)."""
        if len(self.index) and ids_N.numel():
            tier_N, slot_N = self._locate(ids_N)
            here = (slot_N >= 0).nonzero().squeeze(1)
            self._remove(ids_N[here], tier_N[here], slot_N[here])  # a staging store logs no removals

    def adopt(self, staged: TableStore) -> None:
        """Replace this store's rows, counters and step by a staged store's; the policy's
        best rows are brought up to this store's caches."""
        for tier in self.tiers[:2]:
            tier.free(tier.used_slots()[0])
        self.tiers[2].destroy()
        self.tiers[2], self.generation = staged.tiers[2], staged.generation
        self.index, self.pending = staged.index, staged.pending
        self.pending.cfg = self.cfg
        self.step, self.last_sweep, self.window_start, self.step_done = staged.step, staged.last_sweep, staged.step + 1, True
        self.mark_snapshot()
        self.version, self.moves, self.last_locations = self.version + 1, self.moves + 1, None
        room = sum(t.capacity for t in self.tiers[:2])
        slots_S, ids_S = self.tiers[2].used_slots()
        if room and slots_S.numel():
            meta_S3 = self.tiers[2].meta.gather(slots_S)
            best = lowest_k(-self._score(meta_S3), -ids_S, room)  # the highest (score, id) first
            self._promote(ids_S[best], torch.full_like(best, 2), slots_S[best],
                          self.tiers[2].rows.gather(slots_S[best]).to(self.device), meta_S3[best])

    def destroy(self) -> None:
        """Delete this store's SSD slabs (a staging store whose load failed)."""
        for tier in self.tiers:
            tier.destroy()
