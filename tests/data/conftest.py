"""Fixtures of the prepare / loader tests: prepared MovieLens-100K and a prepared ad log."""

from __future__ import annotations

from pathlib import Path

import pytest
from seqdata_helpers import AD_FEATURES, ML100K, ML_FEATURES, ml100k_log, random_log, write_log

from genrec.data.prepare import SplitConfig, prepare


@pytest.fixture(scope="session")
def ml100k_prepared(tmp_path_factory) -> Path:
    if not ML100K.is_file():
        pytest.skip("MovieLens-100K not available")
    base = tmp_path_factory.mktemp("ml100k")
    write_log(ml100k_log(), base / "log", num_files=2, row_group_size=20_000)
    out = base / "prepared"
    prepare(base / "log", out, ML_FEATURES, SplitConfig(), num_shards=2, row_group_users=64, progress=False)
    return out


@pytest.fixture(scope="session")
def ad_prepared(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("ads")
    write_log(random_log(300, 12_000, seed=1), base / "log", num_files=3)
    out = base / "prepared"
    prepare(base / "log", out, AD_FEATURES, SplitConfig(), num_shards=3, row_group_users=16, progress=False)
    return out
