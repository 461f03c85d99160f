"""`genrec profile train`: where a training step's time goes.

    genrec profile train --config configs/demo.toml --set data.path=runs/data --steps 20 --out runs/profile

runs one warm-up step and `--steps` profiled steps of the real trainer under
`torch.profiler`, then one checkpoint, and writes to `--out`:

    trace.json      Chrome trace (open in chrome://tracing or https://ui.perfetto.dev)
    tensorboard/    the same trace for TensorBoard's profiler plugin
                    (`tensorboard --logdir OUT/tensorboard`)
    summary.md      per-stage table (ms per step, share of the step), top operators by
                    self time, peak memory, MFU against a matmul peak measured in the run
    summary.json    the same figures, machine-readable
    run/            the training run's own directory (checkpoint, config)

Stages are `record_function` ranges the trainer and model always open (they cost about a
microsecond each when no profiler runs): genrec.data (next batch), genrec.sparse_forward
(embedding lookups), genrec.tower, genrec.loss, genrec.backward (loss.backward: the dense
gradients and, inside it, the store's fused sparse update, shown as its own row), genrec.
optimizer, genrec.checkpoint. On more than one rank the collectives appear as their own
operators (all_to_all, allreduce) in the top-operator table.
"""

from __future__ import annotations

import copy
import json
import resource
import shutil
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from genrec.data.files import atomic_write_text, claim_output_dir
from genrec.models.config import JobConfig

STAGES = ("genrec.data", "genrec.sparse_forward", "genrec.tower", "genrec.loss", "genrec.backward",
          "genrec.optimizer", "genrec.checkpoint")
SPARSE_BACKWARD = "_FusedLookupBackward"
PROFILE_FORMAT = "genrec.profile/1"


def profile_training(cfg: JobConfig, steps: int, out: str | Path, overwrite: bool = False) -> dict:
    """Profile `steps` training steps (after one warm-up step) and one checkpoint; returns
    the summary written to OUT/summary.json."""
    from genrec.models.ranks import single_process
    from genrec.models.train.bench import _tower_flops, matmul_peak_gflops
    from genrec.models.train.trainer import Trainer, _Prefetcher

    if steps < 1:
        raise ValueError(f"genrec profile: --steps must be >= 1, got {steps}")
    out = Path(out)
    claim_output_dir(out, overwrite=overwrite, manifest="summary.json", format=PROFILE_FORMAT)
    if overwrite and out.exists():
        shutil.rmtree(out)  # claim_output_dir checked that it is an earlier profile's output
    out.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(cfg)
    cfg.train.out_dir = str(out / "run")
    cfg.train.max_steps, cfg.train.num_epochs = steps + 1, None
    cfg.train.checkpoint_every, cfg.train.eval_every, cfg.train.eval_every_epochs = 10**9, 0, 0
    trainer = Trainer(cfg, single_process())
    batches = _Prefetcher(trainer.loader, enabled=False)
    flops, step_seconds = 0.0, []
    tb_dir = out / "tensorboard"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(tb_dir))) as prof:
        for i in range(steps + 1):
            t0 = time.perf_counter()
            with record_function("genrec.data"):
                batch, loader_state = batches.next()
            trainer.train_step(batch)
            trainer.step += 1
            if i:
                step_seconds.append(time.perf_counter() - t0)
                flops += _tower_flops(cfg, batch)
            prof.step()
    with record_function("genrec.checkpoint"):
        t0 = time.perf_counter()
        trainer.save(loader_state)
        checkpoint_s = time.perf_counter() - t0
    traces = sorted(tb_dir.glob("*.pt.trace.json"))
    if traces:
        shutil.copyfile(traces[-1], out / "trace.json")
    summary = _summarize(prof, steps, step_seconds, flops, matmul_peak_gflops(), checkpoint_s)
    atomic_write_text(out / "summary.json", json.dumps({"format": PROFILE_FORMAT, **summary}, indent=2) + "\n")
    atomic_write_text(out / "summary.md", _markdown(summary))
    return summary


def _summarize(prof, steps: int, step_seconds: list[float], flops: float, peak_gflops: float,
               checkpoint_s: float) -> dict:
    events = {e.key: e for e in prof.key_averages()}
    step_ms = 1e3 * sum(step_seconds) / steps
    stages = []
    for name in STAGES[:-1] + (SPARSE_BACKWARD,):
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
    seconds = sum(step_seconds)
    return {
        "steps": steps, "step_ms": step_ms, "checkpoint_ms": 1e3 * checkpoint_s, "stages": stages, "top_operators": top,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(), "tower_gflops_per_s": flops / seconds / 1e9 if seconds else 0.0,
        "matmul_peak_gflops": peak_gflops, "mfu": flops / seconds / 1e9 / peak_gflops if seconds else 0.0,
    }


def _markdown(s: dict) -> str:
    lines = [f"# Training profile: {s['steps']} steps, {s['step_ms']:.1f} ms per step, {s['threads']} thread(s)", "",
             "| stage | ms per step | share |", "|---|---|---|"]
    lines += [f"| {x['stage']} | {x['ms_per_step']:.2f} | {100 * x['share']:.1f}% |" for x in s["stages"]]
    lines += ["", f"Checkpoint (one save after the profiled steps): {s['checkpoint_ms']:.0f} ms.", "",
              "| top operators (self time) | ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| `{x['operator']}` | {x['self_ms_per_step']:.2f} | {x['calls_per_step']:.1f} |" for x in s["top_operators"]]
    lines += ["", f"Peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB. Tower {s['tower_gflops_per_s']:.2f} GFLOP/s against a "
              f"measured matmul peak of {s['matmul_peak_gflops']:.1f} GFLOP/s: MFU {s['mfu']:.3f}.", "",
              "Open `trace.json` in chrome://tracing or https://ui.perfetto.dev, or "
              "`tensorboard --logdir tensorboard` for the profiler plugin.", ""]
    return "\n".join(lines)
