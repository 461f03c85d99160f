"""The `genrec` command line: real subprocesses, exit codes and messages a user sees."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
ML100K = Path("/work/shared/data/ml-100k/u.data")
if not ML100K.exists():
    ML100K = ROOT.parent / "shared" / "data" / "ml-100k" / "u.data"


def genrec(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "genrec.scripts.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_every_subcommand_has_help():
    for command in ("synth", "convert", "prepare", "train", "export", "eval", "serve", "bench", "demo"):
        result = genrec(command, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage: genrec " + command in result.stdout


def test_synth_then_prepare_with_config_overrides(tmp_path):
    assert genrec("synth", "--out", str(tmp_path / "logs"), "--users", "50", "--items", "80", "--events", "2000",
                  "--seed", "1").returncode == 0
    result = genrec("prepare", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "data"),
                    "--config", str(ROOT / "configs" / "demo.toml"), "--set", "data.prepare.num_shards=1")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["counts"]["users"] == 50
    assert len(list((tmp_path / "data" / "train").glob("*.parquet"))) == 1


def test_prepare_from_movielens(tmp_path):
    # A trailing slash in --out: the converted log goes beside the output (ml.logs), not into it.
    result = genrec("prepare", "--from", "movielens", "--input", str(ML100K), "--out", str(tmp_path / "ml") + "/",
                    "--config", str(ROOT / "configs" / "ml100k.toml"))
    assert result.returncode == 0, result.stderr
    counts = json.loads((tmp_path / "ml" / "manifest.json").read_text())["counts"]
    assert counts["users"] == 943 and counts["items"] <= 1682
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ml", "ml.logs"]
    # An output that prepare would refuse is refused before anything is converted.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    result = genrec("prepare", "--from", "movielens", "--input", str(ML100K), "--out", str(other),
                    "--config", str(ROOT / "configs" / "ml100k.toml"))
    assert result.returncode == 1 and "not empty" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ml", "ml.logs", "other"]


def test_demo_checks_its_settings_before_replacing_a_demo(tmp_path):
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "demo_manifest.json").write_text(json.dumps({"format": "genrec.demo/1", "steps": 1}))
    result = genrec("demo", "--out", str(demo), "--overwrite", "--steps", "0")
    assert result.returncode == 1 and "train.max_steps" in result.stderr
    assert (demo / "demo_manifest.json").exists()  # the previous demo is still there


def test_demo_overwrite_keeps_files_the_demo_did_not_write(tmp_path, monkeypatch):
    import genrec.data.synth
    from genrec.scripts.demo import run_demo

    def reached(*args, **kwargs):
        raise RuntimeError("the demo started over")

    monkeypatch.setattr(genrec.data.synth, "synthesize", reached)  # stop right after the folder is replaced
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "demo_manifest.json").write_text(json.dumps({"format": "genrec.demo/1", "steps": 1}))
    (demo / "logs").mkdir()
    (demo / ".data.tmp-host-1-abc").mkdir()  # a killed step's staging folder is the demo's own
    (demo / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"refusing to replace .*notes\.txt"):
        run_demo(demo, overwrite=True, steps=2)
    assert (demo / "notes.txt").read_text() == "mine" and (demo / "logs").is_dir()
    (demo / "notes.txt").unlink()
    with pytest.raises(RuntimeError, match="started over"):
        run_demo(demo, overwrite=True, steps=2)
    assert sorted(p.name for p in demo.iterdir()) == ["demo_manifest.json"]


def test_user_errors_exit_nonzero_naming_what_is_wrong(tmp_path):
    result = genrec("prepare", "--logs", str(tmp_path / "nothing-*.parquet"), "--out", str(tmp_path / "out"),
                    "--config", str(ROOT / "configs" / "demo.toml"))
    assert result.returncode == 1 and "nothing-*.parquet" in result.stderr
    assert not (tmp_path / "out").exists()

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"user_id": [1], "ts": ["yesterday"], "item_id": [3], "action": [1]}), bad)
    result = genrec("prepare", "--logs", str(bad), "--out", str(tmp_path / "out"),
                    "--config", str(ROOT / "configs" / "demo.toml"))
    assert result.returncode == 1 and "bad.parquet" in result.stderr and "Traceback" not in result.stderr

    result = genrec("train", "--config", str(ROOT / "configs" / "demo.toml"), "--set", "train.max_stepz=3")
    assert result.returncode == 1 and "train.max_stepz" in result.stderr

    in_the_way = tmp_path / "a-file"  # an output path through a file: the system's error, one line
    in_the_way.write_text("mine")
    result = genrec("synth", "--out", str(in_the_way / "logs"), "--users", "10", "--items", "10", "--events", "50")
    assert result.returncode == 1 and str(in_the_way) in result.stderr and "Traceback" not in result.stderr
    assert in_the_way.read_text() == "mine"

    result = genrec("train", "--config", str(ROOT / "configs" / "demo.toml"), "--set", "dense.num_layers=\"two\"")
    assert result.returncode == 1 and "dense.num_layers" in result.stderr

    result = genrec("eval", "--checkpoint", str(tmp_path / "run"), "--data", str(tmp_path / "data"),
                    "--out", str(tmp_path / "report"), "--seed", "-1")
    assert result.returncode == 1 and "--seed" in result.stderr and not (tmp_path / "report").exists()


def test_a_path_that_is_not_utf8_is_named_and_nothing_is_written(tmp_path):
    # A file name of other bytes (Latin-1 here) reaches Python as surrogates; pyarrow and
    # JSON then failed deep inside with a codec error that named no path, after converting.
    out = tmp_path / "caf\udce9"
    result = genrec("prepare", "--from", "movielens", "--input", str(ML100K), "--out", str(out),
                    "--config", str(ROOT / "configs" / "ml100k.toml"))
    assert result.returncode == 1
    assert "argument '" + str(tmp_path) + "/caf\\xe9' is not valid UTF-8" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []
