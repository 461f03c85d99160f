"""Live row updates: an artifact delta holds only what changed since a base artifact, and a
running server applies it without a restart.

    genrec export --checkpoint runs/ads --out artifacts/v2-delta --delta-since artifacts/v1
    curl -X POST localhost:8080/admin/apply-delta -H "authorization: Bearer $TOKEN" \\
         -d '{"delta": "artifacts/v2-delta"}'

A delta directory (format `DELTA_FORMAT`, checksummed like an artifact):
    manifest.json                the new artifact's manifest (minus its file list), the base
                                 version it applies to, and per table the rows it carries
    tables/NAME.safetensors      the rows that are new or changed (`ids`, `rows`, and
                                 `scale_bias` for int8), and `removed_ids`: rows the base has
                                 and the new model dropped (evicted), which read the default row
    item_index.safetensors       the same for the retrieval corpus (`item_ids`, `embeddings`,
                                 `scale`, `feature.F`, `removed_ids`)
    dense.safetensors            the whole dense state (small beside the tables)

Applying keeps the base tables memory-mapped: each table gets a sorted patch (the delta's
rows) that lookups consult first, so the work is proportional to the delta, not the table.
The item index, which exact retrieval scans whole, is merged. A new `Ranker` is built beside
the serving one and swapped in whole, so no request sees a half-applied delta. A delta whose
base is not the serving version, by name or by contents (`base_fingerprint`: two runs can
export the same name), is refused (`DeltaConflict`: HTTP 409, naming both); one whose
tensors or model config do not fit the serving model is refused before anything is built.
Artifacts with an approximate index take full reloads (its lists would need rebuilding).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from genrec.data.files import claim_output_dir, publish_dir, sha256_file, staging_dir, unreplaced
from genrec.models.ids import sorted_positions
from genrec.models.serving.ann import manifest_entry as ann_manifest_entry
from genrec.models.serving.artifact import (
    DENSE_FILE, ITEM_INDEX_FILE, MANIFEST, ArtifactContents, ServingTable, TablePatch, check_ids, check_item_index,
    check_table, content_fingerprint, load_artifact_contents, verify_files,
)

DELTA_FORMAT = "genrec.delta/1"


class DeltaConflict(ValueError):
    """The delta was made for another base version than the one being served."""


def _same_rows(a_ND: torch.Tensor, b_ND: torch.Tensor) -> torch.Tensor:
    """Bitwise row equality (NaN-safe: compares the stored bytes)."""
    if a_ND.dtype.is_floating_point:
        view = {torch.float32: torch.int32, torch.float16: torch.int16}[a_ND.dtype]
        a_ND, b_ND = a_ND.view(view), b_ND.view(view)
    return (a_ND == b_ND).all(dim=1) if a_ND.dim() == 2 else a_ND == b_ND


def diff_rows(base_ids_N: torch.Tensor, new_ids_M: torch.Tensor, base_cols: dict, new_cols: dict) -> tuple:
    """(mask over the new ids of rows new or changed in any column, ids of the base that the
    new set lacks). Both id lists strictly increasing; columns align with their ids."""
    pos, found = sorted_positions(base_ids_N, new_ids_M)
    same = found.clone()
    hit = found.nonzero().squeeze(1)
    for name, col in new_cols.items():
        same[hit] &= _same_rows(base_cols[name][pos[hit]], col[hit])
    _, kept = sorted_positions(new_ids_M, base_ids_N)
    return ~same, base_ids_N[~kept]


def _table_columns(t: ServingTable) -> dict[str, torch.Tensor]:
    cols = {"rows": t.rows_ND}
    if t.scale_bias_N2 is not None:
        cols["scale_bias"] = t.scale_bias_N2
    return cols


def _index_columns(c: ArtifactContents) -> dict[str, torch.Tensor]:
    cols = {"embeddings": c.item_rows_ND, **{f"feature.{f}": v for f, v in c.item_side_features.items()}}
    if c.item_scale_N is not None:
        cols["scale"] = c.item_scale_N
    return cols


def _comparable(m: dict) -> dict:
    return {k: m[k] for k in ("format", "dtype", "dim", "features", "feature_dims", "model", "tower")}


def write_delta(new_dir: str | Path, base_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """The delta that turns artifact `base_dir` into artifact `new_dir`, written to `out_dir`
    (atomically). Both must share dtype, features, model and tower configs and tables."""
    out = claim_output_dir(out_dir, overwrite=overwrite, manifest=MANIFEST, format=DELTA_FORMAT)
    base, new = load_artifact_contents(base_dir), load_artifact_contents(new_dir)
    bm, nm = base.manifest, new.manifest
    if _comparable(bm) != _comparable(nm) or set(bm["tables"]) != set(nm["tables"]):
        diff = sorted(k for k in _comparable(bm) if bm[k] != nm[k]) or ["tables"]
        raise ValueError(f"export --delta-since {base_dir}: the base differs in {diff}; a delta carries rows and "
                         "weights only: export a full artifact")
    if ann_manifest_entry(bm) or ann_manifest_entry(nm):
        raise ValueError(f"export --delta-since {base_dir}: artifacts with an approximate retrieval index take full "
                         "reloads (export a full artifact)")
    tmp = staging_dir(out)
    try:
        (tmp / "tables").mkdir()
        counts = {}
        for name, t in new.tables.items():
            b = base.tables[name]
            changed, removed = diff_rows(b.ids_N, t.ids_N, _table_columns(b), _table_columns(t))
            tensors = {"ids": t.ids_N[changed].contiguous(), "removed_ids": removed.contiguous(),
                       **{k: v[changed].contiguous() for k, v in _table_columns(t).items()}}
            save_file(tensors, str(tmp / "tables" / f"{name}.safetensors"))
            counts[name] = {"changed_rows": int(changed.sum()), "removed_rows": int(removed.numel())}
        changed, removed = diff_rows(base.item_ids_N, new.item_ids_N, _index_columns(base), _index_columns(new))
        index = {"item_ids": new.item_ids_N[changed].contiguous(), "removed_ids": removed.contiguous(),
                 **{k: v[changed].contiguous() for k, v in _index_columns(new).items()}}
        save_file(index, str(tmp / ITEM_INDEX_FILE))
        counts["item_index"] = {"changed_rows": int(changed.sum()), "removed_rows": int(removed.numel())}
        shutil.copyfile(Path(new_dir) / DENSE_FILE, tmp / DENSE_FILE)
        files = {p.relative_to(tmp).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        artifact = {k: v for k, v in nm.items() if k != "files"}
        manifest = {"format": DELTA_FORMAT, "version": nm["version"], "base_version": bm["version"],
                    "base_fingerprint": content_fingerprint(bm), "fingerprint": content_fingerprint(nm),
                    "changes": counts, "artifact": artifact, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        publish_dir(tmp, out, manifest=MANIFEST, format=DELTA_FORMAT)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _overlay(old_ids: torch.Tensor, old_cols: dict, drop_ids: torch.Tensor, ids: torch.Tensor, cols: dict
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rows by id: the old rows whose ids `drop_ids` does not name, then the new rows
    (`ids`, `cols`), sorted by id."""
    _, dropped = sorted_positions(drop_ids.sort().values, old_ids)
    keep = ~dropped
    merged = torch.cat([old_ids[keep], ids])
    order = torch.argsort(merged)
    return merged[order], {k: torch.cat([old_cols[k][keep], v])[order] for k, v in cols.items()}


