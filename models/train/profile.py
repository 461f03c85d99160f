"""`genrec profile train|sparse|serve`: where the time of a training step, a store step
or a ranking request goes.

    genrec profile train --config configs/demo.toml --set data.path=runs/data --steps 20 --out runs/profile
    genrec profile sparse --config configs/demo.toml --set data.path=runs/data --steps 20 --out runs/profile-sparse
    genrec profile serve --artifact runs/artifact --data runs/data --steps 50 --out runs/profile-serve

`train` runs one warm-up step and `--steps` profiled steps of the real trainer under
`torch.profiler`, then one checkpoint; `sparse` the store alone on the same batches
(lookup, then the fused update of every row looked up); `serve` one warm-up and `--steps`
requests through the in-process ranker, each the history of a test-split user. Each
writes to `--out`:

    trace.json      Chrome trace (open in chrome://tracing or https://ui.perfetto.dev)
    tensorboard/    the same trace for TensorBoard's profiler plugin
                    (`tensorboard --logdir OUT/tensorboard`)
    summary.md      per-stage table (ms per step, share of the step), top operators by
                    self time, peak memory, MFU against a matmul peak measured in the run
    summary.json    the same figures, machine-readable
    run/            train, sparse: the training run's own directory (checkpoint, config)

Stages are `record_function` ranges the trainer and model always open (they cost about a
microsecond each when no profiler runs): genrec.data (next batch), genrec.sparse_forward
(embedding lookups), genrec.tower, genrec.loss, genrec.backward (loss.backward: the dense
gradients and, inside it, the store's fused sparse update, shown as its own row), genrec.
optimizer, genrec.checkpoint. On more than one rank the collectives appear as their own
operators (all_to_all, allreduce) in the top-operator table. Serving's stages are the
ranker's steps: genrec.serve.history (parse, sort, truncate), .encode (the tower over the
history), .retrieve (filters + top-k over the item index), .rank (the candidates against
the cached history), .respond (the answer).
"""

from __future__ import annotations

import contextlib
import copy
import json
import resource
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from genrec.data.files import atomic_write_text, claim_output_dir, publish_dir, staging_dir
from genrec.models.benchrecord import finish_record, start_record
from genrec.models.config import JobConfig

SPARSE_BACKWARD = "_FusedLookupBackward"
TRAIN_STAGES = ("genrec.data", "genrec.sparse_forward", "genrec.tower", "genrec.loss", "genrec.backward",
                "genrec.optimizer", SPARSE_BACKWARD)
SPARSE_STAGES = ("genrec.data", "genrec.sparse_forward", "genrec.sparse_backward")
SERVE_STAGES = ("genrec.serve.history", "genrec.serve.encode", "genrec.serve.retrieve", "genrec.serve.rank",
                "genrec.serve.respond")
PROFILE_FORMAT = "genrec.profile/1"


@contextlib.contextmanager
def _output(out: str | Path, steps: int, overwrite: bool) -> Iterator[tuple[Path, dict]]:
    """A staging folder for the profile, and the record of the conditions it starts under.
    The profile replaces `out` (an earlier profile, with --overwrite) only once it is
    written: one refused or failing on the way (a wrong data.path, no artifact) leaves `out`
    as it was and nothing of its own."""
    if steps < 1:
        raise ValueError(f"genrec profile: --steps must be >= 1, got {steps}")
    out = claim_output_dir(out, overwrite=overwrite, manifest="summary.json", format=PROFILE_FORMAT)
    tmp = staging_dir(out)
    try:
        yield tmp, start_record()
        publish_dir(tmp, out, manifest="summary.json", format=PROFILE_FORMAT)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _profiled(out: Path, steps: int, step: Callable[[int], None]) -> tuple[profile, list[float]]:
    """Run step(0) (warm-up) .. step(steps) under the profiler; the Chrome trace goes to
    OUT/trace.json, the TensorBoard profile to OUT/tensorboard; returns the profiler and
    the profiled steps' wall seconds."""
    tb_dir = out / "tensorboard"
    seconds: list[float] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(tb_dir))) as prof:
        for i in range(steps + 1):
            t0 = time.perf_counter()
            step(i)
            if i:
                seconds.append(time.perf_counter() - t0)
            prof.step()
    traces = sorted(tb_dir.glob("*.pt.trace.json"))
    if traces:
        shutil.copyfile(traces[-1], out / "trace.json")
    return prof, seconds


def _write(out: Path, target: str, summary: dict, record: dict) -> dict:
    """summary.json (with the conditions it was taken under, as a bench JSON has) and summary.md."""
    summary = {"format": PROFILE_FORMAT, "target": target, **summary, "conditions": finish_record(record)}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    atomic_write_text(out / "summary.md", _markdown(summary))
    return summary


def _trainer(cfg: JobConfig, steps: int, out: Path):
    from genrec.models.ranks import single_process
    from genrec.models.train.trainer import Trainer, _Prefetcher

    cfg = copy.deepcopy(cfg)
    cfg.train.out_dir = str(out / "run")
    cfg.train.max_steps, cfg.train.num_epochs = steps + 1, None
    cfg.train.checkpoint_every, cfg.train.eval_every, cfg.train.eval_every_epochs = 10**9, 0, 0
    trainer = Trainer(cfg, single_process())
    return cfg, trainer, _Prefetcher(trainer.loader, enabled=False)


def profile_training(cfg: JobConfig, steps: int, out: str | Path, overwrite: bool = False) -> dict:
    """Profile `steps` training steps (after one warm-up step) and one checkpoint; returns
    the summary written to OUT/summary.json."""
    from genrec.models.train.bench import _tower_flops, _tower_matmul_params, matmul_peak_gflops

    with _output(out, steps, overwrite) as (out, record):
        cfg, trainer, batches = _trainer(cfg, steps, out)
        matmul_params = _tower_matmul_params(cfg)  # once, not inside the profiled steps
        flops, loader_state = 0.0, None

        def step(i: int) -> None:
            nonlocal flops, loader_state
            with record_function("genrec.data"):  # the batch, and the read-ahead of the next one's SSD rows
                batch, loader_state, upcoming = batches.next()
                trainer.read_ahead_next(upcoming)
            trainer.train_step(batch)
            trainer.step += 1
            if i:
                flops += _tower_flops(cfg, batch, matmul_params)

        prof, step_seconds = _profiled(out, steps, step)
        with record_function("genrec.checkpoint"):
            t0 = time.perf_counter()
            trainer.save(loader_state)
            checkpoint_s = time.perf_counter() - t0
        summary = _summarize(prof, steps, step_seconds, TRAIN_STAGES)
        seconds, peak = sum(step_seconds), matmul_peak_gflops()
        summary.update(checkpoint_ms=1e3 * checkpoint_s, tower_gflops_per_s=flops / seconds / 1e9,
                       matmul_peak_gflops=peak, mfu=flops / seconds / 1e9 / peak)
        return _write(out, "train", summary, record)


def profile_sparse(cfg: JobConfig, steps: int, out: str | Path, overwrite: bool = False) -> dict:
    """The store alone on the run's own batches: each step looks up every history feature
    (genrec.sparse_forward) and sends a gradient back through the fused update
    (genrec.sparse_backward); no tower, no loss, no dense optimizer."""
    from genrec.models.build import unwrap

    with _output(out, steps, overwrite) as (out, record):
        _, trainer, batches = _trainer(cfg, steps, out)
        embeddings = unwrap(trainer.model).embeddings
        lookups = 0

        def step(i: int) -> None:
            nonlocal lookups
            with record_function("genrec.data"):
                batch, _, upcoming = batches.next()
                if upcoming is not None and trainer.read_ahead:
                    embeddings.read_ahead([upcoming.history])
            if batch.num_tokens:
                trainer.store.set_event_time(int(batch.timestamps_T.max()))
            with record_function("genrec.sparse_forward"):
                rows = embeddings(batch.history)
            loss = sum(0.5 * jt.values().square().sum() for jt in rows.values())
            with record_function("genrec.sparse_backward"):
                loss.backward()  # d loss / d row = the row: a real update of every row looked up
            if i:
                lookups += batch.history.values().numel()

        prof, step_seconds = _profiled(out, steps, step)
        summary = _summarize(prof, steps, step_seconds, SPARSE_STAGES)
        summary["lookups_per_s"] = lookups / sum(step_seconds)
        return _write(out, "sparse", summary, record)


