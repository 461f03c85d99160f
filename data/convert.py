"""Public datasets -> the canonical event log (see `schema.py`): parquet part-files plus
`convert_manifest.json`, published atomically (no output at all on bad input).

Sources and what each line becomes:

    movielens   u.data       "196\\t242\\t3\\t881250949"   -> user_id 196, item_id 242, action 6, ts 881250949
                ratings.dat  "1::185::4.5::838983525"    -> user_id 1, item_id 185, action 9, ts 838983525
                ratings.csv  "1,29,3.5,1112484676"       -> same columns (its header line is skipped)
                (ML-100K u.data; ML-1M / ML-10M ratings.dat; ML-20M / ML-25M ratings.csv; the
                format is picked per file from its first line). action = the rating in half
                stars (rating x 2: ML-10M and later rate in half stars, and one scale for every
                version keeps a threshold such as model.min_target_action meaning the same).
    sasrec-txt  "1 42"  (one interaction per line; SASRec / BERT4Rec files)
                -> user_id 1, item_id 42, action 1; order of lines = time order within a user
    s3rec-txt   "1 42 7 9"  (one user per line, items in time order; S3-Rec files)
                -> three events of user 1: items 42, 7, 9, action 1
    criteo      "label \\t I1..I13 \\t C1..C26"  (Kaggle DAC, TAB-separated, no header)
                -> one impression per row, see below

Ids: a token that is a base-10 integer in [0, 2**63) is kept as that int64; any other token
(a negative number too: negative ids are the sparse store's own) is hashed with
`schema.hash_string_id`. Interactions without a type (sasrec-txt, s3rec-txt) get
action 1 (a positive interaction, like a click).

Files without timestamps (sasrec-txt, s3rec-txt, criteo) get the event's position as its
time: `ts` = 0-based index of the event over all inputs in input order. Per user that is
the file's order, which is all these formats promise. The converter warns and records
`"timestamps": "position"` in the summary and manifest.

Criteo is anonymized and has no user or ad key. Mapping (overridable by arguments):
    user_id     one synthetic user per row (the row's position), unless `criteo_user_column`
                names a column whose value is the user key
    item_id     the value of `criteo_item_column` (default "C3", the categorical column with
                the most distinct values in the head sample)
    C1..C26     the 32-bit hex hash parsed to int64 (0..2**32-1); empty -> CRITEO_MISSING_ID (2**32),
                a row of its own that no hex value can take
    I1..I13     bucketized counts: empty -> 0; x <= 2 -> x + 3 (x clamped at -2, so 1..5);
                x > 2 -> 5 + floor(ln(x) ** 2) (>= 6; the Kaggle winners' transform)
    click       the label (int8); action = 1 for a clicked row, else 0
"""

from __future__ import annotations

import gzip
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from tqdm import tqdm

from genrec.data.files import claim_output_dir
from genrec.data.partwriter import PartWriter
from genrec.data.schema import ACTION_CLICK, ACTION_IMPRESSION, hash_string_id

MANIFEST_NAME = "convert_manifest.json"
SOURCES = ("movielens", "sasrec-txt", "s3rec-txt", "criteo")
CRITEO_INT_COLUMNS = [f"I{i}" for i in range(1, 14)]
CRITEO_CAT_COLUMNS = [f"C{i}" for i in range(1, 27)]
CRITEO_COLUMNS = ["label", *CRITEO_INT_COLUMNS, *CRITEO_CAT_COLUMNS]
CRITEO_MISSING_ID = 1 << 32
_INT64_MAX = (1 << 63) - 1
MOVIELENS_CSV_HEADER = "userId,movieId,rating,timestamp"
# Strict forms: int() and float() also take "1_000", "nan", "inf" and non-ASCII digits.
_MOVIELENS_RATING = re.compile(r"[0-9]+(\.[0-9]+)?")
_MOVIELENS_TS = re.compile(r"-?[0-9]+")


class PositionTimestampWarning(UserWarning):
    """The input has no timestamps; events got their position as `ts`."""