def _merge_patch(old: TablePatch | None, ids: torch.Tensor, cols: dict, removed: torch.Tensor) -> TablePatch:
    """A table's patch after one more delta: its rows, then the delta's (which win); a
    removed row is an entry that is not live."""
    add_ids = torch.cat([ids, removed])
    add = {k: torch.cat([v, v.new_zeros((removed.numel(), *v.shape[1:]))]) for k, v in cols.items()}
    add["live_N"] = torch.cat([torch.ones(ids.numel(), dtype=torch.bool), torch.zeros(removed.numel(), dtype=torch.bool)])
    if old is None:
        old_ids, old_cols = add_ids[:0], {k: v[:0] for k, v in add.items()}
    else:
        old_ids, old_cols = old.ids_N, {k: getattr(old, k) for k in add}
    merged_ids, merged = _overlay(old_ids, old_cols, add_ids, add_ids, add)
    return TablePatch(ids_N=merged_ids, **merged)


def _merge_index(c: ArtifactContents, delta: dict) -> dict[str, torch.Tensor]:
    """The item index after the delta: unchanged items, then changed and new ones, sorted."""
    cols = _index_columns(c)
    item_ids, merged = _overlay(c.item_ids_N, cols, torch.cat([delta["item_ids"], delta["removed_ids"]]),
                                delta["item_ids"], {k: delta[k] for k in cols})
    return {"item_ids": item_ids, **merged}


