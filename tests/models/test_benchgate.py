"""The benchmark regression gate: it fails on a doctored regression, passes its own baseline
runs, is inconclusive on a loaded machine, and the committed baseline is one it made."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from genrec.models import benchgate

BASELINE = Path(__file__).resolve().parents[2] / "configs" / "bench_baseline.json"


def _result(hot: float, index_bytes: float = 10.3, load: float = 0.5, cpu: str = "test cpu") -> dict:
    return {"benches": {"sparse": {"hot_path_ratio": hot, "index_bytes_per_row": index_bytes,
                                   "hot_path_ratio_default_config": 0.65}},
            "conditions": {"load_average_before": [load, load, load], "cpu": {"model": cpu}}}


@pytest.fixture()
def baseline() -> dict:
    return benchgate.make_baseline([_result(0.72), _result(0.75), _result(0.80)])


def test_baseline_records_each_figures_spread(baseline):
    hot = baseline["figures"]["sparse.hot_path_ratio"]
    assert (hot["median"], hot["min"], hot["max"], hot["n"]) == (0.75, 0.72, 0.80, 3)
    assert "dense.jagged_vs_padded" not in baseline["figures"]  # not run: not gated


def test_a_baseline_of_an_even_count_of_runs_has_their_median():
    figure = benchgate.make_baseline([_result(h) for h in (0.5, 0.6, 0.9, 1.0)])["figures"]["sparse.hot_path_ratio"]
    assert figure["median"] == pytest.approx(0.75) and (figure["min"], figure["max"]) == (0.5, 1.0)


def test_the_baseline_runs_pass_and_noise_inside_the_spread_passes(baseline):
    for hot in (0.72, 0.80, 0.48):  # 0.48 is within the margin (35% of the median) below the min
        assert benchgate.check(_result(hot), baseline)[0] == "pass"


def test_a_doctored_regression_fails_naming_the_figure(baseline):
    verdict, lines = benchgate.check(_result(0.40), baseline)
    assert verdict == "fail"
    assert any(line.startswith("FAIL") and "sparse.hot_path_ratio:" in line and "regression" in line for line in lines)


def test_a_figure_that_never_varied_is_held_to_its_target(baseline):
    assert benchgate.check(_result(0.75, index_bytes=12.0), baseline)[0] == "pass"  # within the floor
    verdict, lines = benchgate.check(_result(0.75, index_bytes=20.0), baseline)
    assert verdict == "fail" and any("index_bytes_per_row" in line and "FAIL" in line for line in lines)
    # Nearer its target, a size that never varied fails as soon as it misses the target (16
    # bytes), though still inside the regression margin's floor above its baseline (15).
    near = benchgate.make_baseline([_result(h, index_bytes=15.0) for h in (0.72, 0.75, 0.80)])
    assert benchgate.check(_result(0.75, index_bytes=16.0), near)[0] == "pass"
    verdict, lines = benchgate.check(_result(0.75, index_bytes=17.0), near)
    assert verdict == "fail" and any("index_bytes_per_row" in line and "target lost" in line for line in lines)


def test_a_loaded_machine_or_another_cpu_is_inconclusive_not_failed(baseline):
    assert benchgate.check(_result(0.10, load=benchgate.max_load() + 1), baseline)[0] == "inconclusive"
    assert benchgate.check(_result(0.10, cpu="another cpu"), baseline)[0] == "inconclusive"


def test_the_same_cpu_model_with_other_vector_flags_is_inconclusive(baseline):
    """One model name covers hosts with and without AVX-512, whose native kernel builds differ."""
    def on(flags: list[str], hot: float) -> dict:
        result = _result(hot, cpu="AMD EPYC")
        result["conditions"]["cpu"]["flags"] = flags
        return result

    avx512 = benchgate.make_baseline([on(["avx2", "avx512f", "fma"], h) for h in (0.72, 0.75, 0.80)])
    assert benchgate.check(on(["fma", "avx2", "avx512f"], 0.10), avx512)[0] == "fail"  # same flags: gated
    verdict, lines = benchgate.check(on(["avx2", "fma"], 0.10), avx512)
    assert verdict == "inconclusive" and "avx512f" in lines[0]


def test_missing_figures_are_skipped(baseline):
    result = copy.deepcopy(_result(0.75))
    del result["benches"]["sparse"]["hot_path_ratio_default_config"]
    verdict, lines = benchgate.check(result, baseline)
    assert verdict == "pass" and any(line.startswith("skip") for line in lines)


def test_the_cli_exits_nonzero_on_a_doctored_result_against_the_committed_baseline(tmp_path):
    committed = json.loads(BASELINE.read_text())
    assert committed["format"] == benchgate.BASELINE_FORMAT
    assert set(committed["figures"]) <= set(benchgate.GATED) and "sparse.hot_path_ratio" in committed["figures"]
    medians = {}
    for dotted, b in committed["figures"].items():
        bench, _, key = dotted.partition(".")
        medians.setdefault(bench, {})[key] = b["median"]
    good = {"benches": medians, "conditions": {"load_average_before": [0.1], "cpu": committed["cpu"]}}
    bad = copy.deepcopy(good)
    bad["benches"]["sparse"]["hot_path_ratio"] = committed["figures"]["sparse.hot_path_ratio"]["min"] / 3
    codes = {}
    for name, result in (("good", good), ("bad", bad)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result))
        codes[name] = subprocess.run([sys.executable, "-m", "genrec.scripts.cli", "bench", "check", str(path),
                                      "--baseline", str(BASELINE)], capture_output=True, text=True)
    assert codes["good"].returncode == 0, codes["good"].stderr
    assert codes["bad"].returncode == 1 and "FAIL  sparse.hot_path_ratio" in codes["bad"].stderr


def test_every_bench_module_loads_and_finds_its_files():
    import importlib

    for name, module in benchgate.BENCH_MODULES.items():
        mod = importlib.import_module(module)
        assert callable(mod.run), name
        for attr in ("CONFIG", "REPO"):
            path = getattr(mod, attr, None)
            assert path is None or Path(path).exists(), f"bench {name}: {attr} {path} does not exist"


@pytest.mark.parametrize("hots, code", [([0.2, 0.2], 1), ([0.2, 0.75], 0), ([0.75], 0), ([0.2, None, None, None], 0)])
def test_the_gate_fails_only_when_a_failure_repeats(monkeypatch, tmp_path, baseline, hots, code):
    """The gate's control flow, with `bench all` replaced by prepared results (None: the
    machine is loaded at that try) so it runs in milliseconds; `check` is the real one."""
    import argparse

    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(baseline))
    tries = iter(hots)
    current = {}

    def loadavg():
        current["hot"] = next(tries, 0.75)
        return (0.1 if current["hot"] is not None else benchgate.max_load() + 1,) * 3

    monkeypatch.setattr(benchgate.os, "getloadavg", loadavg)
    monkeypatch.setattr(benchgate.time, "sleep", lambda s: None)
    monkeypatch.setattr(benchgate, "run_all", lambda quick: _result(current["hot"]))
    args = argparse.Namespace(name="gate", baseline=str(path), json_out=str(tmp_path / "gate.json"), results=[],
                              quick=True)
    assert benchgate.command(args) == code


def test_a_bench_on_a_busy_machine_is_refused_unless_allowed(monkeypatch, tmp_path, capsys):
    """`genrec bench NAME` measures nothing above QUIET_LOAD; --allow-noisy measures and
    marks the result."""
    import argparse

    monkeypatch.setattr(benchgate.os, "getloadavg", lambda: (benchgate.QUIET_LOAD + 1.0, 1.0, 1.0))
    ran = []
    monkeypatch.setattr(benchgate, "run_one", lambda name, quick: ran.append(name) or {"figure": 1.0})
    out = tmp_path / "figures.json"
    args = argparse.Namespace(name="dense", quick=True, json_out=str(out), allow_noisy=False)
    assert benchgate.command(args) == 2
    assert ran == [] and not out.exists()
    assert "busy" in capsys.readouterr().err
    assert benchgate.command(argparse.Namespace(**{**vars(args), "allow_noisy": True})) == 0
    assert ran == ["dense"] and json.loads(out.read_text()) == {"figure": 1.0, "taken_noisy": True}


def test_a_left_out_figure_is_reported_not_gated(baseline):
    baseline["left_out"] = {"sparse.hot_path_ratio": "moved by a kernel change"}
    del baseline["figures"]["sparse.hot_path_ratio"]
    verdict, lines = benchgate.check(_result(0.10), baseline)
    assert verdict == "pass"
    assert "skip  sparse.hot_path_ratio: left out of this baseline: moved by a kernel change" in lines


def test_the_shipped_baseline_is_well_formed():
    shipped = json.loads(BASELINE.read_text())
    assert shipped["format"] == benchgate.BASELINE_FORMAT
    assert set(shipped["figures"]) | set(shipped.get("left_out", {})) == set(benchgate.GATED)
    assert not set(shipped["figures"]) & set(shipped.get("left_out", {}))