def convert(source: Literal["movielens", "sasrec-txt", "s3rec-txt", "criteo"], inputs: list[str],
            out_dir: str | os.PathLike, *, overwrite: bool = False, events_per_file: int = 1_000_000,
            criteo_user_column: str | None = None, criteo_item_column: str = "C3",
            progress: bool = True) -> dict:
    """Convert `inputs` (read in the given order; `.gz` is read transparently) of format
    `source` into an event log at `out_dir`. Returns the manifest (counts, columns, files,
    `timestamps`: "input" or "position", warnings) plus `out_dir`.

    Raises ValueError naming the file (and line, for malformed lines) on a missing or empty
    input, a malformed line, an unknown source, or a non-empty `out_dir` without `overwrite`.
    """
    if source not in SOURCES:
        raise ValueError(f"convert: unknown source {source!r}; expected one of {', '.join(SOURCES)}")
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("convert: no input files given")
    if events_per_file <= 0:
        raise ValueError(f"convert: events_per_file must be positive, got {events_per_file}")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise ValueError(f"convert: input file {path} does not exist (or is not a file)")
        if path.stat().st_size == 0:
            raise ValueError(f"convert: input file {path} is empty")
    # Every input is read, so one file given twice would hold each of its events twice
    # (prepare reads a file named twice once).
    seen: dict[Path, Path] = {}
    for path in paths:
        first = seen.setdefault(path.resolve(), path)
        if first is not path:
            raise ValueError(f"convert: input file {path} is given twice (also as {first}): its events would be read twice")
    if source == "criteo":
        for name, col in (("criteo_user_column", criteo_user_column), ("criteo_item_column", criteo_item_column)):
            if col is not None and col not in CRITEO_COLUMNS[1:]:
                raise ValueError(f"convert: {name}={col!r} is not a Criteo feature column (I1..I13, C1..C26)")
    claim_output_dir(out_dir, overwrite=overwrite, manifest=MANIFEST_NAME)

    with PartWriter(out_dir, manifest_name=MANIFEST_NAME, overwrite=overwrite) as writer:
        sink = _Sink(writer, events_per_file, progress, desc=f"convert {source}")
        if source == "criteo":
            _convert_criteo(paths, sink, criteo_user_column, criteo_item_column)
        else:
            parse = {"movielens": _parse_movielens, "sasrec-txt": _parse_sasrec, "s3rec-txt": _parse_s3rec}[source]
            for path in paths:
                before = sink.num_events
                for columns in _batched(parse(path), events_per_file):
                    if source != "movielens":
                        columns["ts"] = np.arange(sink.num_events, sink.num_events + columns["ts"].size, dtype=np.int64)
                    sink.add(columns)
                if sink.num_events == before:
                    raise ValueError(f"convert: input file {path} has no events (only blank lines)")
        sink.close()
        timestamps = "input" if source == "movielens" else "position"
        notes = []
        if timestamps == "position":
            notes.append(f"{source} inputs carry no timestamps: ts is the event's 0-based position over all inputs")
            warnings.warn(notes[-1], PositionTimestampWarning, stacklevel=2)
        manifest = {
            "kind": "genrec-convert",
            "source": source,
            "inputs": [str(p.resolve()) for p in paths],
            "num_events": sink.num_events,
            "num_users": sink.num_users,
            "num_items": sink.num_items,
            "columns": sink.columns,
            "timestamps": timestamps,
            "warnings": notes,
        }
        if source == "movielens":
            manifest["movielens"] = {"action": "rating x 2 (half stars: 3.5 -> 7)"}
        if source == "criteo":
            manifest["criteo"] = {"user_key": criteo_user_column or "row position",
                                  "item_key": criteo_item_column, "missing_categorical_id": CRITEO_MISSING_ID,
                                  "ctr": sink.num_clicks / max(sink.num_events, 1)}
        writer.commit(manifest)
        manifest = {**manifest, "files": list(writer.files), "complete": True}
    return {**manifest, "out_dir": str(out_dir)}


