"""Atomic output of an event log: numbered parquet part-files published with one rename.

    with PartWriter("logs/ml100k", manifest_name="convert_manifest.json") as writer:
        writer.write(table)              # -> <staging>/part-00000.parquet
        writer.write(table2)             # -> <staging>/part-00001.parquet
        writer.commit({"num_events": 7}) # manifest written last, then staging -> logs/ml100k

Readers either see no output folder or a complete one (parts plus a manifest with
`"complete": true`). An exception inside the `with` block removes the staging folder,
so bad input never leaves partial output behind.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def check_output_dir(out_dir: str | os.PathLike, *, overwrite: bool) -> Path:
    """Validate `out_dir` before any work starts: it must be absent, an empty folder, or
    (with `overwrite`) a folder to replace."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"output path {out} exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise ValueError(f"output directory {out} exists and is not empty (pass overwrite=True to replace it)")
    return out


class PartWriter:
    """Writes `part-NNNNN.parquet` files into a hidden staging folder beside `out_dir` and
    renames the folder into place on `commit`."""

    def __init__(self, out_dir: str | os.PathLike, *, manifest_name: str, overwrite: bool = False,
                 compression: str = "zstd") -> None:
        self.out_dir = check_output_dir(out_dir, overwrite=overwrite)
        self.manifest_name = manifest_name
        self.overwrite = overwrite
        self.compression = compression
        self.files: list[str] = []
        self.num_rows = 0
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        # Staging beside the target (same filesystem) so the final rename is atomic.
        self.staging = self.out_dir.parent / f".{self.out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.staging.mkdir()
        self._done = False

    def write(self, table: pa.Table) -> str:
        name = f"part-{len(self.files):05d}.parquet"
        pq.write_table(table, self.staging / name, compression=self.compression)
        self.files.append(name)
        self.num_rows += table.num_rows
        return name

    def commit(self, manifest: dict) -> Path:
        manifest = {**manifest, "files": list(self.files), "complete": True}
        with open(self.staging / self.manifest_name, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.write("\n")
        out = self.out_dir
        old = None
        if out.exists():
            if any(out.iterdir()):
                # Re-checked here: the folder may have been filled while we were writing.
                if not self.overwrite:
                    raise ValueError(f"output directory {out} appeared and is not empty; refusing to replace it")
                old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.rename(out, old)
            else:
                out.rmdir()
        os.rename(self.staging, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._done = True
        return out

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._done = True

    def __enter__(self) -> "PartWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Without a commit the output never becomes visible, error or not.
        self.abort()
