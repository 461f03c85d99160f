"""Converters into the event-log schema, on the real public files and on small written ones."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.data.convert import CRITEO_MISSING_ID, MANIFEST_NAME, PositionTimestampWarning, convert
from genrec.data.schema import hash_string_id

DATA = Path("/work/shared/data")
ML100K = DATA / "ml-100k" / "u.data"
BEAUTY = DATA / "amazon-beauty" / "Beauty.txt"
CRITEO = DATA / "criteo-head" / "train.csv"


def _read(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))


def _nunique(t: pa.Table, name: str) -> int:
    return int(np.unique(t.column(name).to_numpy()).size)


def _assert_clean(tmp_path: Path, expected: list[str]) -> None:
    """Nothing but `expected` beside the output: no staging folder, no partial output."""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)


@pytest.mark.skipif(not ML100K.exists(), reason="shared MovieLens-100K missing")
def test_movielens_100k_counts_and_values(tmp_path):
    summary = convert("movielens", [str(ML100K)], tmp_path / "ml", events_per_file=30_000, progress=False)
    t = _read(tmp_path / "ml")
    assert (summary["num_events"], summary["num_users"], summary["num_items"]) == (100_000, 943, 1682)
    assert (t.num_rows, _nunique(t, "user_id"), _nunique(t, "item_id")) == (100_000, 943, 1682)
    assert t.column_names[:4] == ["user_id", "ts", "item_id", "action"]
    assert all(t.schema.field(c).type == pa.int64() for c in t.column_names)
    assert summary["timestamps"] == "input" and summary["warnings"] == []
    assert len(summary["files"]) == 4  # 30k + 30k + 30k + 10k
    ts = t.column("ts").to_numpy()
    assert (ts.min(), ts.max()) == (874724710, 893286638)
    assert set(np.unique(t.column("action").to_numpy())) == {2, 4, 6, 8, 10}  # half stars
    # Row order is the file's: the first line of u.data is "196 242 3 881250949".
    assert t.slice(0, 1).to_pylist()[0] == {"user_id": 196, "ts": 881250949, "item_id": 242, "action": 6}
    manifest = json.loads((tmp_path / "ml" / MANIFEST_NAME).read_text())
    assert manifest["complete"] and manifest["num_events"] == 100_000


def test_movielens_ratings_dat_and_gzip(tmp_path):
    text = "1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n"
    (tmp_path / "ratings.dat").write_text(text)
    with gzip.open(tmp_path / "ratings.dat.gz", "wt") as f:
        f.write(text)
    a = convert("movielens", [tmp_path / "ratings.dat"], tmp_path / "a", progress=False)
    b = convert("movielens", [str(tmp_path / "ratings.dat.gz")], tmp_path / "b", progress=False)
    assert a["num_events"] == b["num_events"] == 3 and a["num_users"] == 2 and a["num_items"] == 2
    ta, tb = _read(tmp_path / "a"), _read(tmp_path / "b")
    assert ta.equals(tb)
    assert ta.column("action").to_pylist() == [10, 6, 8]
    assert ta.column("ts").to_pylist() == [978300760, 978302109, 978298413]


def test_movielens_10m_and_20m_half_star_ratings(tmp_path):
    # ML-10M: ratings.dat with "::" and half stars; ML-20M / 25M: ratings.csv with a header.
    dat = _write(tmp_path / "ratings.dat", "1::122::5::838985046\n1::185::4.5::838983525\n2::122::0.5::838984000\n")
    csv = _write(tmp_path / "ratings.csv", "userId,movieId,rating,timestamp\n1,2,3.5,1112486027\n"
                                           "1,29,3.5,1112484676\n2,2,4.0,1112484819\n")
    a = convert("movielens", [dat], tmp_path / "a", progress=False)
    b = convert("movielens", [csv], tmp_path / "b", progress=False)
    ta, tb = _read(tmp_path / "a"), _read(tmp_path / "b")
    assert ta.column("action").to_pylist() == [10, 9, 1]
    assert tb.to_pylist() == [{"user_id": 1, "ts": 1112486027, "item_id": 2, "action": 7},
                              {"user_id": 1, "ts": 1112484676, "item_id": 29, "action": 7},
                              {"user_id": 2, "ts": 1112484819, "item_id": 2, "action": 8}]
    assert a["movielens"]["action"].startswith("rating x 2") and (a["num_events"], b["num_events"]) == (3, 3)


@pytest.mark.skipif(not BEAUTY.exists(), reason="shared Amazon Beauty missing")
def test_beauty_s3rec_counts_and_order(tmp_path):
    with pytest.warns(PositionTimestampWarning):
        summary = convert("s3rec-txt", [BEAUTY], tmp_path / "beauty", progress=False)
    t = _read(tmp_path / "beauty")
    assert (summary["num_events"], summary["num_users"], summary["num_items"]) == (198_502, 22_363, 12_101)
    assert (t.num_rows, _nunique(t, "user_id"), _nunique(t, "item_id")) == (198_502, 22_363, 12_101)
    assert summary["timestamps"] == "position" and summary["warnings"]
    np.testing.assert_array_equal(t.column("ts").to_numpy(), np.arange(198_502))
    # Line 2 of Beauty.txt is "2 6 7 8 9 10 4 11": its events keep that order.
    user2 = t.filter(pa.compute.equal(t.column("user_id"), 2))
    assert user2.column("item_id").to_pylist() == [6, 7, 8, 9, 10, 4, 11]
    assert (np.diff(user2.column("ts").to_numpy()) > 0).all()
    assert set(t.column("action").to_pylist()) == {1}


def test_sasrec_per_line_format_two_files_and_string_ids(tmp_path):
    (tmp_path / "a.txt").write_text("1 10\n2 20\n1 11\n\n1 12\n")
    (tmp_path / "b.txt").write_text("2 21\nalice B000X\n")
    with pytest.warns(PositionTimestampWarning):
        summary = convert("sasrec-txt", [tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out", progress=False)
    assert (summary["num_events"], summary["num_users"], summary["num_items"]) == (6, 3, 6)
    t = _read(tmp_path / "out")
    rows = t.to_pylist()
    assert [(r["user_id"], r["item_id"], r["ts"]) for r in rows[:5]] == [
        (1, 10, 0), (2, 20, 1), (1, 11, 2), (1, 12, 3), (2, 21, 4)]
    # Positions run on across input files; non-integer tokens are hashed like schema strings.
    assert (rows[5]["user_id"], rows[5]["item_id"], rows[5]["ts"]) == (
        hash_string_id("alice"), hash_string_id("B000X"), 5)


@pytest.mark.skipif(not CRITEO.exists(), reason="shared Criteo head missing")
def test_criteo_head(tmp_path):
    with pytest.warns(PositionTimestampWarning):
        summary = convert("criteo", [CRITEO], tmp_path / "c", progress=False)
    t = _read(tmp_path / "c")
    assert summary["num_events"] == t.num_rows == 7_200
    assert summary["num_users"] == 7_200  # one synthetic user per row by default
    click = t.column("click").to_numpy()
    assert t.schema.field("click").type == pa.int8()
    assert click.mean() == pytest.approx(0.2151, abs=1e-3) == summary["criteo"]["ctr"]
    np.testing.assert_array_equal(t.column("action").to_numpy(), click)
    np.testing.assert_array_equal(t.column("item_id").to_numpy(), t.column("C3").to_numpy())
    assert summary["num_items"] == _nunique(t, "C3")
    # First line: "0 1 1 5 0 1382 4 15 2 181 1 2 <empty> 2 68fd1e64 80e26c9b fb936136 ..."
    row = t.slice(0, 1).to_pylist()[0]
    assert row["C1"] == 0x68FD1E64 and row["C2"] == 0x80E26C9B and row["C3"] == 0xFB936136
    assert row["I1"] == 1 + 3 and row["I4"] == 0 + 3
    assert row["I5"] == 5 + math.floor(math.log(1382) ** 2)
    assert row["I12"] == 0  # empty count -> the missing bucket
    assert row["C22"] == CRITEO_MISSING_ID  # empty categorical (the 22nd C field of line 1)
    cats = np.stack([t.column(f"C{i}").to_numpy() for i in range(1, 27)])
    assert cats.min() >= 0 and cats.max() <= CRITEO_MISSING_ID


def test_criteo_declared_user_column(tmp_path):
    line = "1\t" + "\t".join(["3"] * 13) + "\t" + "\t".join(["0000000a"] * 26)
    line2 = "0\t" + "\t".join([""] * 13) + "\t" + "\t".join(["0000000b"] * 25 + [""])
    (tmp_path / "c.tsv").write_text(f"{line}\n{line2}\n{line}\n")
    with pytest.warns(PositionTimestampWarning):
        s = convert("criteo", [tmp_path / "c.tsv"], tmp_path / "o", criteo_user_column="C1",
                    criteo_item_column="C26", progress=False)
    t = _read(tmp_path / "o")
    assert s["num_users"] == 2 and t.column("user_id").to_pylist() == [10, 11, 10]
    assert t.column("item_id").to_pylist() == [10, CRITEO_MISSING_ID, 10]
    assert t.column("I1").to_pylist() == [6, 0, 6]  # 3 -> 5 + floor(ln(3)^2) = 6


# ----------------------------------------------------------------------------- bad input


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("source, text, match", [
    ("movielens", "1\t2\t3\t4\n5\t6\t7\n", r"malformed line 2 in .*bad\.txt.*expected 4 fields"),
    ("movielens", "1::2::3::4\n1::2::x::4\n", r"malformed line 2 .*number of stars"),
    ("movielens", "1\t2\t3.25\t4\n", r"malformed line 1 .*3\.25 is not a whole or half star"),
    ("movielens", "1,2,nan,4\n", r"malformed line 1 .*number of stars"),
    ("movielens", "1,2,3,1_000\n", r"malformed line 1 .*timestamp an integer"),
    ("movielens", "userId,movieId,rating,timestamp\n1,2,3\n", r"malformed line 2 .*separated by ','"),
    ("movielens", "1\t2\t3\t4\n1\t2\t3\t9223372036854775808\n", r"malformed line 2 .*fit int64"),
    ("sasrec-txt", "1 2\n1 2 3\n", r"malformed line 2 in .*bad\.txt.*expected 2 fields"),
    ("s3rec-txt", "1 2 3\n\n7\n", r"malformed line 3 in .*bad\.txt.*at least one item"),
    ("criteo", "1\t2\n", r"malformed line 1 in .*bad\.txt.*40 TAB-separated fields"),
])
def test_malformed_line_names_file_and_line(tmp_path, source, text, match):
    bad = _write(tmp_path / "bad.txt", text)
    with pytest.raises(ValueError, match=match):
        convert(source, [bad], tmp_path / "out", progress=False)
    _assert_clean(tmp_path, ["bad.txt"])


def _criteo_line(label: str = "0", ints: str = "1", cat: str = "deadbeef") -> str:
    return "\t".join([label] + [ints] * 13 + [cat] * 26)


@pytest.mark.parametrize("bad_line, match", [
    (_criteo_line(label="2"), "label must be 0 or 1"),
    (_criteo_line(ints="x"), "I1 must be an int64 integer"),
    (_criteo_line(ints="-9223372036854775809"), "I1 must be an int64 integer"),
    (_criteo_line(cat="xyz12345"), "C1 must be 8 hex digits"),
    (_criteo_line(cat="abc"), "C1 must be 8 hex digits"),
])
def test_criteo_bad_values_name_the_line(tmp_path, bad_line, match):
    bad = _write(tmp_path / "bad.tsv", "\n".join([_criteo_line(), _criteo_line(), bad_line, _criteo_line()]) + "\n")
    with pytest.raises(ValueError, match=rf"malformed line 3 in .*bad\.tsv.*{match}"):
        convert("criteo", [bad], tmp_path / "out", progress=False)
    _assert_clean(tmp_path, ["bad.tsv"])


def test_missing_and_empty_inputs(tmp_path):
    good = _write(tmp_path / "good.txt", "1 2\n")
    empty = _write(tmp_path / "empty.txt", "")
    blank = _write(tmp_path / "blank.txt", "\n  \n")
    with pytest.raises(ValueError, match=r"nope\.txt does not exist"):
        convert("sasrec-txt", [good, tmp_path / "nope.txt"], tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        convert("movielens", [empty], tmp_path / "out", progress=False)
    # A bad second file leaves no output even though the first one converted.
    with pytest.raises(ValueError, match=r"blank\.txt has no events"):
        convert("sasrec-txt", [good, blank], tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match=r"good\.txt is given twice \(also as .*good\.txt\)"):
        convert("sasrec-txt", [good, tmp_path / "." / "good.txt"], tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="no input files"):
        convert("sasrec-txt", [], tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="unknown source 'parquet'"):
        convert("parquet", [good], tmp_path / "out", progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="criteo_item_column='C99'"):
        convert("criteo", [good], tmp_path / "out", criteo_item_column="C99", progress=False)
    _assert_clean(tmp_path, ["good.txt", "empty.txt", "blank.txt"])


def test_existing_output_dir(tmp_path):
    good = _write(tmp_path / "good.txt", "1 2\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.parquet").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        convert("sasrec-txt", [good], out, progress=False)
    # --overwrite never deletes a folder genrec did not write: the foreign file survives.
    with pytest.raises(ValueError, match=f"refusing to replace {out}"):
        convert("sasrec-txt", [good], out, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["old.parquet"]
    (out / "old.parquet").unlink()
    with pytest.warns(PositionTimestampWarning):
        convert("sasrec-txt", [good], out, progress=False)
    (out / "part-00000.parquet").write_bytes(b"stale")
    with pytest.warns(PositionTimestampWarning):  # a convert output of its own kind is replaced
        convert("sasrec-txt", [good], out, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, "part-00000.parquet"]
    assert (out / "part-00000.parquet").read_bytes() != b"stale"
    _assert_clean(tmp_path, ["good.txt", "out"])
    # Nor does it delete a file its manifest does not list, such as the input being converted.
    inside = out / "good.txt"
    inside.write_text("1 2\n")
    with pytest.raises(ValueError, match=r"does not list \(good.txt\)"):
        convert("sasrec-txt", [inside], out, overwrite=True, progress=False)
    assert inside.read_text() == "1 2\n"


def test_hex_parsing_matches_python_and_rejects_non_hex():
    from genrec.data.convert import _hex8_to_int64

    rng = np.random.default_rng(0)
    values = [f"{x:08x}" for x in rng.integers(0, 1 << 32, 2000)] + ["DEADBEEF", "aBcD0129", None]
    parsed = _hex8_to_int64(pa.array(values))
    assert parsed.tolist() == [int(v, 16) for v in values[:-1]] + [CRITEO_MISSING_ID]
    # Bytes next to the hex ranges, and control bytes that alias digits under `| 0x20`.
    for bad in ["0000000g", "0000:000", "0000/000", "0000@000", "0000`000", "0000G000", "0000\x10000"]:
        assert _hex8_to_int64(pa.array([bad])) is None, repr(bad)


def test_a_byte_order_mark_and_odd_tokens_are_read_as_written(tmp_path):
    """A UTF-8 BOM is not part of the first id (it made a phantom user); "--5" is a string
    id, hashed as the docstring says (it passed the digit test and crashed int())."""
    bom = tmp_path / "bom.data"
    bom.write_bytes("\ufeff196\t242\t3\t881250949\n196\t302\t3\t881250950\n".encode("utf-8"))
    convert("movielens", [bom], tmp_path / "a", progress=False)
    assert _read(tmp_path / "a").column("user_id").to_pylist() == [196, 196]
    odd = _write(tmp_path / "odd.data", "--5\t242\t3\t881250949\n-7\t302\t3\t881250950\n")
    convert("movielens", [odd], tmp_path / "b", progress=False)
    assert sorted(_read(tmp_path / "b").column("user_id").to_pylist()) == sorted(map(hash_string_id, ["--5", "-7"]))


@pytest.mark.filterwarnings("ignore::genrec.data.convert.PositionTimestampWarning")
@pytest.mark.parametrize("source, text", [
    ("movielens", "-3\t-4\t5\t100\n"),
    ("sasrec-txt", "-3 -4\n"),
    ("s3rec-txt", "-3 -4 -9223372036854775808\n"),
])
def test_a_negative_number_is_a_string_id(tmp_path, source, text):
    """Negative ids are the sparse store's own (training failed on them at some batch): a
    token such as "-3" is hashed like any other non-numeric token."""
    convert(source, [_write(tmp_path / "neg.txt", text)], tmp_path / "out", progress=False)
    log = _read(tmp_path / "out")
    tokens = text.split()
    assert log.column("user_id").to_pylist()[0] == hash_string_id(tokens[0])
    assert log.column("item_id").to_pylist()[0] == hash_string_id(tokens[1])
    assert min(log.column("user_id").to_pylist() + log.column("item_id").to_pylist()) >= 0


def test_a_corrupt_compressed_input_names_the_file(tmp_path):
    bad = tmp_path / "bad.csv.gz"
    bad.write_bytes(b"this is not gzip data at all")
    with pytest.raises(ValueError, match=r"cannot read input file .*bad\.csv\.gz"):
        convert("criteo", [bad], tmp_path / "out", progress=False)
    cut = tmp_path / "cut.data.gz"
    whole = gzip.compress("".join(f"{i}\t{i * 7 % 1000}\t3\t{881250949 + i}\n" for i in range(5000)).encode())
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cannot read input file .*cut\.data\.gz"):
        convert("movielens", [cut], tmp_path / "out2", progress=False)


def test_a_criteo_line_of_blanks_is_named(tmp_path):
    lines = CRITEO.read_text().splitlines()[:5]
    bad = _write(tmp_path / "blank.csv", "\n".join(lines + ["   "] + lines) + "\n")
    with pytest.raises(ValueError, match=r"malformed line 6 in .*blank\.csv.*expected 40 TAB-separated fields"):
        convert("criteo", [bad], tmp_path / "out", progress=False)
