"""The README's measured tables, rendered from the bench JSONs recorded in configs/figures/.

    genrec bench sparse --json configs/figures/sparse.json              # record (full)
    genrec bench sparse --quick --json configs/figures/sparse-quick.json
    genrec bench readme                  # rewrite the README's tables from the records
    genrec bench readme --check          # exit 1 when the README and the records disagree

Each table sits in the README between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`
and is replaced whole, so the text cannot drift from the measurements: a test renders the
records and compares. A cell is the record's median with [min, max] over its repeats where
the bench kept them (`KEY_spread`); under each table, the conditions of every record (commit,
load average before and after, threads). A figure a record lacks is "-", never a guess.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from genrec.data.files import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
FIGURES_DIR = ROOT / "configs" / "figures"
README = ROOT / "README.md"

# table: (records as columns, [(row label, key, target)]). A key is dotted into nested dicts;
# a target is ">= x", "> x", "<= x" or "< x", judged on the full run's median (the quick one's without it).
TABLES: dict[str, tuple[tuple[str, ...], list[tuple[str, str, str | None]]]] = {
    "sparse": (("sparse-quick", "sparse"), [
        ("`hot_path_ratio`: lookup + fused row-wise Adagrad, host tier, vs the raw ops", "hot_path_ratio", ">= 0.8"),
        ("`hot_path_ratio_default_config`: default tiers (65,536 device + host), TTL on",
         "hot_path_ratio_default_config", ">= 0.6"),
        ("store rows/s on the hot path (host tier)", "hot_path_rows_per_s", None),
        ("`rows_per_s_fbgemm_cpu_tbe`: fbgemm's CPU TBE, exact row-wise Adagrad, same ids",
         "rows_per_s_fbgemm_cpu_tbe", None),
        ("`index_bytes_per_row` (its peak during growth)", "index_bytes_per_row", "<= 16"),
        ("`index_peak_bytes_per_row`", "index_peak_bytes_per_row", None),
        ("`offload_ratio`: demo-size tower steps, table 10x the host cache, rest on SSD (cold), "
         "vs all in memory", "offload_ratio", ">= 0.75"),
        ("offload step, ms", "offload_step_ms", None),
        ("all-in-memory step, ms", "offload_memory_step_ms", None),
        ("`ssd_bytes_read` over the offload windows (/proc/self/io)", "offload_ssd_bytes_read", None),
        ("`ssd_bytes_written` over the offload windows", "offload_ssd_bytes_written", None),
        ("`offload_ratio_store_only`: the same without the tower (the store's worst case)",
         "offload_ratio_store_only", None),
        ("`ssd_read_rows_per_s` (dim 64, page cache included)", "ssd_read_rows_per_s", None),
        ("`ssd_read_rows_per_s_cold` (evicted from the page cache before each gather)",
         "ssd_read_rows_per_s_cold", None),
        ("`ssd_write_rows_per_s`", "ssd_write_rows_per_s", None),
        ("`incremental_snapshot_ratio`: delta snapshot, 1% of rows changed, vs a full one",
         "incremental_snapshot_ratio", "<= 0.05"),
        ("snapshot: rows of the table (dim 64)", "snapshot_table_rows", None),
        ("scale run: rows materialized (dim 64)", "scale.rows", None),
        ("scale run: rows/s while materializing", "scale.materialize_rows_per_s", None),
        ("scale run: bytes on disk", "scale.disk_bytes", None),
        ("scale run: anonymous RSS (heap), bytes", "scale.rssanon_bytes", None),
        ("scale run: index bytes", "scale.index_bytes", None),
    ]),
    "dense": (("dense-quick", "dense"), [
        ("`hstu_vs_transformer_256` (HSTU tokens/s over the Transformer's)", "hstu_vs_transformer_256", None),
        ("`hstu_vs_transformer_1024`", "hstu_vs_transformer_1024", ">= 1.1"),
        ("`hstu_vs_transformer_4096`", "hstu_vs_transformer_4096", ">= 1.3"),
        ("HSTU forward + backward tokens/s at 1,024", "hstu_tokens_per_s_1024", None),
        ("HSTU forward + backward tokens/s at 4,096", "hstu_tokens_per_s_4096", None),
        ("`hstu_tokens_per_s_128x200x50` (full rows, 2 layers, 1 head, fp32)", "hstu_tokens_per_s_128x200x50",
         ">= 300000"),
        ("SDPA Transformer tokens/s, 128 x 200 x 50", "transformer_tokens_per_s_128x200x50", None),
        ("`hstu_tokens_per_s_8x2048x64` (bf16)", "hstu_tokens_per_s_8x2048x64", ">= 120000"),
        ("SDPA Transformer tokens/s, 8 x 2048 x 64 (bf16)", "transformer_tokens_per_s_8x2048x64", None),
        ("HSTU tokens/s, 8 x 2048 x 64 in fp32", "hstu_tokens_per_s_8x2048x64_fp32", None),
        ("`jagged_vs_padded` (mean length = max / 4; padded: every row computed at the longest's length)",
         "jagged_vs_padded", ">= 1.5"),
        ("`bucketed_vs_one_bucket` (the same jagged batch in length buckets vs one bucket)",
         "bucketed_vs_one_bucket", None),
        ("`checkpointing_memory_ratio` (bytes saved for backward, 4 layers)", "checkpointing_memory_ratio", None),
        ("`kv_cache_speedup_1024` (encode once + 1,024 candidates vs re-encode per 256)",
         "kv_cache_speedup_1024", None),
        ("`stochastic_length_speedup_4096` (rows of 4,096 events, cut with probability 0.5)",
         "stochastic_length_speedup_4096", None),
        ("share of the tokens stochastic length keeps", "stochastic_length_tokens_kept_4096", None),
    ]),
    "data": (("data-quick", "data"), [
        ("`prepare_events_per_s` (largest log)", "prepare_events_per_s", None),
        ("`prepare_peak_rss_gb` (512 MB budget)", "prepare_peak_rss_gb", None),
        ("`prepare_rss_growth` (peak at 10M events / at 3M)", "prepare_rss_growth", None),
        ("`loader_vs_pyarrow_ratio` (loader vs a plain pyarrow scan)", "loader_vs_pyarrow_ratio", None),
    ]),
    "train": (("train-quick", "train"), [
        ("`samples_per_s_1rank`", "samples_per_s_1rank", None),
        ("`samples_per_s_2rank` (2 gloo ranks, one thread each)", "samples_per_s_2rank", None),
        ("`scaling_2rank_vs_1rank`", "scaling_2rank_vs_1rank", ">= 1.7"),
        ("`scaling_2rank_vs_1rank_ml100k` (the ML-100K config: 128 rows of up to 200 events per rank)",
         "scaling_2rank_vs_1rank_ml100k", ">= 1.7"),
        ("two 1-rank runs side by side, no communication: their samples/s added, vs 1 rank",
         "scaling_2independent_vs_1rank", None),
        ("the same, twice the slower one's (the most 2 ranks in lock step get here)",
         "scaling_2independent_slower_vs_1rank", None),
        ("2 ranks on the same batches (no imbalance) vs 1 rank", "scaling_2rank_same_batches_vs_1rank", None),
        ("of the ideal 2: lost to the shared machine", "scaling_lost_to.shared_machine", None),
        ("of the ideal 2: lost to communication (collectives, the store's exchange, DDP)",
         "scaling_lost_to.communication", None),
        ("of the ideal 2: lost to batch imbalance (the other rank's longer batches)",
         "scaling_lost_to.batch_imbalance", None),
        ("ML-100K ms per step, 1 rank", "per_step_ms_ml100k.1rank", None),
        ("ML-100K ms per step, 2 ranks", "per_step_ms_ml100k.2rank", None),
        ("ms per step, 1 rank", "per_step_ms_1rank.step", None),
        ("ms per step, 2 ranks", "per_step_ms_2rank.step", None),
        ("ms per step off the CPU (waiting, preempted), 1 rank", "per_step_ms_1rank.waiting", None),
        ("ms per step off the CPU (waiting for the other rank, preempted), 2 ranks", "per_step_ms_2rank.waiting", None),
        ("CPU ms per step of the rank's other threads, 1 rank", "per_step_ms_1rank.helper_threads_cpu", None),
        ("CPU ms per step of the rank's other threads (gloo's I/O loop and workers), 2 ranks",
         "per_step_ms_2rank.helper_threads_cpu", None),
        ("times per step the training thread was preempted, 1 rank", "per_step_ms_1rank.preemptions", None),
        ("times per step the training thread was preempted, 2 ranks", "per_step_ms_2rank.preemptions", None),
        ("2 ranks: all-to-alls per step (the store's exchanges)", "per_step_ms_2rank.alltoall_calls", None),
        ("2 ranks: ms per step in all-to-alls waiting for the other rank to arrive",
         "per_step_ms_2rank.alltoall_wait_for_other_rank", None),
        ("2 ranks: ms per step in all-to-alls once both ranks are in", "per_step_ms_2rank.alltoall_own", None),
        ("2 ranks: ms per step still waiting for the backward's all-to-all after the dense optimizer step",
         "per_step_ms_2rank.alltoall_deferred_blocked", None),
        ("2 ranks: median ms of one all-to-all once both ranks are in",
         "per_step_ms_2rank.alltoall_own_median_per_call", None),
        ("2 ranks, alone: ms of one all-to-all of one int64 per rank (latency only)", "per_step_ms_2rank.alltoall_floor", None),
        ("2 ranks, alone: CPU ms of the rank's other threads per such all-to-all",
         "per_step_ms_2rank.alltoall_floor_helper_cpu", None),
        ("2 ranks, alone: ms of one all-reduce of the dense gradients", "per_step_ms_2rank.allreduce_floor", None),
        ("2 ranks, alone: CPU ms of the rank's other threads per such all-reduce",
         "per_step_ms_2rank.allreduce_floor_helper_cpu", None),
        ("2 ranks: all-reduces per step (DDP's buckets)", "per_step_ms_2rank.allreduce_calls", None),
        ("2 ranks: ms per step the step's collectives take alone (each kind's calls x its floor)",
         "per_step_ms_2rank.collectives_floor", None),
        ("2 ranks, under the profiler: all-to-all spans, ms per step", "per_step_ms_2rank.alltoall", None),
        ("2 ranks, under the profiler: DDP all-reduce spans (beside the backward)", "per_step_ms_2rank.allreduce", None),
        ("2 ranks, under the profiler: the rest of the step", "per_step_ms_2rank.compute", None),
        ("`mfu` (of the measured one-thread fp32 matmul peak)", "mfu", None),
        ("`step_time_shares.sparse_lookup`", "step_time_shares.sparse_lookup", None),
    ]),
    "serve": (("serve-quick", "serve"), [
        ("`p50_ms`, single stream over HTTP (int8 artifact)", "p50_ms", None),
        ("`p99_ms`", "p99_ms", "< 25"),
        ("`qps` (4 clients)", "qps", ">= 100"),
        ("`p99_ms_under_load` (4 clients)", "p99_ms_under_load", "< 100"),
        ("`qps_16_clients`", "qps_16_clients", None),
        ("`p99_ms_under_load_16_clients`", "p99_ms_under_load_16_clients", None),
        ("`server_batch_size_mean_under_load` (4 clients)", "server_batch_size_mean_under_load", None),
        ("`fp32_p50_ms` (the fp32 artifact of the same model)", "fp32_p50_ms", None),
        ("`fp32_p99_ms`", "fp32_p99_ms", None),
        ("`fp32_qps`", "fp32_qps", None),
        ("`mfalcon_speedup` (cached history vs recompute per candidate)", "mfalcon_speedup", ">= 10"),
        ("`int8_vs_fp32_latency_ratio`", "int8_vs_fp32_latency_ratio", None),
        ("`int8_vs_fp32_memory_ratio`", "int8_vs_fp32_memory_ratio", "<= 0.35"),
        ("`cold_disk_p99_ms` (in process, tables read from the disk: pages dropped before each request)",
         "cold_disk_p99_ms", None),
        ("`cold_disk_cached_p99_ms` (the same, a hot-row cache of a quarter of the table)",
         "cold_disk_cached_p99_ms", None),
        ("`delta_apply_s` (a delta of 1% of the item rows)", "delta_apply_s", "< 1"),
        ("`ann_num_items` (approximate index, clustered vectors)", "ann_num_items", None),
        ("`recall_at_500_vs_exact` (calibrated nprobe)", "recall_at_500_vs_exact", ">= 0.95"),
        ("`ann_retrieve_p99_ms` (one query's search)", "ann_retrieve_p99_ms", "< 30"),
        ("`ann_build_s`", "ann_build_s", None),
    ]),
}
CONSISTENT = {
    "sparse": ("hot_path_ratio", "hot_path_ratio_default_config", "index_bytes_per_row"),
    "dense": ("hstu_vs_transformer_256", "hstu_vs_transformer_1024", "jagged_vs_padded"),
    "data": ("loader_vs_pyarrow_ratio",),
}
"""Ratios a quick bench must reproduce: within QUICK_TOLERANCE of its full run's (the others
depend on size by design: the full runs are larger tables, histories and corpora)."""
QUICK_TOLERANCE = 0.2
QUALITY_SEEDS = ("quality-s0", "quality-s1", "quality-s2")
PROFILES = ("profile-train", "profile-serve")
"""`genrec profile` summaries (summary.json) copied here; rendered in blocks profile_train, profile_serve."""


def load_records(directory: Path = FIGURES_DIR) -> dict[str, dict]:
    records = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            records[path.stem] = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: not a bench JSON ({e})") from None
    return records


def lookup(record: dict | None, key: str):
    node = record
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def fmt(x: float) -> str:
    a = abs(x)
    if a >= 1e9:
        return f"{x / 1e9:.2f}G"
    if a >= 1e6:
        return f"{x / 1e6:.2f}M"
    if a >= 1e4:
        return f"{x / 1e3:.1f}K"
    if a >= 100:
        return f"{x:.0f}"
    return f"{x:.2f}" if a >= 1 else f"{x:.3g}"


def cell(record: dict | None, key: str) -> str:
    value = lookup(record, key)
    if value is None:
        return "-"
    spread = (record or {}).get(key + "_spread")
    if isinstance(spread, dict) and {"min", "max"} <= spread.keys():
        return f"{fmt(value)} [{fmt(spread['min'])}, {fmt(spread['max'])}]"
    return fmt(value)


def meets(value: float | None, target: str | None) -> str:
    if target is None or value is None:
        return target or ""
    op, bound = target.split()
    ok = {">=": value >= float(bound), ">": value > float(bound), "<=": value <= float(bound),
          "<": value < float(bound)}[op]
    return f"{target} ({'met' if ok else 'missed'})"


def conditions(name: str, record: dict | None) -> str:
    if record is None:
        return f"`{name}`: not recorded"
    c = record.get("conditions", {})
    before, after = (c.get("load_average_before") or [None])[0], (c.get("load_average_after") or [None])[0]
    load = f"load average {before:.2f} before, {after:.2f} after" if before is not None and after is not None \
        else "load not recorded"
    full = c.get("git_commit") or "unknown"
    commit = full[:7] + ("+dirty" if full.endswith("+dirty") else "")
    # The bench's own setting where it has one (benches pin their threads while they run).
    threads = next((record[k] for k in ("torch_threads", "threads", "threads_per_rank")
                    if isinstance(record.get(k), int)), (c.get("threads") or {}).get("torch"))
    took = f", {c['seconds']:.0f} s" if isinstance(c.get("seconds"), (int, float)) else ""
    # Records come from whichever machine took them: figures of two CPUs are not comparable.
    cpu = (c.get("cpu") or {}).get("model")
    flags = (c.get("cpu") or {}).get("flags")
    if cpu and flags is not None:  # the native kernels' build differs with and without AVX-512
        cpu += " with AVX-512" if "avx512f" in flags else " without AVX-512"
    # A record measured above the quiet load (`--allow-noisy`) says so wherever it is shown.
    noisy = ", taken noisy (`--allow-noisy`)" if record.get("taken_noisy") else ""
    return f"`{name}`: {cpu + ', ' if cpu else ''}commit {commit}, {load}, {threads} thread(s){took}{noisy}"


def render_table(name: str, records: dict[str, dict]) -> str:
    columns, rows = TABLES[name]
    head = "| figure | " + " | ".join(f"`{c}`" for c in columns) + " | target |"
    lines = [head, "|---|" + "---|" * len(columns) + "---|"]
    for label, key, target in rows:
        judged = next((v for c in reversed(columns) if (v := lookup(records.get(c), key)) is not None), None)
        cells = " | ".join(cell(records.get(c), key) for c in columns)
        lines.append(f"| {label} | {cells} | {meets(judged, target)} |")
    lines.append("")
    lines.append("Recorded in `configs/figures/` (median [min, max] over each bench's repeats): "
                 + "; ".join(conditions(c, records.get(c)) for c in columns) + ".")
    return "\n".join(lines)


def render_quality(records: dict[str, dict]) -> str:
    lines = ["| record | seed | test HR@10 [95% CI] | test NDCG@10 [95% CI] | best step | `train_wall_s` "
             "| `tokens_per_s` | `seconds_to_hr10_0p08` |", "|---|---|---|---|---|---|---|---|"]
    present = [(n, records[n]) for n in QUALITY_SEEDS if n in records]
    for name, r in present:
        ci = lambda k: "[{}, {}]".format(*(f"{v:.4f}" for v in r[k])) if r.get(k) else ""  # noqa: E731
        lines.append(f"| `{name}` | {r.get('seed')} | {r['hr_at_10']:.4f} {ci('hr_at_10_ci95')} "
                     f"| {r['ndcg_at_10']:.4f} {ci('ndcg_at_10_ci95')} "
                     f"| {(r.get('best_checkpoint') or {}).get('step', '-')} | {fmt(r['train_wall_s'])} "
                     f"| {fmt(r['tokens_per_s'])} | {cell(r, 'seconds_to_hr10_0p08')} |")
    if present:
        med = lambda k: statistics.median(r[k] for _, r in present)  # noqa: E731
        lines.append(f"| median | | **{med('hr_at_10'):.4f}** | **{med('ndcg_at_10'):.4f}** | | "
                     f"{fmt(med('train_wall_s'))} | {fmt(med('tokens_per_s'))} | |")
    lines.append("")
    lines.append("Recorded in `configs/figures/`: "
                 + "; ".join(conditions(n, records.get(n)) for n in QUALITY_SEEDS) + ".")
    return "\n".join(lines)


def render_profile(records: dict[str, dict], name: str) -> str:
    r = records.get(name)
    if r is None:
        return f"`{name}`: not recorded"
    unit = "request" if r.get("target") == "serve" else "step"
    lines = [f"| stage | ms per {unit} | share |", "|---|---|---|"]
    lines += [f"| {x['stage']} | {x['ms_per_step']:.1f} | {100 * x['share']:.1f}% |" for x in r["stages"]]
    mfu = f", MFU {r['mfu']:.3f} of a measured {r['matmul_peak_gflops']:.0f} GFLOP/s matmul peak" if "mfu" in r else ""
    lines += ["", f"{r['steps']} profiled {unit}s, {r['step_ms']:.1f} ms per {unit}, {r['threads']} thread(s), peak "
              f"RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB{mfu}. Recorded in `configs/figures/`: {conditions(name, r)}."]
    return "\n".join(lines)


RENDERERS = {"quality": render_quality,
             **{name.replace("-", "_"): (lambda records, n=name: render_profile(records, n)) for name in PROFILES}}


def render(name: str, records: dict[str, dict]) -> str:
    return RENDERERS[name](records) if name in RENDERERS else render_table(name, records)


_BLOCK = re.compile(r"(<!-- figures:(\w+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.S)


def update(text: str, records: dict[str, dict]) -> str:
    """`text` with every figures block re-rendered from `records`."""
    names = re.findall(r"<!-- figures:(\w+) -->", text)
    for name in names:
        if name not in TABLES and name not in RENDERERS:
            raise ValueError(f"README: unknown figures block {name!r} (known: {sorted([*TABLES, *RENDERERS])})")
        if f"<!-- /figures:{name} -->" not in text:
            raise ValueError(f"README: figures block {name!r} has no closing <!-- /figures:{name} -->")
    return _BLOCK.sub(lambda m: m.group(1) + render(m.group(2), records) + "\n" + m.group(4), text)


def quick_vs_full(records: dict[str, dict]) -> list[str]:
    """One line per consistency ratio that a recorded quick/full pair gets wrong."""
    problems = []
    for bench, keys in CONSISTENT.items():
        quick, full = records.get(f"{bench}-quick"), records.get(bench)
        if quick is None or full is None:
            continue
        for key in keys:
            q, f = lookup(quick, key), lookup(full, key)
            if q is None or f is None:
                problems.append(f"{bench}.{key}: missing from the quick or the full record")
            elif abs(q / f - 1) > QUICK_TOLERANCE:
                problems.append(f"{bench}.{key}: quick {q:.3g} vs full {f:.3g} ({q / f - 1:+.0%})")
    return problems


def command(check_only: bool, readme: Path = README, directory: Path = FIGURES_DIR) -> int:
    text = readme.read_text()
    new = update(text, load_records(directory))
    if check_only:
        if new != text:
            print(f"genrec bench readme: {readme} disagrees with {directory}; run `genrec bench readme`")
            return 1
        print(f"genrec bench readme: {readme} matches {directory}")
        return 0
    if new != text:
        atomic_write_text(readme, new)
    print(f"genrec bench readme: {'rewrote' if new != text else 'unchanged'} {readme}")
    return 0
