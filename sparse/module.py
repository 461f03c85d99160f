"""`TieredEmbeddingCollection`: TorchRec's EmbeddingCollection contract over the tiered store.

Worked example (tables item(dim 4, features item_id and neg_item_id), action(dim 2)):

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["item_id", "action"],
        values=torch.tensor([11, 12, 13, 21,   1, 0, 1, 1]),
        lengths=torch.tensor([3, 1,            3, 1]),     # key-major: item_id per user, then action
    )
    out = tec(kjt)                      # dict[str, JaggedTensor]
    out["item_id"].values()             # float [4, 4]: rows of ids 11, 12, 13, 21
    out["item_id"].lengths()            # [3, 1]
    out["action"].values()              # float [4, 2]
    loss.backward()                     # row-wise Adagrad already applied to rows 11, 12, 13, 21, 0, 1

Training forward (module.training and grad enabled): per table, ids of all its features
are deduplicated (torch.unique) and, with several ranks, sent to their owner rank
(splitmix64(id) % world_size) together with every other table's in one all-to-all
(_GroupExchange), admitted / materialized / brought up from SSD there (on CUDA host hits
move to the device tier too; on CPU both are process memory and they stay), and the
rows come back. The returned values are the output of one autograd Function whose
backward sums row gradients per unique id, sends them to the owners and applies the
sparse optimizer to the rows wherever they live at that moment: a caller needs only
loss.backward(). With several ranks the trainer sets `defer_row_updates`: backward then
only starts the gradients' all-to-all, and `finish_row_updates()` after the dense
optimizer step applies them (the next lookup would, too). Every rank must call forward
with the same keys and run backward on the outputs of every training forward (the
backward holds collectives). On one rank with
native kernels and CPU rows, deduplication, lookup and gather are one native call
(TableStore.train_forward) and the backward one more; rows to create or move take the
general path inside it.

Eval mode or torch.no_grad(): read-only; unknown / unadmitted / expired ids read the
table's default row and no counter, row or tier changes.
"""

from __future__ import annotations

import os
import re
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from . import ssd_dir
from .config import SparseConfig, TableConfig
from .hashing import owner_rank
from .store import TableStore
from .tiers import remove_slab_files


class _Capacity:
    """Rows per destination rank in the padded first all-to-all of a _GroupExchange. Every
    rank holds the same value: each one updates it from the same figure, the largest count
    any rank sent to any rank, which every rank reads from the headers it received."""

    def __init__(self) -> None:
        self.rows = 0  # 0: the first exchange learns the sizes, then sends them ahead of need

    def update(self, need: int) -> None:
        if need > self.rows or 4 * need < self.rows:  # grow past a larger need, shrink after a much smaller one
            self.rows = need + (need + 3) // 4


