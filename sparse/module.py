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
are deduplicated (torch.unique), sent to their owner rank (splitmix64(id) % world_size)
with all-to-all, admitted / materialized / brought up from SSD there (on CUDA host hits
move to the device tier too; on CPU both are process memory and they stay), and the
rows come back. The returned values are the output of one autograd Function whose
backward sums row gradients per unique id, sends them to the owners and applies the
sparse optimizer to the rows wherever they live at that moment: the trainer calls only
loss.backward(). Every rank must call forward with the same keys and run backward on
the outputs of every training forward (the backward holds collectives). On one rank with
native kernels and CPU rows, deduplication, lookup and gather are one native call
(TableStore.train_forward) and the backward one more; rows to create or move take the
general path inside it.

Eval mode or torch.no_grad(): read-only; unknown / unadmitted / expired ids read the
table's default row and no counter, row or tier changes.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from . import ssd_dir
from .config import SparseConfig, TableConfig
from .hashing import owner_rank
from .store import TableStore
from .tiers import remove_slab_files


class _Exchange:
    """Route unique ids of one table to their owner ranks and rows / gradients back."""

    def __init__(self, uniq_L: torch.Tensor, group) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        if self.world == 1:
            self.order_L = None
            return
        owner_L = owner_rank(uniq_L, self.world)
        self.order_L = torch.argsort(owner_L, stable=True)
        self.send_splits = torch.bincount(owner_L, minlength=self.world)
        recv = torch.empty_like(self.send_splits)
        dist.all_to_all_single(recv, self.send_splits, group=group)
        self.recv_splits = recv
        self.send_list, self.recv_list = self.send_splits.tolist(), recv.tolist()

    def to_owner(self, x_L: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x_L
        x_S = x_L[self.order_L].contiguous()
        out = x_S.new_empty((sum(self.recv_list), *x_S.shape[1:]))
        dist.all_to_all_single(out, x_S, self.recv_list, self.send_list, group=self.group)
        return out

    def from_owner(self, x_R: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x_R
        out_S = x_R.new_empty((sum(self.send_list), *x_R.shape[1:]))
        dist.all_to_all_single(out_S, x_R.contiguous(), self.send_list, self.recv_list, group=self.group)
        out_L = torch.empty_like(out_S)
        out_L[self.order_L] = out_S
        return out_L


class _TableCall:
    """Everything one table's backward needs from its forward."""

    def __init__(self, store, inverse_N, num_local, exchange, owner_ids_U, owner_inv_R, admitted_U, now, locations):
        self.locations = locations
        self.store, self.inverse_N, self.num_local, self.exchange = store, inverse_N, num_local, exchange
        self.owner_ids_U, self.owner_inv_R, self.admitted_U, self.now = owner_ids_U, owner_inv_R, admitted_U, now

    def apply_grad(self, grad_ND: torch.Tensor) -> None:
        grad_ND = grad_ND.float()  # rows and optimizer state are fp32 whatever autocast did
        d = grad_ND.shape[1]
        grad_LD = grad_ND.new_zeros(self.num_local, d).index_add_(0, self.inverse_N, grad_ND)
        if self.owner_inv_R is None:  # single rank: local unique ids are the owner's
            grad_UD = grad_LD
        else:
            grad_RD = self.exchange.to_owner(grad_LD)
            grad_UD = grad_RD.new_zeros(self.owner_ids_U.numel(), d).index_add_(0, self.owner_inv_R, grad_RD)
        if self.locations is not None:  # fast path: all admitted, locations still valid
            self.store.apply_grad(self.owner_ids_U, grad_UD, self.now, self.locations)
            return
        keep = self.admitted_U.nonzero().squeeze(1)
        self.store.apply_grad(self.owner_ids_U[keep], grad_UD[keep.to(grad_UD.device)], self.now)


    def output(self, values_LD: torch.Tensor) -> torch.Tensor:
        return values_LD.index_select(0, self.inverse_N)


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
        self.group = process_group if process_group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.device = torch.device(config.device)
        self.feature_to_table: dict[str, str] = {}
        self.tables: dict[str, TableConfig] = {}
        for t in config.tables:
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
        self.event_time: int | None = None
        # Leaf that makes the fused outputs require grad; it never receives a gradient.
        self._anchor = torch.zeros((), requires_grad=True)

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
        train = self.training and torch.is_grad_enabled()
        now = self.event_time
        calls, values, layout = [], [], []
        for name, feats in self._ids_per_table(kjt):
            store = self.stores[name]
            parts = [jt.values() for _, jt in feats]
            ids_N = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(torch.int64).cpu()
            if train and self.world_size == 1 and store.native_rows:
                vals_N, ctx = store.train_forward(ids_N, now)
                calls.append(_LocalCall(store, ctx))
                values.append(vals_N)
                layout.append(feats)
                continue
            uniq_L, inv_N, cnt_L = torch.unique(ids_N, return_inverse=True, return_counts=True)
            ex = _Exchange(uniq_L, self.group)
            if ex.world == 1:
                owner_ids, owner_inv, owner_cnt = uniq_L, None, cnt_L
            else:
                recv = ex.to_owner(torch.stack([uniq_L, cnt_L], dim=1))
                owner_ids, owner_inv = torch.unique(recv[:, 0], return_inverse=True)
                owner_cnt = torch.zeros_like(owner_ids).index_add_(0, owner_inv, recv[:, 1])
            locations = None
            if train:
                vals_U, admitted = store.lookup_train(owner_ids, owner_cnt, now)
                locations = store.last_locations
            else:
                vals_U, admitted = store.lookup_eval(owner_ids, now), None
            vals_L = ex.from_owner(vals_U[owner_inv.to(vals_U.device)] if ex.world > 1 else vals_U)
            inv_N = inv_N.to(vals_L.device)
            calls.append(_TableCall(store, inv_N, uniq_L.numel(), ex, owner_ids, owner_inv, admitted, now, locations))
            values.append(vals_L)
            layout.append(feats)
        if train and calls:
            outs = _FusedLookup.apply(self._anchor, calls, *values)
        else:
            outs = [c.output(v) for v, c in zip(values, calls)]
        result: dict[str, JaggedTensor] = {}
        for out_ND, feats in zip(outs, layout):
            sizes = [int(jt.values().numel()) for _, jt in feats]
            # One feature: the rows as they are (a split's backward would copy its gradient).
            for (key, jt), part in zip(feats, out_ND.split(sizes) if len(feats) > 1 else [out_ND]):
                result[key] = JaggedTensor(values=part, lengths=jt.lengths())
        return result

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Bring the existing rows of an upcoming batch up to the device tier (collective)."""
        with torch.no_grad():
            for name, feats in self._ids_per_table(kjt):
                ids = torch.unique(torch.cat([jt.values() for _, jt in feats]).to(torch.int64).cpu())
                ex = _Exchange(ids, self.group)
                owner_ids = torch.unique(ex.to_owner(ids))
                self.stores[name].prefetch(owner_ids)

    # ------------------------------------------------------------------ stats / snapshots
    def stats(self) -> dict[str, dict[str, int]]:
        """Per table on this rank: rows per tier, lookup hits per tier, misses (new rows)."""
        out = {}
        for name, s in self.stores.items():
            out[name] = {f"rows_{n}": t.num_used for n, t in zip(("device", "host", "ssd"), s.tiers)}
            out[name].update({f"hits_{n}": h for n, h in zip(("device", "host", "ssd"), s.hits)})
            out[name]["misses"] = s.misses
        return out

    def save_snapshot(self, path: str) -> list[str]:
        """Atomic, checksummed snapshot of every table (collective when distributed);
        returns the files this rank wrote."""
        from .snapshot import save_snapshot

        return save_snapshot(self, path)

    def load_snapshot(self, path: str) -> None:
        """Load a snapshot saved under any world size (collective when distributed)."""
        from .snapshot import load_snapshot

        load_snapshot(self, path)