class _Sink:
    """Buffers converted columns and writes a part-file per `events_per_file` events;
    counts distinct users and items as it goes."""

    def __init__(self, writer: PartWriter, events_per_file: int, progress: bool, desc: str) -> None:
        self.writer = writer
        self.events_per_file = events_per_file
        self.buffer: list[dict[str, np.ndarray]] = []
        self.buffered = 0
        self.num_events = 0
        self.num_clicks = 0
        self.columns: list[str] = []
        self._users = np.empty(0, np.int64)
        self._items = np.empty(0, np.int64)
        self.bar = tqdm(unit="ev", unit_scale=True, desc=desc, file=sys.stderr, disable=not progress, mininterval=1.0)

    @property
    def num_users(self) -> int:
        return int(self._users.size)

    @property
    def num_items(self) -> int:
        return int(self._items.size)

    def add(self, columns: dict[str, np.ndarray]) -> None:
        n = columns["ts"].size
        self.buffer.append(columns)
        self.buffered += n
        self.num_events += n
        if "click" in columns:
            self.num_clicks += int(columns["click"].sum())
        self._users = _merge_distinct(self._users, columns["user_id"])
        self._items = _merge_distinct(self._items, columns["item_id"])
        self.bar.update(n)
        while self.buffered >= self.events_per_file:
            self._flush(self.events_per_file)

    def _flush(self, num_rows: int) -> None:
        merged = {k: np.concatenate([b[k] for b in self.buffer]) for k in self.buffer[0]}
        head = {k: v[:num_rows] for k, v in merged.items()}
        rest = {k: v[num_rows:] for k, v in merged.items()}
        order = ["user_id", "ts", "item_id", "action"]
        names = order + [k for k in head if k not in order]
        table = pa.table({k: head[k] for k in names})
        self.columns = names
        self.writer.write(table)
        self.buffer = [rest] if rest["ts"].size else []
        self.buffered = int(rest["ts"].size)

    def close(self) -> None:
        if self.buffered:
            self._flush(self.buffered)
        self.bar.close()


def _distinct_sorted(values: np.ndarray) -> np.ndarray:
    # Sort-based: numpy's hash-based np.unique is several times slower on large int64 arrays.
    values = np.sort(values)
    return values[np.r_[True, values[1:] != values[:-1]]] if values.size else values


def _merge_distinct(distinct: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sorted distinct union of a sorted distinct array and new values."""
    merged = np.concatenate([distinct, _distinct_sorted(values)])
    merged.sort(kind="stable")  # two sorted runs: a linear merge in timsort
    return merged[np.r_[True, merged[1:] != merged[:-1]]] if merged.size else merged


def _open_text(path: Path):
    # utf-8-sig: a byte-order mark is not part of the first line's first id.
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="strict", newline=None)
    return open(path, "r", encoding="utf-8-sig", errors="strict", newline=None)


def _lines(path: Path, *, strip: bool = True) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of non-empty lines, stripped (`strip`: blank lines are
    skipped) or only without their line end (a line of blanks is kept); undecodable text or
    an unreadable file names the file."""
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, 1):
                line = line.strip() if strip else line.rstrip("\r\n")
                if line:
                    yield number, line
    except UnicodeDecodeError as e:
        raise ValueError(f"convert: input file {path} is not UTF-8 text ({e})") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"convert: cannot read input file {path}: {e}") from None


def _id(token: str) -> int:
    """A base-10 token in [0, 2**63) stays itself; anything else ("-3", "1e5", "--5") is a
    string id and is hashed, which never gives a negative id."""
    if token.isascii() and token.isdigit():
        value = int(token)
        if value <= _INT64_MAX:
            return value
    return hash_string_id(token)


def _malformed(path: Path, number: int, line: str, why: str) -> ValueError:
    shown = line if len(line) <= 80 else line[:77] + "..."
    return ValueError(f"convert: malformed line {number} in {path}: {why}: {shown!r}")


