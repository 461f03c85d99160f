import json
import re
from dataclasses import dataclass, field
from typing import Literal

import pytest

from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict, load_config, to_dict


@dataclass(kw_only=True)
class Table:
    name: str
    dim: int = 8


@dataclass(kw_only=True)
class Section:
    lr: float = 1e-3
    steps: int = 10
    kind: Literal["a", "b"] = "a"
    cap: int | None = None
    flag: bool = False
    names: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Root:
    section: Section = field(default_factory=Section)
    tables: list[Table] = field(default_factory=list)


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[section]\nlr = 1\nkind = "b"\n[[tables]]\nname = "item"\ndim = 16\n')
    cfg = load_config(Root, path, ["section.steps=5", "section.names=[\"x\", \"y\"]", "section.cap=3"])
    assert cfg.section.lr == 1.0 and isinstance(cfg.section.lr, float)
    assert cfg.section.kind == "b" and cfg.section.steps == 5 and cfg.section.cap == 3
    assert cfg.section.names == ["x", "y"]
    assert cfg.tables == [Table(name="item", dim=16)]
    assert from_dict(Root, to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("section.stepz=5", "unknown config key 'section.stepz'"),
        ("nope.x=1", "unknown config key 'nope'"),
        ("section.steps=1.5", "section.steps: expected an integer"),
        ("section.steps=true", "section.steps: expected an integer"),
        ("section.kind=\"c\"", "section.kind: 'c' is not one of"),
        ("section.flag=1", "section.flag: expected true/false"),
        ("section.names=3", "section.names: expected a list"),
        ("section", "--set expects section.key=value"),
    ],
)
def test_errors_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config(Root, None, [override])


