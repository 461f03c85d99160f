"""Load a trained model from a training checkpoint for evaluation and export (one process).

    cfg, model = load_trained("runs/ml100k")          # a run dir: its latest checkpoint
    cfg, model = load_trained("runs/ml100k/checkpoints/step-00001000")

The checkpoint may come from any world size: the dense weights are replicated and the
sparse snapshot reshards on load. Nothing is unpickled (weights_only loading), and every
file is checked against its checksum first.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from genrec.models.build import build_model, load_item_corpus, unwrap
from genrec.models.checkpoint import DENSE_FILE, CheckpointManager, read_marker
from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict
from genrec.models.distributed import DistInfo
from genrec.models.model import GenerativeRecommender
from genrec.models.trainer import sparse_snapshot_dir

CONFIG_FILE = "config.json"


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(checkpoint step dir, run dir) for a run dir or a step dir."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if (path / CONFIG_FILE).is_file():
        latest = CheckpointManager(path / "checkpoints", rank=0, world_size=1).latest(required=True)
        return latest, path
    run_dir = path.parent.parent
    if read_marker(path) is None or not (run_dir / CONFIG_FILE).is_file():
        raise ValueError(f"{path} is neither a run directory (with {CONFIG_FILE}) nor a complete checkpoint in one")
    return path, run_dir


def load_trained(path: str | Path, *, overrides: dict | None = None) -> tuple[JobConfig, GenerativeRecommender]:
    """The run's config and its model with the checkpoint's weights and rows, in eval mode."""
    step_dir, run_dir = resolve_checkpoint(path)
    raw = json.loads((run_dir / CONFIG_FILE).read_text())
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update(values)
    cfg = from_dict(JobConfig, raw)
    cfg.sparse.ssd_dir = None  # a private temporary SSD tier, never the training run's
    model, store = build_model(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    model = unwrap(model)
    marker = read_marker(step_dir)
    dense_file = step_dir / DENSE_FILE
    CheckpointManager.verify_file(dense_file, marker["files"][DENSE_FILE])
    dense = torch.load(dense_file, map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(dense["model"], strict=False)
    if unexpected or any(not k.startswith("embeddings.") for k in missing):
        raise ValueError(f"{dense_file} does not fit the model of {run_dir / CONFIG_FILE}: "
                         f"missing {missing}, unexpected {unexpected}")
    store.load_snapshot(str(sparse_snapshot_dir(step_dir)))
    model.set_item_corpus(load_item_corpus(cfg.data.path))
    model.eval()
    return cfg, model


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: str = "fp32",
                      version: str | None = None, overwrite: bool = False) -> Path:
    """`genrec export`: a checkpoint -> a serving artifact (see models/artifact.py).

    The item index is the training split's item list; each item's side features (advertiser,
    campaign, ...) are taken from its last training event.
    """
    import pyarrow.dataset as ds

    from genrec.models.artifact import export_artifact, item_features_from_events
    from genrec.models.config_loader import to_dict

    step_dir, run_dir = resolve_checkpoint(checkpoint)
    cfg, model = load_trained(step_dir)
    side = [f for f in model.candidate_features if f != cfg.data.features.item]
    item_features = None
    if side:
        columns = [cfg.data.features.item, *side]
        table = ds.dataset(Path(cfg.data.path) / "train", format="parquet").to_table(columns=columns)
        flat = {c: torch.from_numpy(table.column(c).combine_chunks().flatten().to_numpy().copy()) for c in columns}
        item_features = item_features_from_events(
            model.item_corpus, flat[cfg.data.features.item], {f: flat[f] for f in side}
        )
    version = version or f"{run_dir.name}-{step_dir.name}"
    return export_artifact(
        model, to_dict(cfg), out_dir, dtype=dtype, item_ids=model.item_corpus, version=version,
        item_features=item_features, overwrite=overwrite,
    )
