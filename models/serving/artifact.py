"""The serving artifact: everything `genrec serve` needs, in one versioned directory.

Layout (every file listed in the manifest with its sha256 and size):

    ARTIFACT/
      manifest.json              format, model version, feature spec, model / tower / job config,
                                 export dtype, library versions, per-file checksums
      dense.safetensors          the dense weights: tower, token projection, task heads (fp32)
      tower.pt2                  the tower's full forward as a `torch.export` program
      tables/<table>.safetensors one embedding table: `ids` (int64, sorted: the id index),
                                 `rows` (fp32 / fp16 / uint8) and for int8 `scale_bias` [N, 2]
      item_index.safetensors     retrieval index: `item_ids` (sorted), item rows (L2-normalized
                                 under `model.similarity = "cosine"`, raw under "dot")
                                 `embeddings` (fp32 / fp16, or for int8 symmetric int8 rows
                                 with a per-row `scale`, the layout FBGEMM's int8 GEMM takes)
                                 and each candidate side feature (`feature.<name>`) of every item

Worked example (a table of 3 learned ids, int8):

    ids        [3, 17, 90]                     sorted, so lookup is a searchsorted
    rows       uint8 [3, D]                    row r = rows[r] * scale_bias[r, 0] + scale_bias[r, 1]
    lookup([17, 5]) -> [row of 17, default row]   5 was never seen in training: the default
                                                  row (zeros, the store's `default_row="zeros"`)

Why the tower is stored twice: the `torch.export` program (`tower.pt2`) is the portable,
framework-independent record of the full forward (history + candidates under the
target-aware mask), traced with the tower's plain-PyTorch reference kernel (the fast kernels
call C through raw pointers) on one example jagged layout by `torch.export.draft_export` (the
tower's jagged bookkeeping is data-dependent), so it carries runtime asserts that the call has
that layout. The serving path does not run it: it rebuilds the tower from the manifest's
`TowerConfig` plus `dense.safetensors` so that it can use the tower's per-layer key/value
cache (`encode_history` / `score_targets`, M-FALCON) on any history length.

Loading never unpickles: JSON + safetensors only, after checksums pass. genrec never opens
`tower.pt2` beyond hashing it: `torch.export.load` unpickles parts of the archive (its sample
inputs fall back to `weights_only=False`, and so do tensor subclasses) and `sympy.sympify`s
(evals) its symbolic shapes, so a crafted program runs code however its checksum looks. A
tool that wants the program loads it itself (`torch.export.load(ARTIFACT / "tower.pt2")`), and
only from an artifact it trusts. The checksums catch corruption, not tampering: whoever can
rewrite a file can rewrite the manifest beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from genrec.data.files import claim_output_dir, publish_dir, sha256_file, staging_dir
from genrec.models.ids import sorted_positions
from genrec.models.serving import ann as ann_lib
from genrec.models.serving.mapped import RowCache, advise_random, will_need_rows
from genrec.models.model import retrieval_vectors

FORMAT = "genrec.artifact/1"
MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
PROGRAM_FILE = "tower.pt2"
ITEM_INDEX_FILE = "item_index.safetensors"
Dtype = Literal["fp32", "fp16", "int8"]


# ---------------------------------------------------------------------- row quantization


def quantize_rows(values_ND: torch.Tensor, dtype: Dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 rows -> stored rows: fp32 as is, fp16, or int8 row-wise (uint8 + fp32 scale, bias
    per row: FBGEMM's 8-bit row-wise scheme)."""
    values_ND = values_ND.detach().float().contiguous()
    if dtype == "fp32":
        return values_ND, None
    if dtype == "fp16":
        return values_ND.to(torch.float16), None
    if dtype != "int8":
        raise ValueError(f"export dtype must be one of 'fp32', 'fp16', 'int8', got {dtype!r}")
    lo_N1 = values_ND.min(dim=1, keepdim=True).values if values_ND.shape[1] else values_ND[:, :1]
    hi_N1 = values_ND.max(dim=1, keepdim=True).values if values_ND.shape[1] else values_ND[:, :1]
    scale_N1 = ((hi_N1 - lo_N1) / 255.0).clamp(min=1e-12)
    q_ND = torch.round((values_ND - lo_N1) / scale_N1).clamp(0, 255).to(torch.uint8)
    return q_ND, torch.cat([scale_N1, lo_N1], dim=1).contiguous()