class _Exchange:
    """Route unique ids of one table to their owner ranks and rows / gradients back.

    Given a payload (with the _Capacity its exchanges share), the split counts travel in the same all-to-all as the
    payload: each rank sends every rank a block of `capacity.rows` payload rows behind a
    header (its count for that rank, and the largest count it has for any rank). When every
    header's largest count fits, that one round trip delivered everything; otherwise the
    payload goes again with the counts now known, as without a capacity. Every rank reads
    the same largest counts, so all agree on which happened and on the next capacity. This
    saves one of the forward's three round trips between the ranks, which cost far more
    than their bytes on busy cores (genrec bench train's alltoall_own)."""

    def __init__(self, uniq_L: torch.Tensor, group, payload_LK: torch.Tensor | None = None,
                 capacity: _Capacity | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.payload_R = payload_LK
        if self.world == 1:
            self.order_L = None
            return
        owner_L = owner_rank(uniq_L, self.world)
        self.order_L = torch.argsort(owner_L, stable=True)
        self.send_splits = torch.bincount(owner_L, minlength=self.world)
        self.send_list = self.send_splits.tolist()
        if payload_LK is not None:
            self.payload_R = self._counts_with_payload(payload_LK, capacity)
            return
        recv = torch.empty_like(self.send_splits)
        dist.all_to_all_single(recv, self.send_splits, group=group)
        self.recv_list = recv.tolist()

    def _counts_with_payload(self, payload_LK: torch.Tensor, capacity: _Capacity) -> torch.Tensor:
        world, rows, width = self.world, capacity.rows, payload_LK.shape[1]
        assert width >= 2, "the header needs two columns"
        need = max(self.send_list)
        x_S = payload_LK.index_select(0, self.order_L)
        send = x_S.new_zeros(world, 1 + rows, width)
        send[:, 0, 0], send[:, 0, 1] = self.send_splits, need
        if 0 < need <= rows:  # row i of destination j's run goes to block j, slot 1 + i
            starts = torch.cumsum(self.send_splits, 0) - self.send_splits
            owner_S = torch.repeat_interleave(torch.arange(world), self.send_splits, output_size=x_S.shape[0])
            slot_S = owner_S * (1 + rows) + 1 + torch.arange(x_S.shape[0]) - starts[owner_S]
            send.view(-1, width).index_copy_(0, slot_S, x_S)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        self.recv_list = recv[:, 0, 0].tolist()
        most = int(recv[:, 0, 1].max())
        capacity.update(most)
        if most <= rows:
            return torch.cat([recv[j, 1 : 1 + n] for j, n in enumerate(self.recv_list)])
        out = x_S.new_empty((sum(self.recv_list), width))
        dist.all_to_all_single(out, x_S, self.recv_list, self.send_list, group=self.group)
        return out

    def to_owner(self, x_L: torch.Tensor, async_op: bool = False):
        """x_L's rows on their owners; with async_op, (rows, work): the rows once work.wait()."""
        if self.world == 1:
            return (x_L, None) if async_op else x_L
        x_S = x_L.index_select(0, self.order_L.to(x_L.device))  # ~6x faster than x_L[order] on CPU
        out = x_S.new_empty((sum(self.recv_list), *x_S.shape[1:]))
        work = dist.all_to_all_single(out, x_S, self.recv_list, self.send_list, group=self.group, async_op=async_op)
        return (out, work) if async_op else out

    def from_owner(self, x_R: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x_R
        out_S = x_R.new_empty((sum(self.send_list), *x_R.shape[1:]))
        dist.all_to_all_single(out_S, x_R.contiguous(), self.send_list, self.recv_list, group=self.group)
        unorder_L = torch.empty_like(self.order_L)  # order_L's inverse: a gather, not a scatter, puts rows back
        unorder_L[self.order_L] = torch.arange(self.order_L.numel())
        return out_S.index_select(0, unorder_L.to(out_S.device))


def _apply_rows_grad(store, ids_U, grad_UD, admitted_U, locations, now) -> None:
    """The optimizer step of a training lookup's unique ids on their owner."""
    if locations is not None:  # fast path: all admitted, locations still valid
        store.apply_grad(ids_U, grad_UD, now, locations)
        return
    keep = admitted_U.nonzero().squeeze(1)
    store.apply_grad(ids_U[keep], grad_UD[keep.to(grad_UD.device)], now)


class _GroupExchange:
    """All tables of one lookup routed to their owners together: two all-to-alls in the
    forward (ids, counts and table numbers with their split counts, in a block of the
    shared _Capacity; rows), a third when a rank's ids outgrow that block, and one in the
    backward (gradients), whatever the number of tables. One exchange per table made a
    2-rank step of the demo model (7 tables) about 28 gloo collectives, each a round trip
    between the ranks. Rows of tables of different widths travel zero-padded to the widest.

    On the owner, the received (table, id) pairs are grouped by one sort for all tables,
    not a selection and a torch.unique per table: table t's unique ids are `owner_ids[t]`
    (ascending, as torch.unique gives them) with their summed counts `owner_counts[t]`,
    and `inv_R` maps each received pair to its place in the tables' concatenated unique
    ids (`_U`), which rows and gradients use in one gather / one index_add each."""

    def __init__(self, uniq_per_table: list[torch.Tensor], cnt_per_table: list[torch.Tensor], dims: list[int],
                 group, capacity: _Capacity) -> None:
        self.sizes, self.dims, self.width = [u.numel() for u in uniq_per_table], dims, max(dims)
        ids_L = torch.cat(uniq_per_table)
        table_L = torch.repeat_interleave(torch.arange(len(dims)), torch.tensor(self.sizes), output_size=ids_L.numel())
        self.ex = _Exchange(ids_L, group, torch.stack([ids_L, torch.cat(cnt_per_table), table_L], dim=1), capacity)
        ids_R, cnt_R, table_R = self.ex.payload_R.unbind(1)
        # Table-major, id-minor order of the received pairs (two stable sorts).
        by_id = torch.argsort(ids_R, stable=True)
        order = by_id[torch.argsort(table_R[by_id], stable=True)]
        table_S, ids_S = table_R[order], ids_R[order]
        first_S = torch.ones_like(ids_S, dtype=torch.bool)
        first_S[1:] = (table_S[1:] != table_S[:-1]) | (ids_S[1:] != ids_S[:-1])
        place_S = torch.cumsum(first_S, 0) - 1
        self.inv_R = torch.empty_like(place_S)
        self.inv_R[order] = place_S
        num_U = int(first_S.sum())
        cnt_U = torch.zeros(num_U, dtype=cnt_R.dtype).index_add_(0, place_S, cnt_R[order])
        self.owner_sizes = torch.bincount(table_S[first_S], minlength=len(dims)).tolist()
        self.owner_ids = list(ids_S[first_S].split(self.owner_sizes))
        self.owner_counts = list(cnt_U.split(self.owner_sizes))
        self.rows_U: torch.Tensor | None = None

    def put_rows(self, t: int, rows_UD: torch.Tensor) -> None:
        """Table t's rows for its owner-side unique ids (in `owner_ids[t]`'s order)."""
        if self.rows_U is None:
            self.rows_U = rows_UD.new_zeros(sum(self.owner_sizes), self.width)
        start = sum(self.owner_sizes[:t])
        self.rows_U[start : start + self.owner_sizes[t], : self.dims[t]] = rows_UD

    def rows_back(self) -> list[torch.Tensor]:
        """Each table's rows for this rank's unique ids [L_t, D_t], from their owners."""
        rows_L = self.ex.from_owner(self.rows_U.index_select(0, self.inv_R.to(self.rows_U.device)))
        return [part[:, :d] for part, d in zip(rows_L.split(self.sizes), self.dims)]

    def grads_to_owner(self, grads_per_table: list[torch.Tensor]):
        """Per-table gradients of this rank's unique ids -> a function that returns each
        table's gradients summed per owner-side unique id (`owner_ids[t]`'s order) once
        they have arrived: the all-to-all is under way when this returns."""
        padded = torch.cat([g if g.shape[1] == self.width else F.pad(g, (0, self.width - g.shape[1]))
                            for g in grads_per_table])
        grad_R, work = self.ex.to_owner(padded, async_op=True)

        def arrived() -> list[torch.Tensor]:
            if work is not None:
                work.wait()
            # Each unique id's gradients are added in the order they were received, as a
            # per-table index_add over the received rows adds them.
            grad_U = grad_R.new_zeros(sum(self.owner_sizes), self.width).index_add_(
                0, self.inv_R.to(grad_R.device), grad_R)
            return [part[:, :d].contiguous() for part, d in zip(grad_U.split(self.owner_sizes), self.dims)]

        return arrived


class _GroupCall:
    """The backward of one grouped lookup: each table's member hands in its gradient, and
    the last one sends them all to their owners in one exchange and applies them, or,
    where the collection defers row updates, leaves the applying to its next
    finish_row_updates() while the gradients travel."""

    def __init__(self, ex: _GroupExchange, stores, inverse_per_table, admitted, locations, now,
                 apply_order: list[int], deferred: list | None) -> None:
        self.ex, self.stores, self.inverse, self.admitted, self.locations, self.now = (
            ex, stores, inverse_per_table, admitted, locations, now)
        self.apply_order, self.deferred = apply_order, deferred
        self.grads: dict[int, torch.Tensor] = {}

    def apply_grad(self, t: int, grad_ND: torch.Tensor) -> None:
        grad_ND = grad_ND.float()  # rows and optimizer state are fp32 whatever autocast did
        self.grads[t] = grad_ND.new_zeros(self.ex.sizes[t], grad_ND.shape[1]).index_add_(0, self.inverse[t], grad_ND)
        if len(self.grads) < len(self.stores):
            return
        arrived = self.ex.grads_to_owner([self.grads[i] for i in range(len(self.stores))])

        def apply() -> None:
            grads_U = arrived()
            for e in self.apply_order:
                _apply_rows_grad(self.stores[e], self.ex.owner_ids[e], grads_U[e], self.admitted[e],
                                 self.locations[e], self.now)

        if self.deferred is None:
            apply()
        else:
            self.deferred.append(apply)


class _GroupMember:
    """Table t of a grouped lookup, as _FusedLookup sees one table's call."""

    def __init__(self, group: _GroupCall, t: int) -> None:
        self.group, self.t = group, t

    def output(self, values_LD: torch.Tensor) -> torch.Tensor:
        return values_LD.index_select(0, self.group.inverse[self.t])

    def apply_grad(self, grad_ND: torch.Tensor) -> None:
        self.group.apply_grad(self.t, grad_ND)


class _EvalCall:
    """A read-only lookup's table: its rows per occurrence."""

    def __init__(self, inverse_N: torch.Tensor) -> None:
        self.inverse_N = inverse_N

    def output(self, values_LD: torch.Tensor) -> torch.Tensor:
        return values_LD.index_select(0, self.inverse_N)


class _TableCall(_EvalCall):
    """One table's training lookup on one rank through torch.unique and the store (the
    path without the fused native lookup): what its backward needs."""

    def __init__(self, store, inverse_N, ids_U, admitted_U, now, locations) -> None:
        super().__init__(inverse_N)
        self.store, self.ids_U, self.admitted_U = store, ids_U, admitted_U
        self.now, self.locations = now, locations

    def apply_grad(self, grad_ND: torch.Tensor) -> None:
        grad_ND = grad_ND.float()  # rows and optimizer state are fp32 whatever autocast did
        grad_UD = grad_ND.new_zeros(self.ids_U.numel(), grad_ND.shape[1]).index_add_(0, self.inverse_N, grad_ND)
        _apply_rows_grad(self.store, self.ids_U, grad_UD, self.admitted_U, self.locations, self.now)


class _LocalCall:
    """One table's training forward on one rank through the store's fused native lookup
    (TableStore.train_forward): its values are already one row per id."""

    def __init__(self, store, ctx) -> None:
        self.store, self.ctx = store, ctx

    def output(self, values_ND: torch.Tensor) -> torch.Tensor:
        return values_ND

    def apply_grad(self, grad_ND: torch.Tensor) -> None:
        self.store.train_backward(self.ctx, grad_ND)


class _FusedLookup(torch.autograd.Function):
    """Outputs per-table rows; backward applies the sparse optimizer (fused, no .grad)."""

    @staticmethod
    def forward(ctx, anchor, calls, *values_per_table):
        ctx.calls = calls
        return tuple(c.output(v) for v, c in zip(values_per_table, calls))

    @staticmethod
    def backward(ctx, *grads):
        for call, g in zip(ctx.calls, grads):
            call.apply_grad(g.contiguous())
        return (None, None, *([None] * len(grads)))


class TieredEmbeddingCollection(nn.Module):
    """KJT of raw int64 ids -> dict of per-feature JaggedTensors of rows (see module doc)."""

    def __init__(self, config: SparseConfig, process_group=None) -> None:
        super().__init__()
        self.config = config
        self.last_snapshot: tuple[str, str] | None = None
        """(folder, version) of the last snapshot saved or loaded: what a delta builds on."""
        self.group = process_group if process_group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.device = torch.device(config.device or "cpu")
        if config.snapshot_max_deltas < 0:
            raise ValueError(f"sparse.snapshot_max_deltas must be >= 0 (0: full snapshots only), "
                             f"got {config.snapshot_max_deltas}")
        self.feature_to_table: dict[str, str] = {}
        self.tables: dict[str, TableConfig] = {}
        for t in config.tables:
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", t.name):
                raise ValueError(f"SparseConfig.tables: table name {t.name!r} must be letters, digits, '_', '.' or '-' "
                                 "(not first): it names the table's files and folders")
            if t.name in self.tables:
                raise ValueError(f"SparseConfig.tables: table name {t.name!r} appears twice")
            self.tables[t.name] = t
            for f in t.feature_names:
                if f in self.feature_to_table:
                    raise ValueError(f"feature {f!r} is listed by tables {self.feature_to_table[f]!r} and {t.name!r}")
                self.feature_to_table[f] = t.name
        temporary = config.ssd_dir is None
        if temporary:
            root, lock_fd = ssd_dir.make_temp_dir(self.rank)
        else:
            root = config.ssd_dir
            ssd_dir.check_writable(root)
            lock_fd = ssd_dir.lock(root, self.rank)
        # Runs at garbage collection or interpreter exit, whichever comes first.
        weakref.finalize(self, ssd_dir.release, lock_fd, root if temporary else None)
        self.ssd_root = root
        self.stores: dict[str, TableStore] = {}
        for name, t in self.tables.items():
            tdir = os.path.join(root, f"{name}.rank{self.rank}")
            os.makedirs(tdir, exist_ok=True)
            remove_slab_files(tdir)  # an earlier run's spill: never read again (see tiers.py)
            self.stores[name] = TableStore(t, tdir, config.ssd_slab_rows, self.device, unlink_slabs=temporary,
                                           kernels=config.kernels)
            self.stores[name].track_removals = config.snapshot_max_deltas > 0
        self.event_time: int | None = None
        # The grouped exchange's first all-to-all (see _Exchange), per lookup's feature keys.
        self._capacity: dict[tuple[str, ...], _Capacity] = {}
        self.defer_row_updates = False
        """With several ranks, backward only starts sending the row gradients to their owners;
        finish_row_updates() (the trainer's, after its dense optimizer step: the gradients
        travel meanwhile) applies them. Every method that reads or looks up rows finishes
        them first, so results are the same; only a caller reading `stores` directly must
        call it itself."""
        self._deferred: list = []
        # Leaf that makes the fused outputs require grad; it never receives a gradient.
        self._anchor = torch.zeros((), requires_grad=True)

    def finish_row_updates(self) -> None:
        """Apply the row gradients of backwards run with `defer_row_updates`: wait for
        their all-to-alls, already under way, and run the sparse optimizer on the rows."""
        while self._deferred:
            self._deferred.pop(0)()

    def set_event_time(self, ts: int) -> None:
        """Event time (unix seconds) of the coming batches: drives TTL and last-update times."""
        self.event_time = int(ts)

    # ------------------------------------------------------------------ input handling
    @staticmethod
    def _split_keys(kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """kjt.to_dict() for a KJT of one stride, as views of its values and lengths (the
        general to_dict splits and copies; it costs more than a resident lookup)."""
        if kjt.variable_stride_per_key():
            return kjt.to_dict()
        values, lengths, stride = kjt.values(), kjt.lengths(), kjt.stride()
        out, start = {}, 0
        for k, (key, n) in enumerate(zip(kjt.keys(), kjt.length_per_key())):
            out[key] = JaggedTensor(values=values[start : start + n], lengths=lengths[k * stride : (k + 1) * stride])
            start += n
        return out

    def _ids_per_table(self, kjt: KeyedJaggedTensor):
        jts = self._split_keys(kjt)
        per_table: dict[str, list[tuple[str, JaggedTensor]]] = {}
        for key, jt in jts.items():
            if key not in self.feature_to_table:
                raise ValueError(f"feature {key!r} has no table (known features: {sorted(self.feature_to_table)})")
            name = self.feature_to_table[key]
            ids = jt.values()
            if ids.numel():
                if ids.dtype not in (torch.int64, torch.int32):
                    raise ValueError(f"feature {key!r} (table {name!r}): ids must be int64, got {ids.dtype}")
                lo, hi = (int(x) for x in torch.aminmax(ids))
                if lo < 0:
                    raise ValueError(f"feature {key!r} (table {name!r}): negative id {lo}")
                bound = self.tables[name].num_embeddings
                if bound is not None and hi >= bound:
                    raise ValueError(f"feature {key!r} (table {name!r}): id {hi} out of range [0, {bound})")
            per_table.setdefault(name, []).append((key, jt))
        # Collectives run per table in one global order on every rank.
        return [(n, per_table[n]) for n in sorted(per_table)]

    # ------------------------------------------------------------------ forward
    def forward(self, kjt: KeyedJaggedTensor, event_time: int | None = None) -> dict[str, JaggedTensor]:
        if event_time is not None:
            self.set_event_time(event_time)
        return self._lookup([kjt])[0]

    def lookup_many(self, kjts: list[KeyedJaggedTensor], replicated: list[bool] | None = None
                    ) -> list[dict[str, JaggedTensor]]:
        """`forward` of several KJTs (e.g. a batch's histories and its candidates): with
        several ranks every table of every KJT shares one exchange, so a training step makes
        one set of collectives instead of one per KJT (every rank must pass KJTs with the
        same keys, in the same order); on one rank, exactly `forward` of each in turn.

        `replicated[i]`: KJT i is the same on every rank (negatives every rank draws alike,
        the corpus of a full softmax): its ids are sighted once, by rank 0, so admission and
        LFU counts grow as on one rank rather than once per rank."""
        if self.world_size == 1:
            return [self._lookup([kjt])[0] for kjt in kjts]
        return self._lookup(kjts, replicated)

    def _lookup(self, kjts: list[KeyedJaggedTensor], replicated: list[bool] | None = None
                ) -> list[dict[str, JaggedTensor]]:
        self.finish_row_updates()
        train = self.training and torch.is_grad_enabled()
        now = self.event_time
        entries = [(i, name, feats) for i, kjt in enumerate(kjts) for name, feats in self._ids_per_table(kjt)]
        calls, values = [], []
        if self.world_size > 1 and entries:
            # Backward applies the KJTs' rows last KJT first, as autograd runs separate lookups
            # (the later node first): rows in two KJTs get the same optimizer steps either way.
            order = sorted(range(len(entries)), key=lambda e: (-entries[e][0], e))
            uncounted = [bool(replicated and replicated[i]) and self.rank != 0 for i, _, _ in entries]
            calls, values = self._grouped_lookup([(name, feats) for _, name, feats in entries], train, now, order,
                                                 uncounted)
        else:
            for _, name, feats in entries:
                call, vals = self._local_lookup(self.stores[name], self._table_ids(feats), train, now)
                calls.append(call)
                values.append(vals)
        if train and calls:
            outs = _FusedLookup.apply(self._anchor, calls, *values)
        else:
            outs = [c.output(v) for v, c in zip(values, calls)]
        results: list[dict[str, JaggedTensor]] = [{} for _ in kjts]
        for out_ND, (i, _, feats) in zip(outs, entries):
            sizes = [int(jt.values().numel()) for _, jt in feats]
            # One feature: the rows as they are (a split's backward would copy its gradient).
            for (key, jt), part in zip(feats, out_ND.split(sizes) if len(feats) > 1 else [out_ND]):
                results[i][key] = JaggedTensor(values=part, lengths=jt.lengths())
        return results

    @staticmethod
    def _local_lookup(store: TableStore, ids_N: torch.Tensor, train: bool, now: int | None):
        """One rank: (call, values) of one table's lookup."""
        if train and store.native_rows:
            vals_N, ctx = store.train_forward(ids_N, now)
            return _LocalCall(store, ctx), vals_N
        uniq_U, inv_N, cnt_U = torch.unique(ids_N, return_inverse=True, return_counts=True)
        if not train:
            vals_U = store.lookup_eval(uniq_U, now)
            return _EvalCall(inv_N.to(vals_U.device)), vals_U
        vals_U, admitted_U = store.lookup_train(uniq_U, cnt_U, now)
        return _TableCall(store, inv_N.to(vals_U.device), uniq_U, admitted_U, now, store.last_locations), vals_U

    @staticmethod
    def _table_ids(feats) -> torch.Tensor:
        parts = [jt.values() for _, jt in feats]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(torch.int64).cpu()

    def _grouped_lookup(self, tables, train: bool, now: int | None, apply_order: list[int],
                        uncounted: list[bool]):
        """Several ranks: every table of the lookup through one _GroupExchange. Returns the
        per-table calls (for _FusedLookup) and rows of this rank's unique ids. `uncounted[t]`:
        entry t's sightings count 0 here (a replicated KJT, counted on rank 0)."""
        stores = [self.stores[name] for name, _ in tables]
        uniq, inverse, counts = zip(*(torch.unique(self._table_ids(feats), return_inverse=True, return_counts=True)
                                      for _, feats in tables))
        counts = [c.zero_() if zero else c for c, zero in zip(counts, uncounted)]
        capacity = self._capacity.setdefault(tuple(k for _, feats in tables for k, _ in feats), _Capacity())
        ex = _GroupExchange(list(uniq), list(counts), [s.dim for s in stores], self.group, capacity)
        admitted, locations = [], []
        for t, store in enumerate(stores):
            ids_U, cnt_U = ex.owner_ids[t], ex.owner_counts[t]
            if train:
                rows_UD, adm = store.lookup_train(ids_U, cnt_U, now)
                admitted.append(adm)
                locations.append(store.last_locations)
            else:
                rows_UD = store.lookup_eval(ids_U, now)
            ex.put_rows(t, rows_UD)
        values = ex.rows_back()
        inverse = [inv.to(v.device) for inv, v in zip(inverse, values)]
        if not train:
            return [_EvalCall(inv) for inv in inverse], values
        group = _GroupCall(ex, stores, inverse, admitted, locations, now, apply_order,
                           self._deferred if self.defer_row_updates else None)
        return [_GroupMember(group, t) for t in range(len(stores))], values

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Bring the existing rows of an upcoming batch up to the device tier (collective)."""
        self.finish_row_updates()
        with torch.no_grad():
            for name, feats in self._ids_per_table(kjt):
                ids = torch.unique(torch.cat([jt.values() for _, jt in feats]).to(torch.int64).cpu())
                ex = _Exchange(ids, self.group)
                owner_ids = torch.unique(ex.to_owner(ids))
                self.stores[name].prefetch(owner_ids)

    def read_ahead(self, kjts: list[KeyedJaggedTensor]) -> int:
        """Start reading, without waiting, the SSD-tier pages of the rows an upcoming batch
        will look up (TableStore.read_ahead): called for batch t + 1 before step t, the disk
        reads them while step t computes. Advice only: no row, counter or placement changes,
        so training is bit for bit the same with or without it. Collective with several ranks
        (the ids go to their owners first: every rank calls it with the same keys, or none
        does). Returns the SSD rows this rank advised."""
        self.finish_row_updates()
        advised = 0
        with torch.no_grad():
            for kjt in kjts:
                for name, feats in self._ids_per_table(kjt):
                    ids = torch.cat([jt.values() for _, jt in feats]).to(torch.int64).cpu()
                    if self.world_size > 1:
                        ids = torch.unique(ids)
                        ids = _Exchange(ids, self.group).to_owner(ids)
                    advised += self.stores[name].read_ahead(ids)
        return advised

    # ------------------------------------------------------------------ stats / snapshots
    def stats(self) -> dict[str, dict[str, int]]:
        """Per table on this rank: rows per tier, lookup hits per tier, misses (new rows)."""
        self.finish_row_updates()
        out = {}
        for name, s in self.stores.items():
            out[name] = {f"rows_{n}": t.num_used for n, t in zip(("device", "host", "ssd"), s.tiers)}
            out[name].update({f"hits_{n}": h for n, h in zip(("device", "host", "ssd"), s.hits.tolist())})
            out[name]["misses"] = s.misses
        return out

    def save_snapshot(self, path: str, *, full: bool = False) -> list[str]:
        """Atomic, checksummed snapshot of every table (collective when distributed): a
        delta on the last one where `snapshot_max_deltas` allows (snapshot.py), unless
        `full`. Returns the files this rank wrote."""
        self.finish_row_updates()
        from .snapshot import save_snapshot

        return save_snapshot(self, path, max_deltas=0 if full else self.config.snapshot_max_deltas)

    def snapshot_moved(self, path: str) -> None:
        """The last snapshot's folder was renamed to `path` (a checkpoint that was written
        under a temporary name, then published): the next delta builds on it there."""
        if self.last_snapshot is not None:
            self.last_snapshot = (os.path.abspath(path), self.last_snapshot[1])

    def load_snapshot(self, path: str) -> None:
        """Load a snapshot saved under any world size (collective when distributed)."""
        self.finish_row_updates()
        from .snapshot import load_snapshot

        load_snapshot(self, path)
