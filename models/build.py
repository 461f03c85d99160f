"""The one place a job's modules are built, materialized and parallelized.

`build_model` makes the sparse store (sharded across ranks by id hash inside the store),
the tower (with `dense.parallelize`'s checkpointing), the recommender around them, and
makes the dense parameters data-parallel when there are several ranks:
`train.dense_parallel` "ddp" (replicas, gradients all-reduced) or "fsdp2" (`fully_shard`:
each tower layer and the rest of the dense model sharded over the ranks, gathered per
forward, gradients reduce-scattered). The model file itself knows nothing of this.
Whatever the parallelism, `dense_state_dict` / `optimizer_state_dict` give the full state
dicts in one form, so a checkpoint moves between DDP and FSDP2 and between world sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from torchrec.sparse.jagged_tensor import JaggedTensor

from genrec.data.loader import make_loader
from genrec.dense import build_tower, parallelize, triton_hstu
from genrec.models.config import JobConfig
from genrec.models.config_loader import to_dict
from genrec.models.ranks import DistInfo
from genrec.models.model import GenerativeRecommender
from genrec.sparse import TieredEmbeddingCollection


def build_store(cfg: JobConfig, dist_info: DistInfo) -> TieredEmbeddingCollection:
    """The store on the trainer's device unless `sparse.device` names one. Its collectives
    share the world group, whose backend serves CPU tensors (split counts) over gloo and
    device tensors (ids, rows, gradients on CUDA) over NCCL (models/train/distributed.py)."""
    process_group = dist.group.WORLD if dist_info.world_size > 1 else None
    sparse = cfg.sparse if cfg.sparse.device else dataclasses.replace(cfg.sparse, device=str(dist_info.device))
    return TieredEmbeddingCollection(sparse, process_group=process_group)


def check_runnable(cfg: JobConfig, device: torch.device) -> None:
    """Refuse, naming the key, device settings this machine cannot run: at train start, before
    the run folder is touched (not at config load: eval and export read a GPU run's config
    on the CPU)."""
    if cfg.sparse.device and torch.device(cfg.sparse.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"sparse.device = {cfg.sparse.device!r}, but this machine has no CUDA device "
                         "(torch.cuda.is_available() is False); leave it unset to follow the trainer's device")
    if cfg.dense.kernel == "triton":
        if not triton_hstu.available():
            raise ValueError('dense.kernel = "triton" needs Triton: pip install -e ".[gpu]"')
        if device.type != "cuda" and not triton_hstu.interpreted():
            raise ValueError(f'dense.kernel = "triton" runs on CUDA, and this run is on {device} (on the CPU only '
                             'under TRITON_INTERPRET=1, for tests); choose "chunked" or "auto"')


def build_model(cfg: JobConfig, dist_info: DistInfo) -> tuple[nn.Module, TieredEmbeddingCollection]:
    if cfg.model.retrieval and cfg.model.negatives == "in_batch" and cfg.data.loader.batch_size < 2:
        raise ValueError("model.negatives = 'in_batch' needs data.loader.batch_size >= 2 "
                         f"(got {cfg.data.loader.batch_size}): a batch of one has no other targets")
    store = build_store(cfg, dist_info)
    feature_dims = {f: t.embedding_dim for t in cfg.sparse.tables for f in t.feature_names}
    tower = parallelize(build_tower(cfg.dense), activation_checkpointing=cfg.dense.activation_checkpointing)
    embeddings = store if dist_info.world_size == 1 else _AveragedRowGrads(store, dist_info.world_size)
    model = GenerativeRecommender(
        features=cfg.data.features, cfg=cfg.model, embeddings=embeddings,
        feature_dims=feature_dims, tower=tower, dim=cfg.dense.embedding_dim,
    )
    if dist_info.world_size > 1 and cfg.train.dense_parallel == "fsdp2":
        if cfg.train.precision == "fp16":
            raise ValueError("train.dense_parallel = 'fsdp2' runs in bf16 or fp32: train.precision 'fp16' "
                             "needs DDP (its gradient scaler does not see sharded gradients)")
        # The store holds no parameters (its rows live in its tiers), so every parameter
        # here is dense. One unit per layer keeps one layer's weights whole at a time.
        for layer in model.tower.layers:
            fully_shard(layer)
        fully_shard(model)
    elif dist_info.world_size > 1:
        # The store's rows are sharded, not replicated: DDP must neither broadcast nor
        # all-reduce anything under `embeddings.`.
        ignore = [n for n, _ in model.named_parameters() if n.startswith("embeddings.")]
        ignore += [n for n, _ in model.named_buffers() if n.startswith("embeddings.") or n == "item_corpus"]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
        model = _DDPRecommender(model)
    return model, store


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _AveragedRowGrads(nn.Module):
    """The store, with row gradients divided by the world size.

    DDP averages dense gradients over ranks, while the store sums the row gradients that
    arrive from every rank. Scaling by 1 / world_size makes both the gradient of the mean
    loss over ranks, so N ranks with batch b each train like one rank with batch N * b.
    """

    def __init__(self, store: nn.Module, world_size: int) -> None:
        super().__init__()
        self.store = store
        self.scale = 1.0 / world_size

    def forward(self, kjt):
        return self._scaled(self.store(kjt))

    def lookup_many(self, kjts, replicated=None):
        return [self._scaled(rows) for rows in self.store.lookup_many(kjts, replicated)]

    def read_ahead(self, kjts) -> int:  # advice only: no rows, so no gradients to scale
        return self.store.read_ahead(kjts)

    def _scaled(self, rows: dict) -> dict:
        return {key: JaggedTensor(values=_ScaleGrad.apply(jt.values(), self.scale), lengths=jt.lengths(),
                                  offsets=jt.offsets())
                for key, jt in rows.items()}


class _DDPRecommender(nn.Module):
    """DDP around the recommender that still exposes its scoring methods and attributes."""

    def __init__(self, model: GenerativeRecommender) -> None:
        super().__init__()
        self.ddp = DistributedDataParallel(model, broadcast_buffers=False)
        self.inner = model

    def forward(self, batch):
        return self.ddp(batch)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def state_dict(self, *args, **kwargs):
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.inner.load_state_dict(*args, **kwargs)


def unwrap(model: nn.Module) -> GenerativeRecommender:
    return model.inner if isinstance(model, _DDPRecommender) else model


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Whole dense weights inside the block, for calls other than `forward` (validation
    scores through the model's methods): FSDP2 gathers its shards only around forward
    (collective: every rank enters). A no-op for DDP and one rank."""
    units = [m for m in unwrap(model).modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()


def _sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense weights, whole and on CPU (FSDP2: collective, and only rank 0 gets them)."""
    state = get_model_state_dict(model, options=_FULL) if _sharded(model) else unwrap(model).state_dict()
    return {k: v for k, v in state.items() if not k.startswith("embeddings.")}


def load_dense_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `dense_state_dict`'s dict (every rank passes the whole of it)."""
    if _sharded(model):
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    missing, unexpected = unwrap(model).load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("embeddings.") for k in missing), (missing, unexpected)


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its state dict's numbering."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The dense optimizer's state dict in torch's own numbered form, whole and on CPU,
    as DDP saves it (FSDP2: collective, and only rank 0 gets it)."""
    if not _sharded(model):
        return optimizer.state_dict()
    full = get_optimizer_state_dict(model, optimizer, options=_FULL)
    if not full:
        return {}
    number = {name: i for i, name in enumerate(_optimizer_names(model, optimizer))}
    return {"state": {number[n]: s for n, s in full["state"].items()},
            "param_groups": [{**g, "params": [number[n] for n in g["params"]]} for g in full["param_groups"]]}


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    if not _sharded(model):
        optimizer.load_state_dict(state)
        return
    names = _optimizer_names(model, optimizer)
    named = {"state": {names[i]: s for i, s in state["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def dense_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters trained by the dense optimizer (sparse rows have the store's own)."""
    return [(n, p) for n, p in unwrap(model).named_parameters() if not n.startswith("embeddings.")]


