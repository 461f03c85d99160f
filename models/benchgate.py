"""`genrec bench`: run one benchmark or all of them, and gate a result against a baseline.

    genrec bench sparse --quick --json OUT      one bench's figures + the conditions they were taken under
                                                (refused on a busy machine, load > QUIET_LOAD, unless --allow-noisy)
    genrec bench all --quick --json OUT         every bench in ALL, one JSON: {"benches": {name: figures}}
    genrec bench check OUT --baseline FILE      exit 1 on a regression beyond the noise, else 0
    genrec bench gate --baseline FILE --json OUT   `all --quick` + `check`, waiting out load; a failure must repeat
    genrec bench baseline OUT... --json FILE    a baseline from several `all` results (their spread)
    genrec bench readme [--check]               the README's tables from configs/figures/ (genrec.models.figures)

A baseline holds, per gated figure ("bench.key", GATED), the median, min and max over the
runs it was made from, whether higher is better, and a target where the issue sets one.
`check` compares a result with it:
  - regression: a figure falls below its baseline min by more than NOISE_SPREADS times the
    baseline's own spread (max - min), or rises above max by as much where lower is better:
    the margin comes from what was observed on the machine, with a floor of MIN_MARGIN of
    the median (a handful of runs understate a quick ratio's spread);
  - lost target: a target that held in every baseline run is now missed by more than that
    margin (exactly, for a figure that never varied, like bytes per row);
  - inconclusive: the result was taken with a load average above MAX_LOAD (a figure then
    says more about the neighbours than the code); exit 0, saying so.
Figures of a bench that was not run, or a baseline from another CPU model (or the same model
with other vector flags: the native kernels are built per instruction set), are reported and
skipped rather than failed.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from genrec.data.files import atomic_write_text

BENCH_MODULES = {
    "data": "genrec.data.bench",
    "sparse": "genrec.models.bench_sparse",
    "dense": "genrec.dense.bench",
    "train": "genrec.models.train.bench",
    "serve": "genrec.models.serving.bench",
    "quality": "genrec.models.train.bench_quality",
    "quality-ml100k": "genrec.models.train.bench_quality_ml100k",
}
ALL = ("data", "sparse", "dense", "train", "serve")
"""What `bench all` runs (`quality` and `quality-ml100k` train for minutes even with --quick: run them alone)."""

GATED = {
    # figure: (higher is better, target or None)
    "sparse.hot_path_ratio": (True, 0.8),
    "sparse.hot_path_ratio_default_config": (True, 0.6),
    "sparse.index_bytes_per_row": (False, 16.0),
    "sparse.offload_ratio": (True, 0.75),
    "sparse.offload_ratio_store_only": (True, None),
    "dense.jagged_vs_padded": (True, 1.5),
    "dense.kv_cache_speedup_1024": (True, None),
    "dense.hstu_vs_transformer_1024": (True, None),
    "data.loader_vs_pyarrow_ratio": (True, None),
    "serve.mfalcon_speedup": (True, 10.0),
}
"""Figures the gate watches: ratios measured side by side in one run, and sizes that do not
vary. Absolute times (latencies, rows/s) are left out: they follow the machine's load more
than the code."""

NOISE_SPREADS = 2.0
MIN_MARGIN = 0.35
"""The margin's floor, relative to the median. A few baseline runs understate how far a
quick ratio moves between runs: the data loader's ratio, 0.60-0.66 over the five baseline
runs, read 0.41 in a run right after the test suite. A size that never varies gets the
same floor, so unrelated changes to its last digits do not fail a build; its target
still holds it."""
MAX_LOAD_PER_CPU = 0.75
"""Load average per logical CPU above which a result is inconclusive (1.5 on 2 cores)."""
BASELINE_FORMAT = "genrec.bench.baseline/1"
GATE_TRIES = 4


QUIET_LOAD = 0.5
"""The 1-minute load average above which `genrec bench NAME` refuses to measure (figures
taken beside other work say more about it than about the code)."""


def max_load() -> float:
    return MAX_LOAD_PER_CPU * (os.cpu_count() or 1)


def run_one(name: str, quick: bool) -> dict:
    """One bench's figures, with the conditions they were taken under."""
    from genrec.models.benchrecord import finish_record, start_record

    run = importlib.import_module(BENCH_MODULES[name]).run
    record = start_record()
    figures = run(quick=quick)
    figures.setdefault("quick", quick)
    figures["conditions"] = {**figures.get("conditions", {}), **finish_record(record)}
    return figures


