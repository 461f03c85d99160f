"""Benchmark of the data path: `prepare` throughput and peak memory, loader vs pyarrow.

    genrec bench data --json OUT [--quick]

prepare runs in a subprocess per log size so its peak RSS (VmHWM) is its own; the
full run prepares 3M and 10M synthetic events to show the peak does not grow with the log
(`prepare_rss_growth`: peak at 10M / peak at 3M).
The loader is timed over the prepared train split next to a plain pyarrow scan of the
same files (read every row group, flatten every list column), in the same process and run,
so their ratio survives a noisy machine: `loader_vs_pyarrow_ratio` is the median of
pair-by-pair ratios (`_spread`: median, min, max, pairs).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow.parquet as pq

from genrec.data.config import FeatureSpec
from genrec.data.loader import LoaderConfig, make_loader
from genrec.data.synth import synthesize

_CHILD = """
import json, resource, sys, time
from genrec.data.config import FeatureSpec
from genrec.data.prepare import SplitConfig, prepare
args = json.loads(sys.argv[1])
started = time.perf_counter()
manifest = prepare(args["log"], args["out"], FeatureSpec(**args["features"]), SplitConfig(),
                   memory_budget_mb=args["memory_budget_mb"])
seconds = time.perf_counter() - started
# ru_maxrss keeps the high-water mark of the forking parent (it survives exec), so the
# peak of this process's own address space comes from VmHWM where Linux provides it.
ru_maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    with open("/proc/self/status") as f:
        peak_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
except (OSError, StopIteration):
    peak_kb = ru_maxrss_kb
print(json.dumps({"seconds": seconds, "events": manifest["counts"]["source_events"],
                  "num_buckets": manifest["settings"]["num_buckets"],
                  "peak_rss_kb": peak_kb, "ru_maxrss_kb": ru_maxrss_kb}))
"""


def _log(msg: str) -> None:
    print(f"[bench data] {msg}", file=sys.stderr, flush=True)


def _prepare_in_subprocess(log: Path, out: Path, features: FeatureSpec, memory_budget_mb: int) -> dict:
    args = {"log": str(log), "out": str(out), "features": asdict(features), "memory_budget_mb": memory_budget_mb}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], stdout=subprocess.PIPE, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pyarrow_scan(split_dir: Path, columns: list[str]) -> tuple[int, int, float]:
    """(rows, tokens, seconds) of reading every row group and flattening each list column."""
    started = time.perf_counter()
    rows = tokens = 0
    for path in sorted(split_dir.glob("*.parquet")):
        f = pq.ParquetFile(path)
        for rg in range(f.metadata.num_row_groups):
            table = f.read_row_group(rg, columns=columns)
            rows += table.num_rows
            for col in columns[1:]:
                values = table.column(col).combine_chunks().values.to_numpy()
            tokens += len(values)
    return rows, tokens, time.perf_counter() - started


def _loader_pass(split_dir: Path, features: FeatureSpec, cfg: LoaderConfig) -> tuple[int, int, float]:
    started = time.perf_counter()
    rows = tokens = 0
    for batch in make_loader(split_dir, features, cfg):
        rows += batch.batch_size
        tokens += batch.num_tokens
    return rows, tokens, time.perf_counter() - started


def run(quick: bool) -> dict:
    # 3M and 10M events both fill the sort buckets of a 512 MB budget (10M just has more
    # buckets), so their peaks should match: that is the flat-in-log-size claim.
    sizes = [1_000_000] if quick else [3_000_000, 10_000_000]
    features = FeatureSpec()
    memory_budget_mb = 512
    work = Path(tempfile.mkdtemp(prefix="genrec-bench-data-"))
    result: dict = {"quick": quick, "memory_budget_mb": memory_budget_mb, "prepare": {}}
    try:
        for n in sizes:
            log = work / f"log-{n}"
            _log(f"synthesizing {n:,} events")
            synthesize(log, num_users=max(1000, n // 50), num_items=max(10_000, n // 20), num_events=n, seed=0,
                       events_per_file=min(n, 2_000_000), progress=False)
            _log(f"prepare {n:,} events (subprocess)")
            stats = _prepare_in_subprocess(log, work / f"prepared-{n}", features, memory_budget_mb)
            stats["events_per_s"] = stats["events"] / stats["seconds"]
            stats["peak_rss_gb"] = stats["peak_rss_kb"] / (1 << 20)
            result["prepare"][str(n)] = stats
            _log(f"  {stats['events_per_s']:,.0f} events/s, peak RSS {stats['peak_rss_gb']:.2f} GB")
            shutil.rmtree(log)
        largest = result["prepare"][str(sizes[-1])]
        result["prepare_events_per_s"] = largest["events_per_s"]
        result["prepare_peak_rss_gb"] = largest["peak_rss_gb"]
        if len(sizes) > 1:  # the flat-in-log-size claim needs two sizes
            smallest = result["prepare"][str(sizes[0])]
            result["prepare_rss_growth"] = largest["peak_rss_gb"] / smallest["peak_rss_gb"]

        split_dir = work / f"prepared-{sizes[0]}" / "train"
        cfg = LoaderConfig(batch_size=256, max_seq_len=10_000, shuffle=True, num_workers=0)
        columns = ["user_id", *features.sparse, "ts", *features.labels]
        _log("loader vs pyarrow scan")
        # The two take turns, and the ratio is taken pair by pair: a burst of load on a shared
        # machine then slows both sides of one pair rather than one side of the comparison.
        scans, loads = [], []
        for _ in range(5 if quick else 7):
            scans.append(_pyarrow_scan(split_dir, columns))
            loads.append(_loader_pass(split_dir, features, cfg))
        ratios = sorted(scan[2] / load[2] for scan, load in zip(scans, loads))
        scan_rows, scan_tokens, scan_s = min(scans, key=lambda x: x[2])
        load_rows, load_tokens, load_s = min(loads, key=lambda x: x[2])
        assert scan_rows == load_rows and scan_tokens == load_tokens, "the loader must see every event once"
        result["loader"] = {
            "sequences_per_s": load_rows / load_s,
            "tokens_per_s": load_tokens / load_s,
            "pyarrow_sequences_per_s": scan_rows / scan_s,
            "pyarrow_tokens_per_s": scan_tokens / scan_s,
            "sequences": load_rows,
            "tokens": load_tokens,
            "config": asdict(cfg),
        }
        result["loader_vs_pyarrow_ratio"] = statistics.median(ratios)
        result["loader_vs_pyarrow_ratio_spread"] = {"median": statistics.median(ratios), "min": ratios[0],
                                                    "max": ratios[-1], "n": len(ratios)}
        cfg_200 = LoaderConfig(batch_size=256, max_seq_len=200, mode="ranking", num_candidates=8)
        rows, tokens, seconds = _loader_pass(split_dir, features, cfg_200)
        result["loader"]["ranking_max_seq_len_200_sequences_per_s"] = rows / seconds
        _log(f"  loader {load_tokens / load_s:,.0f} tokens/s, pyarrow {scan_tokens / scan_s:,.0f} tokens/s, "
             f"ratio {result['loader_vs_pyarrow_ratio']:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
