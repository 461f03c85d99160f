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
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from genrec.data.files import claim_output_dir, publish_dir, staging_dir


class PartWriter:
    """Writes `part-NNNNN.parquet` files into a hidden staging folder beside `out_dir` and
    renames the folder into place on `commit`."""

    def __init__(self, out_dir: str | os.PathLike, *, manifest_name: str, overwrite: bool = False,
                 compression: str = "zstd") -> None:
        self.out_dir = claim_output_dir(out_dir, overwrite=overwrite, manifest=manifest_name)
        self.manifest_name = manifest_name
        self.compression = compression
        self.files: list[str] = []
        self.num_rows = 0
        self.staging = staging_dir(self.out_dir)
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
            f.flush()
            os.fsync(f.fileno())
        out = publish_dir(self.staging, self.out_dir, manifest=self.manifest_name)
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