def run_all(quick: bool) -> dict:
    from genrec.models.benchrecord import finish_record, start_record

    record, benches = start_record(), {}
    for name in ALL:
        t0 = time.time()
        print(f"genrec bench all: {name} ...", file=sys.stderr, flush=True)
        benches[name] = run_one(name, quick)
        print(f"genrec bench all: {name} done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"quick": quick, "benches": benches, "conditions": finish_record(record)}


def _figure(result: dict, dotted: str):
    """The number at "bench.key" of a `bench all` result (or "key" of one bench's), or None."""
    from genrec.models.figures import lookup

    if "benches" in result:
        return lookup(result["benches"], dotted)
    return lookup(result, dotted.partition(".")[2])


def make_baseline(results: list[dict]) -> dict:
    """A baseline from several `bench all` results taken on one machine."""
    if not results:
        raise ValueError("genrec bench baseline: give at least one `bench all` result")
    figures = {}
    for dotted, (higher, target) in GATED.items():
        values = sorted(v for r in results if (v := _figure(r, dotted)) is not None)
        if values:
            figures[dotted] = {"median": statistics.median(values), "min": values[0], "max": values[-1],
                               "n": len(values), "higher_is_better": higher, "target": target}
    conditions = [r.get("conditions", {}) for r in results]
    return {"format": BASELINE_FORMAT, "cpu": conditions[0].get("cpu"), "figures": figures,
            "load_average_before": [c.get("load_average_before") for c in conditions],
            "git_commit": [c.get("git_commit") for c in conditions]}


def check(result: dict, baseline: dict) -> tuple[str, list[str]]:
    """("pass" | "fail" | "inconclusive", lines saying why, one per figure)."""
    if baseline.get("format") != BASELINE_FORMAT:
        raise ValueError(f"baseline: format {baseline.get('format')!r} is not {BASELINE_FORMAT!r}")
    load = (result.get("conditions", {}).get("load_average_before") or [0.0])[0]
    if load > max_load():
        return "inconclusive", [f"load average {load:.2f} at the start is above {max_load():.2f}: "
                                "the figures say more about other work on the machine than about the code"]
    cpu, base_cpu = result.get("conditions", {}).get("cpu", {}), baseline.get("cpu") or {}
    flags = [sorted(c["flags"]) if isinstance(c.get("flags"), list) else None for c in (base_cpu, cpu)]
    if base_cpu and cpu and (cpu.get("model") != base_cpu.get("model") or None not in flags and flags[0] != flags[1]):
        return "inconclusive", [f"baseline taken on {base_cpu.get('model')!r} {flags[0]}, "
                                f"this result on {cpu.get('model')!r} {flags[1]}"]
    lines, failed = [], False
    for dotted, why in baseline.get("left_out", {}).items():  # a figure whose meaning a change moved
        lines.append(f"skip  {dotted}: left out of this baseline: {why}")
    for dotted, b in baseline["figures"].items():
        value = _figure(result, dotted)
        if value is None:
            lines.append(f"skip  {dotted}: not in this result")
            continue
        margin = max(NOISE_SPREADS * (b["max"] - b["min"]), MIN_MARGIN * abs(b["median"]))
        held = margin if b["max"] > b["min"] else 0.0  # a figure that never varied: its target exactly
        if b["higher_is_better"]:
            bad, limit = value < b["min"] - margin, b["min"] - margin
            missed = b["target"] is not None and b["min"] >= b["target"] and value < b["target"] - held
        else:
            bad, limit = value > b["max"] + margin, b["max"] + margin
            missed = b["target"] is not None and b["max"] <= b["target"] and value > b["target"] + held
        verdict = "FAIL" if bad or missed else "ok"
        failed |= bad or missed
        why = " (regression)" if bad else " (target lost)" if missed else ""
        lines.append(f"{verdict:5s} {dotted}: {value:.4g}, baseline median {b['median']:.4g} "
                     f"[{b['min']:.4g}, {b['max']:.4g}], limit {limit:.4g}{why}")
    return ("fail" if failed else "pass"), lines


def _read(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable bench JSON ({e})") from None


def _write(path: str | None, data: dict, echo: bool = True) -> None:
    text = json.dumps(data, indent=2, sort_keys=True)
    if echo:
        print(text)
    if path:
        atomic_write_text(path, text + "\n")


def _report(verdict: str, lines: list[str]) -> int:
    for line in lines:
        print(f"genrec bench check: {line}", file=sys.stderr)
    print(f"genrec bench check: {verdict}", file=sys.stderr)
    return 1 if verdict == "fail" else 0


def command(args) -> int:
    """The `genrec bench` subcommand (see the module docstring)."""
    name = args.name
    if name in BENCH_MODULES or name == "all":
        load = os.getloadavg()[0]
        if load > QUIET_LOAD and not args.allow_noisy:
            print(f"genrec bench {name}: the machine is busy (1-minute load average {load:.2f} > {QUIET_LOAD}): "
                  "its figures would measure the other work. Run it on a quiet machine, or pass --allow-noisy "
                  "(the JSON's conditions record the load)", file=sys.stderr, flush=True)
            return 2
        result = run_one(name, args.quick) if name != "all" else run_all(args.quick)
        if load > QUIET_LOAD:
            result["taken_noisy"] = True
        _write(args.json_out, result)
        return 0
    if name == "readme":
        from genrec.models.figures import command as readme

        return readme(check_only=args.check)
    if name == "baseline":
        if not args.results or not args.json_out:
            raise ValueError("genrec bench baseline: give the `bench all` results and --json FILE")
        _write(args.json_out, make_baseline([_read(p) for p in args.results]))
        return 0
    if not args.baseline:
        raise ValueError(f"genrec bench {name}: --baseline FILE is required")
    baseline = _read(args.baseline)
    if name == "check":
        if len(args.results) != 1:
            raise ValueError("genrec bench check: give one result file")
        return _report(*check(_read(args.results[0]), baseline))
    # gate: a loaded machine is waited for (a minute at a time), and a failure is run again:
    # noise must strike twice to fail a build. A single failure not confirmed within the
    # tries is reported, as inconclusive.
    failures: list[list[str]] = []
    for attempt in range(GATE_TRIES):
        load = os.getloadavg()[0]
        if load > max_load():
            print(f"genrec bench gate: load average {load:.2f} above {max_load():.2f}; waiting "
                  f"(try {attempt + 1} of {GATE_TRIES})", file=sys.stderr, flush=True)
            time.sleep(60)
            continue
        result = run_all(quick=True)
        _write(args.json_out, result, echo=False)
        verdict, lines = check(result, baseline)
        if verdict == "pass":
            return _report(verdict, lines)
        if verdict == "fail":
            failures.append(lines)
            if len(failures) == 2:
                return _report(verdict, lines)
    note = ["no result in a quiet enough moment"] if not failures else [
        "one failure, not confirmed by a second run:", *failures[0]]
    return _report("inconclusive", note)