# Config keys that change the shapes or the meaning of saved tensors. Others (dropout, the
# kernel, checkpointing, schedule) may change between a checkpoint and its resume.
_SHAPE_KEYS = {
    "dense": ("kind", "embedding_dim", "num_layers", "num_heads", "attention_dim", "linear_dim", "max_seq_len",
              "num_time_buckets", "attention_bias", "position_embedding", "ffn_multiplier"),
    "model": ("token_combine", "retrieval", "ranking", "ranking_tasks", "ranking_hidden_dim", "ranking_head_input"),
}


def config_fingerprint(cfg: JobConfig) -> dict[str, object]:
    """The config keys a checkpoint's tensors depend on; a resume with any other value is refused."""
    flat: dict[str, object] = {}
    for section, keys in _SHAPE_KEYS.items():
        values = to_dict(getattr(cfg, section))
        for key in keys:
            flat[f"{section}.{key}"] = json.dumps(values.get(key), sort_keys=True)
    flat["data.features"] = json.dumps(to_dict(cfg.data.features), sort_keys=True)
    for table in cfg.sparse.tables:
        for key in ("embedding_dim", "feature_names", "num_embeddings", "optimizer"):
            flat[f"sparse.tables[{table.name}].{key}"] = json.dumps(getattr(table, key))
    return flat


def eval_loader(cfg: JobConfig, split: str, *, rank: int = 0, world_size: int = 1, full_history: bool = False,
                batch_size: int | None = None, in_order: bool = False):
    """The loader of a prepared evaluation split: in order, each last event the target; every
    user of the rank's share (ranks' batch counts may differ: see `Trainer.validate`).
    `full_history`: histories are not cut to `data.loader.max_seq_len` (for seen-item
    filters; the model's window is cut from them). `batch_size`: users per batch (default
    `data.loader.batch_size`). `in_order`: no worker processes, so every batch but the last
    is full (worker loaders interleave each worker's short last batch with the others')."""
    loader_cfg = dataclasses.replace(
        cfg.data.loader, mode="eval", shuffle=False, stochastic_length_prob=0.0, random_end_prob=0.0,
        drop_last=False, equal_batches_per_rank=False, **({"max_seq_len": 2**31 - 1} if full_history else {}),
        **({"batch_size": batch_size} if batch_size else {}), **({"num_workers": 0} if in_order else {}),
    )
    return make_loader(Path(cfg.data.path) / split, cfg.data.features, loader_cfg, rank=rank, world_size=world_size)


def load_item_corpus(data_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted int64 ids of the items in the prepared training split, and their event counts."""
    path = Path(data_path) / "items.parquet"
    if not path.exists():
        raise ValueError(f"{path} not found: is {data_path} the output of `genrec prepare`?")
    table = pq.read_table(path, columns=["item_id", "count"])
    ids = torch.from_numpy(table.column("item_id").to_numpy().copy())
    counts = torch.from_numpy(table.column("count").to_numpy().copy()).long()
    order = torch.argsort(ids)
    return ids[order], counts[order]