def test_an_override_names_a_table_of_an_array_by_name_or_index(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[[tables]]\nname = "item"\n[[tables]]\nname = "user"\ndim = 4\n')
    cfg = load_config(Root, path, ["tables.user.dim=32", "tables.0.dim=16"])
    assert cfg.tables == [Table(name="item", dim=16), Table(name="user", dim=32)]
    # A name that is also a number names the table of that name, not the index.
    path.write_text('[[tables]]\nname = "a"\n[[tables]]\nname = "0"\n')
    assert load_config(Root, path, ["tables.0.dim=5"]).tables == [Table(name="a"), Table(name="0", dim=5)]
    for override, message in (("tables.ad.dim=1", "no table 'ad' here (by name: 'a', '0'; by index: 0 to 1)"),
                              ("tables.2.dim=1", "no table '2' here"),
                              ("tables.a.dimm=1", "unknown config key 'tables[0].dimm'"),
                              ("tables.a.dim=1.5", "tables[0].dim: expected an integer"),
                              ("tables.dim=1", "'tables' holds several tables: name one, as in tables.<table>.dim=")):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(Root, path, [override])


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(Root, tmp_path / "missing.toml")
    with pytest.raises(ValueError, match=f"config file {tmp_path} is a directory"):
        load_config(Root, tmp_path)
    latin = tmp_path / "latin1.toml"
    latin.write_bytes('[section]\nnames = ["caf\u00e9"]\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"config file {latin}: 'utf-8' codec"):
        load_config(Root, latin)
    bad = tmp_path / "bad.toml"
    bad.write_text("[tables]\nname = 'x'\n")
    with pytest.raises(ValueError, match=f"{bad}.*tables: expected a list"):
        load_config(Root, bad)
    with pytest.raises(ValueError, match=r"tables\[0\]"):
        load_config(Root, None, ["tables=[{dim = 3}]"])


def test_none_turns_off_an_optional_setting_and_survives_a_round_trip(tmp_path):
    """TOML has no null: "none" (in a file or a --set) sets a field whose type admits None,
    and a None that is not the field's default is written back as "none", not dropped
    (dropped, config.json and load_trained brought back the default)."""
    path = tmp_path / "c.toml"
    path.write_text('[train]\nbest_metric = "none"\n')
    cfg = load_config(JobConfig, path, ["train.optim.grad_clip_norm=none"])
    assert cfg.train.best_metric is None and cfg.train.optim.grad_clip_norm is None
    saved = to_dict(cfg)
    assert saved["train"]["best_metric"] == "none" and saved["train"]["optim"]["grad_clip_norm"] == "none"
    again = from_dict(JobConfig, json.loads(json.dumps(saved)))
    assert again.train.best_metric is None and again.train.optim.grad_clip_norm is None
    assert "num_epochs" not in saved["train"]  # a None that is the default stays out, as before
    with pytest.raises(ValueError, match="train.log_every: expected an integer, got 'none'"):
        load_config(JobConfig, None, ["train.log_every=none"])  # not optional: still an error


@pytest.mark.parametrize("override, message", [
    ("train.optim.lr=inf", "train.optim.lr must be a finite number >= 0, got inf"),
    ("train.optim.lr=nan", "train.optim.lr must be a finite number >= 0, got nan"),
    ("train.optim.eps=nan", "train.optim.eps must be a finite number > 0"),
    ("train.optim.grad_clip_norm=nan", "train.optim.grad_clip_norm must be a finite number > 0"),
    ("model.temperature=0", "model.temperature must be a finite number > 0, got 0"),
    ("train.seed=-1", "train.seed must be in [0, 2**32 - 1], got -1"),
    ("data.loader.max_seq_len=201", "data.loader.max_seq_len (201) is longer than dense.max_seq_len (200)"),
    ("train.seed=4294967296", "train.seed must be in [0, 2**32 - 1], got 4294967296"),
    ("model.temperature=-1", "model.temperature must be a finite number > 0"),
    ("model.task_weights=[1.0, -2.0]", "model.task_weights[1] must be a finite number >= 0"),
    ("train.optim.betas=[0.9, 1.0]", "train.optim.betas[1] must be a finite number in [0, 1), got 1.0"),
    ("train.optim.betas=[0.9]", "train.optim.betas must be two numbers in [0, 1)"),
    ("train.optim.min_lr_ratio=nan", "train.optim.min_lr_ratio must be a finite number in [0, 1]"),
    ("data.loader.prefetch_factor=-3", "data.loader.prefetch_factor must be a finite number > 0"),
    ("data.loader.random_end_prob=1.5", "data.loader.random_end_prob must be a finite number in [0, 1]"),
    ("sparse.ssd_slab_rows=0", "sparse.ssd_slab_rows must be a finite number > 0"),
    ("dense.time_bucket_divisor=0", "dense.time_bucket_divisor must be a finite number > 0, got 0.0"),
    ("dense.time_bucket_divisor=nan", "dense.time_bucket_divisor must be a finite number > 0, got nan"),
    ("dense.layer_norm_eps=nan", "dense.layer_norm_eps must be a finite number > 0, got nan"),
    ("data.loader.seed=-1", "data.loader.seed must be a finite number >= 0, got -1"),
    ('sparse.device="tpu"', "sparse.device must name a torch device"),
    ("sparse.tables.item.learning_rate=-1", "sparse.tables.item.learning_rate must be a finite number >= 0"),
    ("sparse.tables.item.host_rows=-1", "sparse.tables.item.host_rows must be a finite number >= 0"),
    ("sparse.tables.item.max_rows=0", "sparse.tables.item.max_rows must be a finite number > 0"),
    ("sparse.tables.item.beta2=1.0", "sparse.tables.item.beta2 must be a finite number in [0, 1)"),
    ("sparse.tables.item.admit_probability=0", "sparse.tables.item.admit_probability must be a finite number in (0, 1]"),
])
def test_numbers_out_of_range_are_refused_at_load_naming_the_key(override, message):
    """Every shipped config loads; a NaN, an infinity or a value out of its range in any
    section is refused when the config loads (it trained on NaN, divided by a zero
    temperature, or silently inverted the softmax), naming the key as the run file does."""
    from pathlib import Path

    configs = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.toml"))
    for path in configs:
        load_config(JobConfig, path)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(JobConfig, configs[0], [override])


def test_min_target_action_without_the_action_feature_is_refused_at_load():
    """The loader reads only `data.features.sparse`: a threshold on an action column that is
    not there failed with a bare KeyError('action') at the first training step."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / "ml100k.toml"  # sparse = ["item_id"]
    with pytest.raises(ValueError, match=re.escape("model.min_target_action reads each event's action, but "
                                                   "data.features.action ('action') is not in data.features.sparse")):
        load_config(JobConfig, config, ["model.min_target_action=4"])
    cfg = load_config(JobConfig, config, ["model.min_target_action=4", 'data.features.sparse=["item_id", "action"]'])
    assert cfg.model.min_target_action == 4