Row = tuple[int, int, int, int]  # user_id, item_id, action, ts (-1: no timestamp, set to the position)


def _parse_movielens(path: Path) -> Iterator[Row]:
    sep = None
    for number, line in _lines(path):
        if sep is None:
            if line == MOVIELENS_CSV_HEADER:
                sep = ","
                continue
            sep = "::" if "::" in line else "," if "," in line else "\t"
        fields = line.split() if sep == "\t" else line.split(sep)
        if len(fields) != 4:
            raise _malformed(path, number, line, f"expected 4 fields (user item rating ts) separated by {sep!r}, got {len(fields)}")
        rating, ts = fields[2], fields[3]
        if not (_MOVIELENS_RATING.fullmatch(rating) and _MOVIELENS_TS.fullmatch(ts)):
            raise _malformed(path, number, line, "rating must be a number of stars (3, 3.5) and timestamp an integer")
        half_stars = float(rating) * 2
        if not half_stars.is_integer():
            raise _malformed(path, number, line, f"rating {rating} is not a whole or half star")
        if not (half_stars <= _INT64_MAX and -_INT64_MAX - 1 <= int(ts) <= _INT64_MAX):
            raise _malformed(path, number, line, "rating and timestamp must fit int64")
        yield _id(fields[0]), _id(fields[1]), int(half_stars), int(ts)


def _parse_sasrec(path: Path) -> Iterator[Row]:
    for number, line in _lines(path):
        fields = line.split()
        if len(fields) != 2:
            raise _malformed(path, number, line, f"expected 2 fields (user item), got {len(fields)}")
        yield _id(fields[0]), _id(fields[1]), ACTION_CLICK, -1


def _parse_s3rec(path: Path) -> Iterator[Row]:
    for number, line in _lines(path):
        fields = line.split()
        if len(fields) < 2:
            raise _malformed(path, number, line, "expected a user followed by at least one item")
        user = _id(fields[0])
        for token in fields[1:]:
            yield user, _id(token), ACTION_CLICK, -1


def _batched(rows: Iterator[Row], size: int) -> Iterator[dict[str, np.ndarray]]:
    buf: list[Row] = []
    for row in rows:
        buf.append(row)
        if len(buf) >= size:
            yield _columns(buf)
            buf = []
    if buf:
        yield _columns(buf)


def _columns(rows: list[Row]) -> dict[str, np.ndarray]:
    arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return {"user_id": arr[:, 0], "item_id": arr[:, 1], "action": arr[:, 2], "ts": arr[:, 3]}


# ----------------------------------------------------------------------------- Criteo

def _hex8_to_int64(values: pa.Array) -> np.ndarray | None:
    """8-digit hex strings -> int64, null -> CRITEO_MISSING_ID; None if any value is not 8 hex digits."""
    n = len(values)
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    filled = pc.fill_null(values, "00000000")
    if n and not (pc.binary_length(filled).to_numpy() == 8).all():
        return None
    # All values are 8 bytes, so the data buffer is a dense [n, 8] byte matrix.
    offsets = np.frombuffer(filled.buffers()[1], np.int32, n + 1, offset=filled.offset * 4)
    data = np.frombuffer(filled.buffers()[2], np.uint8)[offsets[0]: offsets[0] + 8 * n].reshape(n, 8)
    # Elementwise uint8 arithmetic (a 256-entry lookup table gathers several times slower):
    # `| 0x20` lower-cases A-F (only A-F and a-f land in a-f); uint8 wrap-around makes each
    # range test one compare.
    is_digit = (data - np.uint8(48)) <= 9
    lower = data | np.uint8(0x20)
    if not (is_digit | ((lower - np.uint8(97)) <= 5)).all():
        return None
    digits = np.where(is_digit, data - np.uint8(48), lower - np.uint8(87))
    # Pack digit pairs into bytes and read each row's 4 bytes as one big-endian uint32.
    packed = np.ascontiguousarray((digits[:, 0::2] << 4) | digits[:, 1::2])
    out = packed.view(">u4").reshape(n).astype(np.int64)
    return np.where(valid, out, CRITEO_MISSING_ID)


def _bucketize(values: pa.Array) -> np.ndarray:
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    x = pc.fill_null(values, 0).to_numpy().astype(np.int64)
    small = np.maximum(x, -2) + 3
    with np.errstate(divide="ignore", invalid="ignore"):
        large = 5 + np.floor(np.log(np.maximum(x, 3).astype(np.float64)) ** 2).astype(np.int64)
    return np.where(~valid, 0, np.where(x <= 2, small, large))


def _criteo_line_error(path: Path) -> ValueError:
    """Slow path after the fast reader failed: find the first bad line and say why."""
    # Every line: a line of blanks is one the fast reader failed on.
    for number, raw in _lines(path, strip=False):
        fields = raw.split("\t")
        if len(fields) != 40:
            return _malformed(path, number, raw, f"expected 40 TAB-separated fields (label, I1..I13, C1..C26), got {len(fields)}")
        if fields[0] not in ("0", "1"):
            return _malformed(path, number, raw, f"label must be 0 or 1, got {fields[0]!r}")
        for name, value in zip(CRITEO_INT_COLUMNS, fields[1:14]):
            if value and not (value.lstrip("-").isdigit() and -_INT64_MAX - 1 <= int(value) <= _INT64_MAX):
                return _malformed(path, number, raw, f"{name} must be an int64 integer or empty, got {value!r}")
        for name, value in zip(CRITEO_CAT_COLUMNS, fields[14:]):
            if value and (len(value) != 8 or any(ch not in "0123456789abcdefABCDEF" for ch in value)):
                return _malformed(path, number, raw, f"{name} must be 8 hex digits or empty, got {value!r}")
    return ValueError(f"convert: cannot parse Criteo file {path} (no single bad line found)")


def _criteo_batches(path: Path) -> Iterator[pa.RecordBatch]:
    types = {"label": pa.int64(), **{c: pa.int64() for c in CRITEO_INT_COLUMNS},
             **{c: pa.string() for c in CRITEO_CAT_COLUMNS}}
    try:
        reader = pacsv.open_csv(
            pa.input_stream(str(path), compression="detect"),
            read_options=pacsv.ReadOptions(column_names=CRITEO_COLUMNS, block_size=16 << 20),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=True),
        )
        yield from reader
    except (pa.ArrowInvalid, UnicodeDecodeError):
        raise _criteo_line_error(path) from None
    except (OSError, EOFError) as e:  # a corrupt or truncated compressed file
        raise ValueError(f"convert: cannot read input file {path}: {e}") from None


def _convert_criteo(paths: list[Path], sink: _Sink, user_column: str | None, item_column: str) -> None:
    for path in paths:
        before = sink.num_events
        for batch in _criteo_batches(path):
            n = batch.num_rows
            if n == 0:
                continue
            label = batch.column("label")
            if label.null_count or not pc.all(pc.is_in(label, pa.array([0, 1]))).as_py():
                raise _criteo_line_error(path)
            features: dict[str, np.ndarray] = {}
            for name in CRITEO_INT_COLUMNS:
                features[name] = _bucketize(batch.column(name))
            for name in CRITEO_CAT_COLUMNS:
                parsed = _hex8_to_int64(batch.column(name))
                if parsed is None:
                    raise _criteo_line_error(path)
                features[name] = parsed
            position = np.arange(sink.num_events, sink.num_events + n, dtype=np.int64)
            click = label.to_numpy().astype(np.int8)
            sink.add({
                "user_id": features[user_column] if user_column else position,
                "ts": position,
                "item_id": features[item_column],
                "action": np.where(click == 1, ACTION_CLICK, ACTION_IMPRESSION).astype(np.int64),
                **{k: v for k, v in features.items()},
                "click": click,
            })
        if sink.num_events == before:
            raise ValueError(f"convert: input file {path} has no rows")
