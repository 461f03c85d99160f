"""The prepared tiny synthetic ad log that the training tests share (read-only)."""

from pathlib import Path

import pytest

from genrec.data.prepare import prepare
from genrec.data.synth import synthesize
from train_helpers import tiny_config


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trainlog")
    synthesize(root / "logs", num_users=120, num_items=300, num_events=6000, seed=3, progress=False)
    cfg = tiny_config(root / "data", root / "run")
    prepare(root / "logs", root / "data", cfg.data.features, cfg.data.prepare.split, num_shards=2, row_group_users=32)
    return root / "data"
