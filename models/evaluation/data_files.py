"""The prepared data an evaluation reads: its files' checksums (recorded in the report),
a split's row count, and whether a run trained on the same data."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from genrec.data.files import sha256_file
from genrec.data.prepare import load_manifest


def manifest_checksums(data_dir: Path, manifest: dict) -> dict[str, str]:
    out = {"manifest.json": "sha256:" + sha256_file(data_dir / "manifest.json")}
    for rel, info in sorted(manifest.get("outputs", {}).items()):
        out[rel] = f"sha256:{info['sha256']}"
    return out


def split_rows(split_dir: Path) -> int:
    if not split_dir.is_dir():
        raise ValueError(f"{split_dir}: no such split directory in the prepared data")
    files = sorted(split_dir.glob("*.parquet"))
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    if rows == 0:
        raise ValueError(f"{split_dir}: the split is empty (no evaluation rows)")
    return rows


def trained_on_data(run_dir: Path, data_dir: Path) -> tuple[str | None, bool]:
    """(the data.path the run's config.json names, whether that folder holds other prepared
    files than `data_dir`, by their manifests' checksums). A folder that is not here (a run
    moved from another machine) cannot be told apart: False."""
    try:
        trained_on = str(json.loads((run_dir / "config.json").read_text())["data"]["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, False
    there = Path(trained_on)
    if not (there / "manifest.json").is_file() or there.resolve() == data_dir.resolve():
        return trained_on, False
    outputs = [{rel: info.get("sha256") for rel, info in load_manifest(d).get("outputs", {}).items()}
               for d in (there, data_dir)]
    return trained_on, outputs[0] != outputs[1]
