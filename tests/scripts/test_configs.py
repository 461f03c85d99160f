"""Every run file shipped in configs/ loads through the strict config loader."""

from pathlib import Path

import pytest

from genrec.models.config import JobConfig
from genrec.models.config_loader import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path):
    cfg = load_config(JobConfig, path, [])
    assert cfg.dense.embedding_dim == cfg.sparse.tables[0].embedding_dim or cfg.model.token_combine == "concat"