def read_delta(delta_dir: str | Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(manifest, tensors by file) of a verified delta directory."""
    from safetensors.torch import load_file

    root = Path(delta_dir)
    with unreplaced(root, "delta"):  # a delta exported over this one meanwhile would mix in
        path = root / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no delta manifest (is {delta_dir} a delta from "
                             "`genrec export --delta-since`?)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: manifest is not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != DELTA_FORMAT:
            raise ValueError(f"{path}: not a {DELTA_FORMAT} manifest")
        for key, kind in (("version", str), ("base_version", str), ("artifact", dict)):
            if not isinstance(manifest.get(key), kind):
                raise ValueError(f"{path}: delta manifest {key!r} must be a {kind.__name__}")
        verify_files(root, manifest)
        files = {}
        for rel in manifest["files"]:
            try:
                files[rel] = load_file(str(root / rel))
            except Exception as e:  # safetensors raises its own error type on malformed headers
                raise ValueError(f"delta file {rel}: not a readable safetensors file ({e})") from None
        return manifest, files


def apply_delta(contents: ArtifactContents, delta_dir: str | Path) -> ArtifactContents:
    """The contents of the artifact that `delta_dir` describes, built from `contents` (the
    serving base, left untouched) without reading the base tables."""
    manifest, files = read_delta(delta_dir)
    serving = contents.manifest
    if manifest["base_version"] != serving["version"]:
        raise DeltaConflict(f"delta {delta_dir} applies to version {manifest['base_version']!r}, but version "
                            f"{serving['version']!r} is serving")
    base_fp = manifest.get("base_fingerprint")
    if base_fp is not None and base_fp != content_fingerprint(serving):
        raise DeltaConflict(f"delta {delta_dir} applies to version {manifest['base_version']!r} with contents "
                            f"{base_fp}, but version {serving['version']!r} is serving other contents "
                            f"({content_fingerprint(serving)}): another model exported under the same name")
    if ann_manifest_entry(serving):
        raise ValueError(f"delta {delta_dir}: the serving artifact has an approximate retrieval index; reload a "
                         "full artifact instead")
    new = manifest["artifact"]
    differ = sorted(k for k in _comparable(serving) if new.get(k) != serving[k])
    if differ or set(new.get("tables", {})) != set(serving["tables"]):
        raise ValueError(f"delta {delta_dir}: its model differs from the serving one in {differ or ['tables']}; "
                         "a delta carries rows and weights only: reload a full artifact")
    tables = {}
    for name, base in contents.tables.items():
        rel = f"tables/{name}.safetensors"
        d = files.get(rel)
        if d is None or "ids" not in d or "removed_ids" not in d:
            raise ValueError(f"delta {delta_dir}: {rel} is missing, or lacks 'ids' or 'removed_ids'")
        check_table(f"delta file {rel}", d, base.dim, serving["dtype"])
        check_ids(f"delta file {rel}", "removed_ids", d["removed_ids"])
        cols = {"rows_ND": d["rows"], "scale_bias_N2": d.get("scale_bias")}
        cols = {k: v for k, v in cols.items() if v is not None}
        tables[name] = dataclasses.replace(base, patch=_merge_patch(base.patch, d["ids"], cols, d["removed_ids"]))
    if DENSE_FILE not in files:
        raise ValueError(f"delta {delta_dir}: {DENSE_FILE} is missing")
    d = files.get(ITEM_INDEX_FILE, {})
    if "item_ids" not in d or "removed_ids" not in d:
        raise ValueError(f"delta {delta_dir}: {ITEM_INDEX_FILE} is missing, or lacks 'item_ids' or 'removed_ids'")
    check_item_index(f"delta file {ITEM_INDEX_FILE}", d, serving, None)
    check_ids(f"delta file {ITEM_INDEX_FILE}", "removed_ids", d["removed_ids"])
    index = _merge_index(contents, d)
    new_manifest = dict(new, files=serving["files"])
    if manifest.get("fingerprint"):  # the next delta names these contents by the full artifact's fingerprint
        new_manifest["fingerprint"] = manifest["fingerprint"]
    return ArtifactContents(
        path=contents.path, manifest=new_manifest, dense_state=files[DENSE_FILE], tables=tables,
        item_ids_N=index["item_ids"], item_rows_ND=index["embeddings"], item_scale_N=index.get("scale"),
        item_side_features={k[len("feature."):]: v for k, v in index.items() if k.startswith("feature.")},
    )