def quantize_rows_symmetric(values_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 row-wise symmetric: rows = q * scale[:, None], q in [-127, 127]. Used for the item
    index, scanned as it is by the native retrieval scan (or, without it, packed for an int8
    GEMM: zero point 0 on the weight side)."""
    values_ND = values_ND.detach().float()
    scale_N = (values_ND.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q_ND = torch.round(values_ND / scale_N[:, None]).clamp(-127, 127).to(torch.int8)
    return q_ND.contiguous(), scale_N.contiguous()


def dequantize_rows(rows_ND: torch.Tensor, scale_bias_N2: torch.Tensor | None) -> torch.Tensor:
    if scale_bias_N2 is None:
        return rows_ND.float()
    return torch.addcmul(scale_bias_N2[:, 1:], rows_ND.float(), scale_bias_N2[:, :1])


@dataclass
class TablePatch:
    """Rows a live delta changed (models/serving/delta.py), consulted before the table's own."""

    ids_N: torch.Tensor
    """int64 [P], strictly increasing."""
    live_N: torch.Tensor
    """bool [P]: False for a row the delta removed (it reads the default row)."""
    rows_ND: torch.Tensor
    scale_bias_N2: torch.Tensor | None = None


@dataclass
class ServingTable:
    """One embedding table held for lookup: rows that exist, found by searchsorted."""

    ids_N: torch.Tensor
    """int64 [N], strictly increasing."""
    rows_ND: torch.Tensor
    """float32 / float16 / uint8 [N, D]."""
    scale_bias_N2: torch.Tensor | None
    """float32 [N, 2] for int8 rows, else None."""
    patch: TablePatch | None = None
    """Rows changed by live deltas since the artifact was loaded."""
    cache: RowCache | None = None
    """Hot rows held in memory, fp32 (`ServingConfig.table_cache_mb`); the table's own rows only."""

    @property
    def dim(self) -> int:
        return int(self.rows_ND.shape[1])

    def positions(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index clamped into range, found mask) of each id."""
        return sorted_positions(self.ids_N, ids)

    def lookup(self, ids: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """float32 [len(ids), D]; ids never seen in training read the default row (zeros).
        `at`: the ids' `positions`, where the caller already has them."""
        ids = ids.long()
        if self.ids_N.numel() == 0:  # a table with no rows (no id of its features was admitted): all default
            rows = torch.zeros(ids.numel(), self.dim)
        else:
            pos, found = self.positions(ids) if at is None else at
            rows = self._read(pos) if self.cache is None else self.cache.lookup(pos, self._read)
            rows *= found.unsqueeze(1)
        if self.patch is not None:
            p = self.patch
            ppos, pfound = sorted_positions(p.ids_N, ids)
            hit = pfound.nonzero().squeeze(1)
            psb = None if p.scale_bias_N2 is None else p.scale_bias_N2[ppos[hit]]
            rows[hit] = dequantize_rows(p.rows_ND[ppos[hit]], psb) * p.live_N[ppos[hit]].unsqueeze(1)
        return rows

    def _read(self, pos: torch.Tensor) -> torch.Tensor:
        if self.cache is not None:  # a table above the cache's bound: what misses may be on disk
            will_need_rows(self.rows_ND, pos)
            will_need_rows(self.scale_bias_N2, pos)
        sb = None if self.scale_bias_N2 is None else self.scale_bias_N2[pos]
        return dequantize_rows(self.rows_ND[pos], sb)

    def nbytes(self) -> int:
        extra = 0 if self.scale_bias_N2 is None else self.scale_bias_N2.nbytes
        extra += 0 if self.cache is None else self.cache.nbytes()
        if self.patch is not None:
            p = self.patch
            extra += p.ids_N.nbytes + p.live_N.nbytes + p.rows_ND.nbytes
            extra += 0 if p.scale_bias_N2 is None else p.scale_bias_N2.nbytes
        return self.ids_N.nbytes + self.rows_ND.nbytes + extra


# ---------------------------------------------------------------------- reading the store


def _table_rows(embeddings: torch.nn.Module) -> dict[str, tuple[list[str], torch.Tensor, torch.Tensor]]:
    """table name -> (feature names, ids [N] sorted, fp32 rows [N, D]) of every row that exists."""
    out = {}
    if hasattr(embeddings, "stores") and hasattr(embeddings, "tables"):  # genrec TieredEmbeddingCollection
        if getattr(embeddings, "world_size", 1) != 1:
            raise ValueError("export reads every row of the tiered store: run it in one process "
                             "(load the checkpoint with world_size 1)")
        for name, store in embeddings.stores.items():
            ids_N, rows_NW, _ = store.all_rows()
            order = torch.argsort(ids_N)
            out[name] = (list(embeddings.tables[name].feature_names), ids_N[order].long(),
                         rows_NW[order, : store.dim].float())
        return out
    if hasattr(embeddings, "embedding_configs") and hasattr(embeddings, "embeddings"):  # torchrec EC
        for cfg in embeddings.embedding_configs():
            weight = embeddings.embeddings[cfg.name].weight.detach()
            out[cfg.name] = (list(cfg.feature_names), torch.arange(weight.shape[0]), weight.float())
        return out
    raise ValueError(f"export cannot read rows from a {type(embeddings).__name__}: expected genrec's "
                     "TieredEmbeddingCollection or a torchrec EmbeddingCollection")


def _lookup_fp32(table: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    ids_N, rows_ND = table
    return ServingTable(ids_N=ids_N, rows_ND=rows_ND, scale_bias_N2=None).lookup(ids)


# ---------------------------------------------------------------------- files and checksums


def _library_versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "safetensors", "genrec"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return versions


def _export_program(tower: torch.nn.Module, dim: int, path: Path) -> dict[str, Any]:
    """Trace the tower's full forward (one row: 8 history events + 4 candidates)."""
    num_history, num_candidates = 8, 4
    gen = torch.Generator().manual_seed(0)
    values_TD = torch.randn(num_history + num_candidates, dim, generator=gen)
    offsets_B1 = torch.tensor([0, num_history + num_candidates])
    timestamps_T = torch.arange(num_history + num_candidates, dtype=torch.int64) * 60
    num_targets_B = torch.tensor([num_candidates])
    args = (values_TD, offsets_B1, timestamps_T, num_targets_B)
    # Trace the plain-PyTorch reference kernel (the specification): the fast kernels call
    # into C through raw data pointers, which no tracer can follow. Same weights, same math.
    from genrec.dense.tower import build_tower

    reference = build_tower(dataclasses.replace(tower.cfg, kernel="reference")).eval()
    reference.load_state_dict(tower.state_dict())
    tower = reference
    # draft_export specializes the data-dependent jagged bookkeeping to this layout (and logs
    # each specialization loudly); the program keeps runtime asserts for it.
    noisy = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch.export._draft_export")]
    levels = [lg.level for lg in noisy]
    for lg in noisy:
        lg.setLevel(logging.ERROR)
    try:
        with torch.no_grad():
            program = torch.export.draft_export(tower, args)
    finally:
        for lg, level in zip(noisy, levels):
            lg.setLevel(level)
    torch.export.save(program, str(path))
    return {"file": PROGRAM_FILE, "inputs": ["values_TD", "offsets_B1", "timestamps_T", "num_targets_B"],
            "example_offsets_B1": offsets_B1.tolist(), "example_num_targets_B": num_targets_B.tolist(),
            "traced_by": "torch.export.draft_export", "kernel": "reference"}


# ---------------------------------------------------------------------- export


def item_features_from_events(item_ids: torch.Tensor, event_item_ids_E: torch.Tensor,
                              event_features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Side features of each corpus item from an event log (e.g. the training split's events):
    the value on the item's last event in the given order; -1 (the default row) for an item
    with no event. Feeds `export_artifact(item_features=...)`.

        item_ids [5, 7], events item [7, 5, 7] advertiser [2, 3, 4]  ->  {"advertiser_id": [3, 4]}
    """
    item_ids = torch.as_tensor(item_ids).long()
    order = torch.argsort(item_ids)
    sorted_ids = item_ids[order]
    ev = torch.as_tensor(event_item_ids_E).long()
    pos, hit = sorted_positions(sorted_ids, ev)
    out = {}
    for f, values in event_features.items():
        values = torch.as_tensor(values).long()
        if values.shape != ev.shape:
            raise ValueError(f"item_features_from_events: {f} has {values.numel()} values for {ev.numel()} events")
        col = torch.full((len(item_ids),), -1, dtype=torch.int64)
        # index_put_ with repeated indices keeps one write per slot; write events in order,
        # deduplicated to the last occurrence of each item, so "last wins" is guaranteed.
        idx = order[pos[hit]]
        vals = values[hit]
        last = torch.zeros(len(item_ids), dtype=torch.int64).scatter_reduce(
            0, idx, torch.arange(len(idx)), reduce="amax", include_self=False)
        seen = torch.zeros(len(item_ids), dtype=torch.bool)
        seen[idx] = True
        col[seen] = vals[last[seen]]
        out[f] = col
    return out


def export_artifact(
    model: torch.nn.Module,
    job_config_dict: dict,
    out_dir: str | os.PathLike,
    *,
    dtype: Dtype,
    item_ids: torch.Tensor,
    version: str,
    item_features: dict[str, torch.Tensor] | None = None,
    export_program: bool = True,
    overwrite: bool = False,
    retrieval_index: str = "auto",
    ann_recall_target: float = 0.95,
) -> Path:
    """Write the serving artifact of a trained `GenerativeRecommender` to `out_dir`.

    item_ids: the retrieval corpus (the prepared data's item list). item_features: each
    candidate side feature (every sparse feature except the item and the action, e.g.
    advertiser_id) of every item, aligned with `item_ids`; required when such features exist,
    because a retrieved item's tokens need them. export_program=False skips the
    `torch.export` trace (tests that do not need it; the manifest then says so).
    retrieval_index: "exact" (the item index only), "ivf" (also the approximate index of
    models/serving/ann.py, its nprobe calibrated to `ann_recall_target` recall@500) or
    "auto" (ivf above ann.EXACT_MAX_ITEMS items). The directory is written under a temporary name and renamed into place.
    """
    out = claim_output_dir(out_dir, overwrite=overwrite, manifest=MANIFEST, format=FORMAT)
    if dtype not in ("fp32", "fp16", "int8"):
        raise ValueError(f"export dtype must be one of 'fp32', 'fp16', 'int8', got {dtype!r}")
    if retrieval_index not in ("auto", "exact", "ivf"):
        raise ValueError(f"export retrieval_index must be 'auto', 'exact' or 'ivf', got {retrieval_index!r}")
    spec = model.features
    side_features = [f for f in model.candidate_features if f != spec.item]
    item_features = dict(item_features or {})
    item_ids = torch.as_tensor(item_ids).long().flatten()
    if item_ids.numel() == 0:
        raise ValueError("export: item_ids is empty; the retrieval index needs the item corpus")
    missing = [f for f in side_features if f not in item_features]
    if missing:
        raise ValueError(f"export: item_features must give {missing} for every item (candidate side features)")
    for f, col in item_features.items():
        if f not in side_features:
            raise ValueError(f"export: item_features[{f!r}] is not a candidate side feature ({side_features})")
        if torch.as_tensor(col).numel() != item_ids.numel():
            raise ValueError(f"export: item_features[{f!r}] has {torch.as_tensor(col).numel()} entries, "
                             f"item_ids has {item_ids.numel()}")
    order = torch.argsort(item_ids)
    item_ids = item_ids[order]
    if item_ids.numel() > 1 and bool((item_ids[1:] == item_ids[:-1]).any()):
        raise ValueError("export: item_ids contains duplicates")

    tmp = staging_dir(out)
    try:
        was_training = model.training
        model.eval()
        (tmp / "tables").mkdir()
        tables_meta = {}
        item_rows = {}
        for name, (features, ids_N, rows_ND) in _table_rows(model.embeddings).items():
            if spec.item in features:
                item_rows[name] = (ids_N, rows_ND)
            rows, scale_bias = quantize_rows(rows_ND, dtype)
            tensors = {"ids": ids_N.contiguous(), "rows": rows}
            if scale_bias is not None:
                tensors["scale_bias"] = scale_bias
            save_file(tensors, str(tmp / "tables" / f"{name}.safetensors"))
            tables_meta[name] = {"features": features, "num_rows": int(ids_N.numel()),
                                 "embedding_dim": int(rows_ND.shape[1]), "default_row": "zeros"}
        dense = {k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous()
                 for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
        save_file(dense, str(tmp / DENSE_FILE))
        # The retrieval head scores against the item rows as `model.similarity` sees them
        # (GenerativeRecommender.item_embeddings); from the fp32 rows just read, before quantization.
        item_table = next(t for t, meta in tables_meta.items() if spec.item in meta["features"])
        emb_ND = retrieval_vectors(_lookup_fp32(item_rows[item_table], item_ids), model.cfg.similarity)
        index = {"item_ids": item_ids.contiguous()}
        if dtype == "int8":
            index["embeddings"], index["scale"] = quantize_rows_symmetric(emb_ND)
        else:
            index["embeddings"] = quantize_rows(emb_ND, dtype)[0]
        for f in side_features:
            index[f"feature.{f}"] = torch.as_tensor(item_features[f]).long().flatten()[order].contiguous()
        save_file(index, str(tmp / ITEM_INDEX_FILE))
        ann = None
        if retrieval_index == "ivf" or (retrieval_index == "auto" and item_ids.numel() > ann_lib.EXACT_MAX_ITEMS):
            ann = ann_lib.build_ivf(emb_ND, tmp / ann_lib.ANN_FILE, recall_target=ann_recall_target)
        program = _export_program(model.tower, model.dim, tmp / PROGRAM_FILE) if export_program else None
        if was_training:
            model.train()

        tower_cfg = getattr(model.tower, "cfg", None)
        if not dataclasses.is_dataclass(tower_cfg):
            raise ValueError("export: the tower must carry its TowerConfig as `.cfg` (genrec.dense.build_tower)")
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        manifest = {
            "format": FORMAT,
            "version": version,
            "created_unix": int(time.time()),
            "dtype": dtype,
            "dim": int(model.dim),
            "features": dataclasses.asdict(spec),
            "feature_dims": {f: tables_meta[t]["embedding_dim"] for t in tables_meta
                             for f in tables_meta[t]["features"]},
            "model": dataclasses.asdict(model.cfg),
            "tower": dataclasses.asdict(tower_cfg),
            "tables": tables_meta,
            "item_index": {"num_items": int(item_ids.numel()), "side_features": side_features, "ann": ann},
            "program": program,
            "job_config": job_config_dict,
            "libraries": _library_versions(),
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        # The artifact is meant to be read by servers under other users.
        umask = os.umask(0)
        os.umask(umask)
        for path in [tmp, *tmp.rglob("*")]:
            os.chmod(path, (0o755 if path.is_dir() else 0o644) & ~umask)
        publish_dir(tmp, out, manifest=MANIFEST, format=FORMAT)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------- loading


@dataclass
class ArtifactContents:
    """A verified artifact in memory (no module built yet)."""

    path: Path
    manifest: dict
    dense_state: dict[str, torch.Tensor]
    tables: dict[str, ServingTable]
    """By table name; `manifest["tables"][name]["features"]` says which features read it."""
    item_ids_N: torch.Tensor
    item_rows_ND: torch.Tensor
    item_scale_N: torch.Tensor | None
    """float32 [N] for an int8 (symmetric) item index, else None."""
    item_side_features: dict[str, torch.Tensor]


def read_manifest(artifact_dir: str | os.PathLike) -> dict:
    path = Path(artifact_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no artifact manifest (is {artifact_dir} an exported artifact?)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest (format={manifest.get('format') if isinstance(manifest, dict) else None!r})")
    for key in ("version", "dtype", "features", "model", "tower", "tables", "files", "feature_dims", "dim"):
        if key not in manifest:
            raise ValueError(f"{path}: manifest lacks {key!r}")
    # The loaders index into these: a malformed manifest is refused here, naming the key.
    for key, kind in (("version", str), ("dtype", str), ("features", dict), ("model", dict), ("tower", dict),
                      ("tables", dict), ("files", dict), ("feature_dims", dict), ("dim", int)):
        if not isinstance(manifest[key], kind):
            raise ValueError(f"{path}: manifest {key!r} must be a {kind.__name__}, got {type(manifest[key]).__name__}")
    if manifest["dtype"] not in _TABLE_ROWS:
        raise ValueError(f"{path}: manifest 'dtype' must be one of {sorted(_TABLE_ROWS)}, got {manifest['dtype']!r}")
    if not isinstance(manifest["tower"].get("max_seq_len"), int):
        raise ValueError(f"{path}: manifest lacks an integer 'tower.max_seq_len'")
    index = manifest.get("item_index", {})
    if not isinstance(index, dict) or (index.get("ann") is not None and not isinstance(index["ann"], dict)):
        raise ValueError(f"{path}: manifest 'item_index' must be a dict, its 'ann' a dict or null")
    for name, meta in manifest["tables"].items():
        if not isinstance(meta, dict) or not isinstance(meta.get("features"), list):
            raise ValueError(f"{path}: manifest 'tables.{name}' needs a 'features' list")
    return manifest


def verify_artifact(artifact_dir: str | os.PathLike) -> dict:
    """Manifest after checking every listed file's size and sha256; names the bad file."""
    root = Path(artifact_dir)
    manifest = read_manifest(root)
    verify_files(root, manifest)
    return manifest


def verify_files(root: Path, manifest: dict) -> None:
    """Check each file of `manifest["files"]` under `root`: inside it, present, of the listed
    size and sha256. Names the bad file."""
    real_root = root.resolve()
    if not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{root / MANIFEST}: manifest 'files' must be a dict")
    for rel, info in manifest["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str) and isinstance(info.get("bytes"), int)):
            raise ValueError(f"{root / MANIFEST}: manifest 'files.{rel}' needs 'sha256' (a string) and 'bytes' (an integer)")
        path = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"{root / MANIFEST}: file entry {rel!r} points outside the artifact")
        if real_root not in path.resolve().parents:
            raise ValueError(f"artifact file {rel} is a link out of {root}")
        if not path.is_file():
            raise ValueError(f"artifact file {rel} is missing from {root}")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise ValueError(f"artifact file {rel}: {size} bytes, manifest says {info['bytes']} (truncated or replaced)")
        if sha256_file(path) != info["sha256"]:
            raise ValueError(f"artifact file {rel}: sha256 mismatch with the manifest (tampered or corrupted)")


def _load_safetensors(root: Path, rel: str, manifest: dict) -> dict[str, torch.Tensor]:
    if rel not in manifest["files"]:
        raise ValueError(f"{root / MANIFEST}: manifest does not list {rel}")
    try:
        return load_file(str(root / rel))
    except Exception as e:  # safetensors raises its own error type on malformed headers
        raise ValueError(f"artifact file {rel}: not a readable safetensors file ({e})") from None


_TABLE_ROWS = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.uint8}
_INDEX_ROWS = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}


def content_fingerprint(manifest: dict) -> str:
    """What names an artifact's contents beyond its version string (two runs can export the
    same name): a digest of its files' checksums. Contents built by a delta carry the
    fingerprint of the artifact they equal."""
    if isinstance(manifest.get("fingerprint"), str):
        return manifest["fingerprint"]
    sums = {rel: info["sha256"] for rel, info in sorted(manifest["files"].items())}
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16]


def check_ids(where: str, key: str, ids: torch.Tensor, count: int | None = None) -> None:
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"{where}: {key!r} must be int64 [N], got {ids.dtype} {list(ids.shape)}")
    if count is not None and ids.numel() != count:
        raise ValueError(f"{where}: {key!r} has {ids.numel()} ids, the manifest says {count}")
    block = 1 << 24  # in blocks: a mapped table's ids may exceed memory, and so would one [N] mask
    for s in range(0, max(ids.numel() - 1, 0), block):
        part = ids[s : s + block + 1]
        if not bool((part[1:] > part[:-1]).all()):
            raise ValueError(f"{where}: {key!r} must be strictly increasing (lookups search it)")


def _check_shape(where: str, key: str, t: torch.Tensor | None, shape: list[int], dtype: torch.dtype) -> None:
    if t is None:
        raise ValueError(f"{where}: needs tensor {key!r} ({dtype} {shape})")
    if list(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{where}: {key!r} must be {dtype} {shape}, got {t.dtype} {list(t.shape)}")


def check_table(where: str, t: dict[str, torch.Tensor], dim: int, dtype: str, num_rows: int | None = None) -> None:
    """A table's tensors as an artifact (or a delta) of `dtype` at width `dim` holds them:
    sorted int64 `ids`, one row each, `scale_bias` exactly for int8. Names the file and the
    tensor: an inconsistent file would otherwise load and fail or answer wrongly per request."""
    check_ids(where, "ids", t["ids"], num_rows)
    n = t["ids"].numel()
    _check_shape(where, "rows", t.get("rows"), [n, dim], _TABLE_ROWS[dtype])
    if dtype == "int8":
        _check_shape(where, "scale_bias", t.get("scale_bias"), [n, 2], torch.float32)
    elif "scale_bias" in t:
        raise ValueError(f"{where}: 'scale_bias' in a {dtype} table (only int8 rows have one)")


def check_item_index(where: str, index: dict[str, torch.Tensor], manifest: dict, num_items: int | None) -> None:
    """The item index's columns: sorted int64 `item_ids`, and per item a row of `embeddings`
    (with its `scale` for int8) and a value of each side feature the manifest lists."""
    check_ids(where, "item_ids", index["item_ids"], num_items)
    n, dtype = index["item_ids"].numel(), manifest["dtype"]
    _check_shape(where, "embeddings", index.get("embeddings"), [n, manifest["dim"]], _INDEX_ROWS[dtype])
    if dtype == "int8":
        _check_shape(where, "scale", index.get("scale"), [n], torch.float32)
    for f in (manifest.get("item_index") or {}).get("side_features", []):
        _check_shape(where, f"feature.{f}", index.get(f"feature.{f}"), [n], torch.int64)


def load_artifact_contents(artifact_dir: str | os.PathLike) -> ArtifactContents:
    """Verify checksums, then read JSON + safetensors only (nothing is unpickled)."""
    root = Path(artifact_dir)
    manifest = verify_artifact(root)
    dense_state = _load_safetensors(root, DENSE_FILE, manifest)
    tables = {}
    for name in manifest["tables"]:
        rel = f"tables/{name}.safetensors"
        t = _load_safetensors(root, rel, manifest)
        if "ids" not in t or "rows" not in t:
            raise ValueError(f"artifact file {rel}: needs tensors 'ids' and 'rows'")
        meta = manifest["tables"][name]
        check_table(f"artifact file {rel}", t, meta.get("embedding_dim", manifest["dim"]), manifest["dtype"],
                    meta.get("num_rows"))
        advise_random(t["ids"], t["rows"], t.get("scale_bias"))
        tables[name] = ServingTable(ids_N=t["ids"], rows_ND=t["rows"], scale_bias_N2=t.get("scale_bias"))
    index = _load_safetensors(root, ITEM_INDEX_FILE, manifest)
    if "item_ids" not in index or "embeddings" not in index:
        raise ValueError(f"artifact file {ITEM_INDEX_FILE}: needs tensors 'item_ids' and 'embeddings'")
    num_items = (manifest.get("item_index") or {}).get("num_items")
    check_item_index(f"artifact file {ITEM_INDEX_FILE}", index, manifest, num_items)
    side = {k[len("feature."):]: v for k, v in index.items() if k.startswith("feature.")}
    return ArtifactContents(
        path=root, manifest=manifest, dense_state=dense_state, tables=tables,
        item_ids_N=index["item_ids"], item_rows_ND=index["embeddings"],
        item_scale_N=index.get("scale"), item_side_features=side,
    )