def profile_serving(artifact: str | Path, data: str | Path, steps: int, out: str | Path,
                    overwrite: bool = False, k: int = 100) -> dict:
    """`steps` ranking requests (after one warm-up) through the in-process ranker, each the
    history of one test-split user of the prepared `data` (minus its last event), `k`
    candidates retrieved and ranked."""
    from genrec.models.serving.ranker import load_artifact
    from genrec.models.serving.requests import split_requests

    with _output(out, steps, overwrite) as (out, record):
        ranker = load_artifact(artifact)
        requests = split_requests(data, ranker.features, steps + 1)
        if not requests:
            raise ValueError(f"genrec profile serve: {data}/test holds no users")
        k = min(k, ranker.max_k)

        def step(i: int) -> None:
            ranker.rank({**requests[i % len(requests)], "k": k, "n": min(10, k), "exclude_seen": True})

        prof, step_seconds = _profiled(out, steps, step)
        summary = _summarize(prof, steps, step_seconds, SERVE_STAGES)
        summary["candidates_per_request"] = k
        return _write(out, "serve", summary, record)


def _summarize(prof, steps: int, step_seconds: list[float], stage_names: tuple[str, ...]) -> dict:
    events = {e.key: e for e in prof.key_averages()}
    step_ms = 1e3 * sum(step_seconds) / steps
    stages = []
    for name in stage_names:
        e = events.get(name)
        ms = (e.cpu_time_total / 1e3 / steps) if e is not None else 0.0
        label = "genrec.sparse_backward (inside genrec.backward)" if name == SPARSE_BACKWARD else name
        stages.append({"stage": label, "ms_per_step": ms, "share": ms / step_ms if step_ms else 0.0})
    covered = sum(s["ms_per_step"] for s in stages if "inside" not in s["stage"])
    stages.append({"stage": "other (Python between stages)", "ms_per_step": max(step_ms - covered, 0.0),
                   "share": max(step_ms - covered, 0.0) / step_ms if step_ms else 0.0})
    ops = sorted((e for e in prof.key_averages() if not e.key.startswith(("genrec.", "ProfilerStep"))
                  and e.key != SPARSE_BACKWARD), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    top = [{"operator": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
           for e in ops]
    return {
        "steps": steps, "step_ms": step_ms, "stages": stages, "top_operators": top,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
    }


def _markdown(s: dict) -> str:
    what = {"train": "Training profile", "sparse": "Sparse store profile", "serve": "Serving profile"}[s["target"]]
    unit = "request" if s["target"] == "serve" else "step"
    lines = [f"# {what}: {s['steps']} {unit}s, {s['step_ms']:.1f} ms per {unit}, {s['threads']} thread(s)", "",
             f"| stage | ms per {unit} | share |", "|---|---|---|"]
    lines += [f"| {x['stage']} | {x['ms_per_step']:.2f} | {100 * x['share']:.1f}% |" for x in s["stages"]]
    if "checkpoint_ms" in s:
        lines += ["", f"Checkpoint (one save after the profiled steps): {s['checkpoint_ms']:.0f} ms."]
    lines += ["", f"| top operators (self time) | ms per {unit} | calls per {unit} |", "|---|---|---|"]
    lines += [f"| `{x['operator']}` | {x['self_ms_per_step']:.2f} | {x['calls_per_step']:.1f} |" for x in s["top_operators"]]
    tail = f"Peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB."
    if "mfu" in s:
        tail += (f" Tower {s['tower_gflops_per_s']:.2f} GFLOP/s against a measured matmul peak of "
                 f"{s['matmul_peak_gflops']:.1f} GFLOP/s: MFU {s['mfu']:.3f}.")
    if "lookups_per_s" in s:
        tail += f" {s['lookups_per_s'] / 1e6:.2f}M lookups (and their updates) per second."
    lines += ["", tail, "", "Open `trace.json` in chrome://tracing or https://ui.perfetto.dev, or "
              "`tensorboard --logdir tensorboard` for the profiler plugin.", ""]
    return "\n".join(lines)
