"""`genrec export`: a training checkpoint -> a serving artifact.

Reads the checkpoint through `models/runs.py` (never through the trainer) and writes the
artifact with `models/serving/artifact.py`.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.dataset as ds
import torch

from genrec.models.config_loader import to_dict
from genrec.models.runs import load_trained, resolve_checkpoint
from genrec.models.serving.artifact import export_artifact, item_features_from_events


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: str = "fp32",
                      version: str | None = None, overwrite: bool = False) -> Path:
    """`genrec export`: a checkpoint -> a serving artifact (see models/serving/artifact.py).

    The item index is the training split's item list; each item's side features (advertiser,
    campaign, ...) are taken from its last training event.
    """
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
