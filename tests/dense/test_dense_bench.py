"""`genrec bench dense`: a ratio's two sides are timed in the same rounds."""

from __future__ import annotations

import pytest

from genrec.dense import bench


def test_the_kv_cache_speedup_pairs_sides_timed_in_the_same_rounds(monkeypatch):
    """Each `_side_by_side` call here times every side of its rounds alike, at a time of its
    own: a ratio of two sides of one call is then exactly 1 (x 4 micro-batches of 256),
    and a ratio across two calls is not."""
    calls: list[set[str]] = []

    def side_by_side(fns, reps):
        calls.append(set(fns))
        return {name: [float(len(calls))] * reps for name in fns}

    monkeypatch.setattr(bench, "_side_by_side", side_by_side)
    out: dict = {}
    bench._kv_cache(out, quick=True, reps=3)
    assert out["kv_cache_speedup_1024"] == pytest.approx(4.0)
    assert out["kv_cache_speedup_1024_spread"]["n"] == 3
    assert out["kv_cache_speedup_vs_single_forward_1024"] == pytest.approx(1.0)
