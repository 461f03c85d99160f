"""`genrec export`: a training checkpoint -> a serving artifact.

Reads the checkpoint through `models/runs.py` (never through the trainer) and writes the
artifact with `models/serving/artifact.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.dataset as ds
import torch

from genrec.models.config_loader import to_dict
from genrec.models.runs import CONFIG_FILE, load_trained, resolve_checkpoint
from genrec.data.files import claim_output_dir, staging_dir
from genrec.models.serving.artifact import MANIFEST, export_artifact, item_features_from_events, read_manifest
from genrec.models.serving.delta import DELTA_FORMAT, write_delta


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: str | None = None,
                      version: str | None = None, data_dir: str | Path | None = None,
                      overwrite: bool = False, retrieval_index: str = "auto",
                      delta_since: str | Path | None = None) -> Path:
    """`genrec export`: a checkpoint -> a serving artifact (see models/serving/artifact.py).

    The item index is the training split's item list; each item's side features (advertiser,
    campaign, ...) are taken from its last training event. data_dir: the prepared data
    directory (default: the path in the run's config, which may not exist on this machine).
    version: default RUN-STEP-DTYPE, so the fp32 and int8 artifacts of one checkpoint differ.
    retrieval_index: "auto", "exact" or "ivf" (see export_artifact). delta_since: a base
    artifact: write only what changed since it (models/serving/delta.py), for
    POST /admin/apply-delta. dtype: default the base's for a delta (a delta must match
    it), else fp32.
    """
    if delta_since is not None and retrieval_index == "ivf":
        raise ValueError("export: --retrieval-index ivf and --delta-since do not go together: a delta carries the "
                         "exact item index only (export a full artifact for an approximate index)")
    if dtype is None:
        dtype = read_manifest(delta_since)["dtype"] if delta_since is not None else "fp32"
    step_dir, run_dir = resolve_checkpoint(checkpoint)
    version = version or f"{run_dir.name}-{step_dir.name}-{dtype}"
    if not (0 < len(version) <= 200 and version.isprintable()):  # it goes into logs, metrics and responses
        raise ValueError(f"export: model version {version!r} must be 1-200 printable characters "
                         "(no newlines or control characters): choose one with --model-version")
    if data_dir is None:
        trained_on = json.loads((run_dir / CONFIG_FILE).read_text()).get("data", {}).get("path")
        if not trained_on or not Path(trained_on).is_dir():
            raise ValueError(f"{run_dir / CONFIG_FILE}: the run trained on data.path={trained_on!r}, which is not a "
                             "directory here: pass the prepared data directory (genrec export --data DIR)")
        overrides = None
    else:
        if not Path(data_dir).is_dir():
            raise ValueError(f"export: data directory {data_dir} does not exist")
        overrides = {"data": {"path": str(Path(data_dir).resolve())}}
    cfg, model = load_trained(step_dir, overrides=overrides)
    side = [f for f in model.candidate_features if f != cfg.data.features.item]
    item_features = None
    if side:
        columns = [cfg.data.features.item, *side]
        table = ds.dataset(Path(cfg.data.path) / "train", format="parquet").to_table(columns=columns)
        flat = {c: torch.from_numpy(table.column(c).combine_chunks().flatten().to_numpy().copy()) for c in columns}
        item_features = item_features_from_events(
            model.item_corpus, flat[cfg.data.features.item], {f: flat[f] for f in side}
        )
    if delta_since is None:
        return export_artifact(
            model, to_dict(cfg), out_dir, dtype=dtype, item_ids=model.item_corpus, version=version,
            item_features=item_features, overwrite=overwrite, retrieval_index=retrieval_index,
        )
    out = claim_output_dir(out_dir, overwrite=overwrite, manifest=MANIFEST, format=DELTA_FORMAT)
    # The full artifact is written aside, then diffed, in a staging folder of this process
    # (removed after): if the process is killed, the next export to `out` removes it, as it
    # does an abandoned staging folder, instead of a whole artifact's copy staying for good.
    full = staging_dir(out)
    try:
        export_artifact(model, to_dict(cfg), full / "artifact", dtype=dtype, item_ids=model.item_corpus,
                        version=version, item_features=item_features, retrieval_index="exact")
        return write_delta(full / "artifact", delta_since, out_dir, overwrite=overwrite)
    finally:
        shutil.rmtree(full, ignore_errors=True)
