"""`prepare`'s event-log inputs: which files a path, directory or glob names, and whether
each one can be read as the feature spec says, checked from the parquet footers before
anything is written.

    paths = resolve_paths("runs/logs/*.parquet")      # files only, sorted, each once
    logs = [open_log(p, features) for p in paths]     # ValueError naming file and column
    check_consistent_types(logs)                      # an id column is a string everywhere or nowhere
    for rg, batches in row_groups(logs[0], ["user_id", "ts", "item_id"], batch_rows=1 << 17):
        ...
"""

from __future__ import annotations

import glob as globlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from genrec.data.config import FeatureSpec


@dataclass
class EventLog:
    path: Path
    num_rows: int
    num_row_groups: int
    is_string: dict[str, bool]
    """Per read column: string ids (hashed) or integers (passed through)."""


def resolve_paths(spec) -> list[Path]:
    """The parquet files that `spec` (a file, a directory (its *.parquet), a glob, or a
    list of those) names, sorted and each once."""
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    if not items:
        raise ValueError("no event-log paths given")
    out: list[Path] = []
    for item in items:
        s = str(item)
        if any(ch in s for ch in "*?["):
            matched = sorted(globlib.glob(s, recursive=True))
            if not matched:
                raise ValueError(f"{s}: glob matches no files")
            files = [Path(m) for m in matched if Path(m).is_file()]
            if not files:
                raise ValueError(f"{s}: glob matches no files (only directories)")
            out.extend(files)
        elif Path(s).is_dir():
            matched = sorted(Path(s).glob("*.parquet"))
            if not matched:
                raise ValueError(f"{s}: directory holds no *.parquet files")
            out.extend(matched)
        elif Path(s).is_file():
            out.append(Path(s))
        else:
            raise ValueError(f"{s}: no such file")
    return sorted({p.resolve() for p in out})  # one file under two spellings is read once


def open_log(path: Path, features: FeatureSpec) -> EventLog:
    """Footer checks of one log: readable, not empty, every column of `features` present
    once and of a usable type."""
    try:
        # Footer only; the file is reopened in pass 1 (thousands of logs must not pin
        # thousands of descriptors next to the spill files).
        with pq.ParquetFile(path) as file:
            schema, metadata = file.schema_arrow, file.metadata
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file (corrupt or truncated?): {e}") from None
    if metadata.num_rows == 0:
        raise ValueError(f"{path}: empty file (0 rows)")
    # A repeated name has no field index (-1), which would read as a missing column.
    repeated = sorted(name for name, n in Counter(schema.names).items() if n > 1)
    is_string = {}
    for name, role in _column_roles(features):
        if name in repeated:
            raise ValueError(f"{path}: column {name!r} ({role}) appears {schema.names.count(name)} times; "
                             f"columns are {schema.names}")
        idx = schema.get_field_index(name)
        if idx < 0:
            raise ValueError(f"{path}: missing column {name!r} ({role}); columns are {schema.names}")
        typ = schema.field(idx).type
        if pa.types.is_dictionary(typ):  # pandas categoricals: judged (and read) by their values
            typ = typ.value_type
        is_str = pa.types.is_string(typ) or pa.types.is_large_string(typ)
        if role == "timestamp":
            ok = pa.types.is_integer(typ)
            want = "integer unix seconds"
        elif role == "label":
            ok = pa.types.is_integer(typ) or pa.types.is_boolean(typ)
            want = "0/1 integer or bool"
        else:
            ok = pa.types.is_integer(typ) or is_str
            want = "integer or string ids"
        if not ok:
            raise ValueError(f"{path}: column {name!r} ({role}) has type {typ}, expected {want}")
        is_string[name] = is_str
    return EventLog(path=path, num_rows=metadata.num_rows, num_row_groups=metadata.num_row_groups,
                    is_string=is_string)


def _column_roles(features: FeatureSpec) -> list[tuple[str, str]]:
    roles = [(features.user_key, "user key"), (features.timestamp, "timestamp")]
    roles += [(s, "item" if s == features.item else "sparse feature") for s in features.sparse]
    roles += [(lab, "label") for lab in features.labels]
    return roles


def check_consistent_types(logs: list[EventLog]) -> None:
    # An id column that is a string in one file and an integer in another would hash the
    # same entity to two different ids.
    first = logs[0]
    for log in logs[1:]:
        for name, is_str in log.is_string.items():
            if is_str != first.is_string[name]:
                kinds = {True: "string", False: "integer"}
                raise ValueError(
                    f"{log.path}: column {name!r} holds {kinds[is_str]} ids but "
                    f"{first.path} holds {kinds[first.is_string[name]]} ids"
                )


def row_groups(log: EventLog, columns: list[str], batch_rows: int):
    """(row group index, its record batches) of one log; read errors name file and row group."""
    try:
        with pq.ParquetFile(log.path) as file:
            for rg in range(log.num_row_groups):
                try:
                    batches = list(file.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=columns))
                except (pa.ArrowException, OSError) as e:
                    raise ValueError(f"{log.path}: row group {rg} unreadable (corrupt or truncated?): {e}") from None
                yield rg, batches
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{log.path}: not a readable parquet file (changed since validation?): {e}") from None
