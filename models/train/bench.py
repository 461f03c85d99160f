"""`genrec bench train`: training throughput on 1 and 2 CPU ranks, MFU, step-time shares.

One run, side by side: the same synthetic ad log and model (the demo's, smaller) trained
for a fixed number of steps by one rank and by two gloo ranks (`torchrun`-style env, same
per-rank batch). Every rank is a fresh process started the same way, with the settings
`genrec` applies to its processes, and runs as many warm-up steps as it times. The same
comparison runs on the ML-100K config (`ML100K`) over whole epochs. MFU divides the dense
tower's model FLOPs per second (6 x params x tokens for the projections, plus the
attention's pairwise products) by a matmul peak measured in the same run on the same
machine. Step-time shares come from timing the parts of a 1-rank step: the sparse store's
forward + fused backward, the rest of the step (dense compute and optimizer), and for 2
ranks the extra time over 1 rank (communication and waiting). Every rank runs one thread
(`train.num_threads = 1`), so 1 vs 2 ranks compares ranks, not thread counts. 1 and 2
ranks take turns ROUNDS[quick] times; `scaling_2rank_vs_1rank` is the median round's
(`_spread`: over the rounds), and the other figures are that round's. `per_step_ms_2rank`
splits a 2-rank step (rank 0, a few steps under the profiler) into the spans of the
store's all-to-alls, DDP's all-reduce (beside the backward) and the rest; from the timed
steps themselves (no profiler), it splits the time in the store's all-to-alls into waiting
for the other rank to arrive and the collective's own time once both are in. Each demo
round also runs two 1-rank runs side by side and 2 ranks on the same batches, which split
what 2 ranks lose against twice 1 rank into the shared machine, communication and batch
imbalance (`_scaling_breakdown`). Per step it also counts the CPU time of each rank's other
threads (gloo's I/O loop and workers, which share the cores) and how often the training
thread was preempted, and times the step's collectives alone between the same ranks
(`_collective_floor`): the least they cost whatever the store and DDP do.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "demo.toml"
ROUNDS = {True: 2, False: 3}
"""Rounds of 1 rank then 2 ranks, by `quick` (each round starts three processes)."""
ML100K_CONFIG = REPO / "configs" / "ml100k.toml"
ML100K = Path(os.environ.get("GENREC_ML100K_UDATA", REPO.parent / "shared" / "data" / "ml-100k" / "u.data"))
"""MovieLens-100K's u.data, for the second scaling figure (its config's batch of 128 rows of
up to 200 events against the whole corpus: a step about ten times the demo's, 258 against
27 ms in the full record)."""
ML100K_EPOCHS = {True: 2, False: 4}
"""Whole epochs timed per run on ML-100K, by `quick`: its 943 users' histories run from 20
to 200 events, so runs over different batches would compare different work."""


def matmul_peak_gflops(n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e9


def _overrides(data: Path, out: Path, steps: int, demo: bool = True) -> list[str]:
    common = [f'data.path="{data}"', f'train.out_dir="{out}"', f"train.max_steps={steps}",
              "train.checkpoint_every=1000000", "train.tensorboard=false", "train.log_every=1000000",
              "train.optim.warmup_steps=0", "train.num_threads=1"]
    demo_sizes = ["data.loader.batch_size=32", "data.loader.max_seq_len=64", "dense.max_seq_len=80"]
    return common + (demo_sizes if demo else [])


def _tower_flops(cfg, batch, matmul_params: int) -> float:
    """Forward+backward FLOPs of the tower on one batch (3x the forward); `matmul_params`:
    `_tower_matmul_params(cfg)`."""
    d = cfg.dense
    per_token = 2 * matmul_params
    lengths = batch.history_lengths_B.double()
    if batch.candidates is not None:
        lengths = lengths + batch.candidates.lengths()[: batch.batch_size].double()
    pairs = float((lengths * (lengths + 1) / 2).sum())
    attention = 2 * pairs * d.num_heads * (d.attention_dim + d.linear_dim) * d.num_layers
    return 3 * (per_token * float(lengths.sum()) + attention)


def _tower_matmul_params(cfg) -> int:
    """Weights of the tower's matmuls (its 2-D parameters), from a tower built once."""
    from genrec.dense import build_tower

    return sum(p.numel() for p in build_tower(cfg.dense).parameters() if p.ndim == 2)


def _cycle(loader):
    while True:  # one epoch per pass: tiny data runs out before the timed steps do
        yield from loader


def _time_ranks(cfg_path: Path, overrides: list[str], steps: int, warmup: int, same_batches: bool = False) -> dict:
    """This process is one rank of a run (its env says which): `warmup` steps, then `steps`
    timed, also timing the store's lookups and counting tokens and FLOPs (rank 0's go in
    the results). With several
    ranks, a few more steps under the profiler give the gloo collectives' spans (waiting for
    the other rank included; DDP's all-reduce runs beside the backward). `same_batches`:
    every rank reads rank 0's batches, so the ranks' work is equal step by step."""
    from torch.profiler import ProfilerActivity, profile

    from genrec.models.config import JobConfig
    from genrec.models.config_loader import load_config
    from genrec.models.train.distributed import init_distributed
    from genrec.models.train.trainer import Trainer

    cfg = load_config(JobConfig, cfg_path, overrides)
    trainer = Trainer(cfg, init_distributed())
    if same_batches:
        from genrec.data.loader import make_loader

        trainer.loader = make_loader(Path(cfg.data.path) / "train", cfg.data.features, cfg.data.loader, rank=0,
                                     world_size=trainer.dist.world_size)
    store, sparse_s = trainer.store, [0.0]
    lookup = store._lookup  # what forward and lookup_many both call

    def timed_lookup(*args, **kwargs):
        t0 = time.perf_counter()
        out = lookup(*args, **kwargs)
        sparse_s[0] += time.perf_counter() - t0
        return out

    store._lookup = timed_lookup
    batches = _cycle(trainer.loader)
    for _ in range(warmup):
        trainer.train_step(next(batches))
    # Built once, outside the timed steps: a tower per step added about 1 ms to each.
    matmul_params = _tower_matmul_params(cfg)
    sparse_s[0], flops, samples, tokens = 0.0, 0.0, 0, 0
    exchanges: list[tuple[float, float]] = []
    blocked: list[float] = []  # seconds in each wait() of an all-to-all started with async_op
    all_to_all = torch.distributed.all_to_all_single

    def timed_all_to_all(*args, **kwargs):  # the store's exchanges: when this rank entered and left each
        t = time.perf_counter()
        out = all_to_all(*args, **kwargs)
        if kwargs.get("async_op"):  # the backward's gradients, waited for after the dense step
            return _TimedWork(out, blocked)
        exchanges.append((t, time.perf_counter()))
        return out

    torch.distributed.all_to_all_single = timed_all_to_all
    helpers0, preempted0 = _helper_threads_cpu(), _preemptions()
    t0, cpu0 = time.perf_counter(), time.thread_time()
    try:
        for _ in range(steps):
            batch = next(batches)
            trainer.train_step(batch)
            flops += _tower_flops(cfg, batch, matmul_params)
            samples += batch.batch_size
            tokens += batch.num_tokens
    finally:
        torch.distributed.all_to_all_single = all_to_all
    out = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.thread_time() - cpu0, "samples": samples,
           "tokens": tokens, "flops": flops, "sparse_forward_s": sparse_s[0]}
    out["helper_threads_cpu_s"] = _helper_cpu_since(helpers0)
    out["preemptions"] = _preemptions() - preempted0
    if trainer.dist.world_size > 1:
        out.update(_all_to_all_waits(exchanges, steps))
        out["alltoall_per_step"] += len(blocked) / steps
        out["alltoall_deferred_blocked_ms"] = 1e3 * sum(blocked) / steps
        profiled = min(5, steps)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t1 = time.perf_counter()
            for _ in range(profiled):
                trainer.train_step(next(batches))
            out["profiled_step_ms"] = 1e3 * (time.perf_counter() - t1) / profiled
        spans, calls = {"all_to_all": 0.0, "all_reduce": 0.0}, {"all_to_all": 0, "all_reduce": 0}
        for e in prof.events():
            if e.name.startswith("gloo:") and e.name[5:] in spans:
                spans[e.name[5:]] += e.cpu_time_total / 1e3
                calls[e.name[5:]] += 1
        out["allreduce_per_step"] = calls["all_reduce"] / profiled
        out["alltoall_ms"], out["allreduce_ms"] = spans["all_to_all"] / profiled, spans["all_reduce"] / profiled
        from genrec.models.build import dense_named_parameters

        out.update(_collective_floor(sum(p.numel() for _, p in dense_named_parameters(trainer.model))))
    return out


class _TimedWork:
    """An all-to-all started with async_op: adds the seconds its wait() blocks to `blocked`."""

    def __init__(self, work, blocked: list[float]) -> None:
        self.work, self.blocked = work, blocked

    def wait(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.work.wait(*args, **kwargs)
        self.blocked.append(time.perf_counter() - t)
        return out


def _collective_floor(dense_params: int, calls: int = 100) -> dict:
    """What the step's collectives cost with nothing else to do, between the same ranks:
    an all-to-all of one int64 per rank (latency only, none of the store's payload) and an
    all-reduce of all the dense gradients (the demo's 60K parameters fit DDP's first
    bucket: one all-reduce a step, `allreduce_per_step`). Each is the median wall ms of
    `calls` after warm-up, with the rank's other threads' CPU ms per call (gloo moves the
    bytes on its own threads). Collective."""
    world = torch.distributed.get_world_size()
    counts, recv = torch.ones(world, dtype=torch.int64), torch.empty(world, dtype=torch.int64)
    grads = torch.zeros(dense_params)
    ops = {"alltoall": lambda: torch.distributed.all_to_all_single(recv, counts),
           "allreduce": lambda: torch.distributed.all_reduce(grads)}
    out = {}
    for name, op in ops.items():
        for _ in range(10):
            op()
        torch.distributed.barrier()
        walls, helpers0 = [], _helper_threads_cpu()
        for _ in range(calls):
            t0 = time.perf_counter()
            op()
            walls.append(1e3 * (time.perf_counter() - t0))
        out[f"{name}_floor_helper_cpu_ms"] = 1e3 * _helper_cpu_since(helpers0) / calls
        out[f"{name}_floor_ms"] = sorted(walls)[calls // 2]
    return out


def _helper_threads_cpu() -> dict[int, float]:
    """CPU seconds so far of each thread of this process but the calling one (the
    collectives' I/O and worker threads, the allocator's): they share the machine's cores
    with the training threads. Read through each thread's CPU-time clock (clock id built as
    Linux's MAKE_THREAD_CPUCLOCK does; no Python API names another thread's clock);
    {} where /proc is absent."""
    me, out = threading.get_native_id(), {}
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return out
    for tid in tids:
        if tid != me:
            try:
                out[tid] = time.clock_gettime((~tid << 3) | 6)  # CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED
            except OSError:
                pass  # a thread that has just exited
    return out


def _helper_cpu_since(before: dict[int, float]) -> float:
    """CPU seconds the other threads used since `before` (a `_helper_threads_cpu` reading);
    a thread started since counts from zero."""
    return sum(cpu - before.get(tid, 0.0) for tid, cpu in _helper_threads_cpu().items())


def _preemptions() -> int:
    """Times the calling thread was taken off its core while it could run (involuntary
    context switches), where the OS counts them per thread."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
    except (AttributeError, OSError):
        return 0


def _all_to_all_waits(spans: list[tuple[float, float]], steps: int) -> dict:
    """Rank 0's blocking all-to-alls split, per step, into waiting for the other ranks to
    arrive (the last rank's entry minus this rank's) and the collective's own time once all
    were there (this rank's exit minus the last entry), from every rank's (entry, exit)
    times on the machine's monotonic clock (perf_counter: one clock for all processes of a
    machine, which the bench's ranks share). Collective: every rank calls it."""
    every: list[list[tuple[float, float]]] = [[] for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(every, spans)
    mine = every[0]
    last_in = [max(rank[c][0] for rank in every) for c in range(len(mine))]
    own = sorted(1e3 * (out - last) for (_, out), last in zip(mine, last_in))
    return {"alltoall_per_step": len(mine) / steps,
            "alltoall_wait_for_other_rank_ms": sum(1e3 * (last - t) for (t, _), last in zip(mine, last_in)) / steps,
            "alltoall_own_ms": sum(own) / steps,
            "alltoall_own_median_ms": own[len(own) // 2] if own else 0.0}


_RANK = """
import json, os, sys
# What `genrec` applies to every process it starts.
from genrec.models.process import keep_large_allocations, passive_openmp_waits
passive_openmp_waits(); keep_large_allocations()
from genrec.models.train.bench import _time_ranks
out = _time_ranks(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
if os.environ["RANK"] == "0":
    print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world: int, cfg_path: Path, runs: list[list[str]], steps: int, *,
               same_batches: bool = False) -> list[dict]:
    """One run of `world` ranks per overrides list in `runs`, all at once, each rank a fresh
    process on this machine with one thread, `steps` warm-up steps then `steps` timed: each
    run's rank 0 timings. 1 rank runs the same way as 2, so neither inherits this process's
    warm heap or threads; two runs of 1 rank side by side share the machine as 2 ranks do,
    without talking to each other."""
    procs = []
    for overrides in runs:
        port = _free_port()
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _RANK, str(cfg_path), json.dumps(overrides), str(steps), str(steps),
                 "1" if same_batches else "0"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{world}-rank bench failed (exit codes {[p.returncode for p in procs]}):\n"
                           f"{outs[0][1][-3000:]}")
    return [json.loads(outs[run * world][0].strip().splitlines()[-1]) for run in range(len(runs))]


def _rate(run: dict) -> float:
    return run["samples"] / run["seconds"]


def _take_turns(cfg_path: Path, data: Path, out: Path, steps: tuple[int, int], rounds: int, demo: bool = True,
                breakdown: bool = False):
    """1 rank then 2 ranks (`_run_ranks`), `rounds` times, `steps` (1 rank, 2 ranks) steps
    each after as many warm-up steps: (ones, twos, scaling per round, breakdown per round).
    With `breakdown`, each round also runs two 1-rank runs side by side (`independent`:
    what the shared machine allows two processes with no communication) and 2 ranks on
    the same batches (`same_batches`: no rank waits for a longer batch on the other)."""
    ones, twos, parts = [], [], []
    for r in range(rounds):
        print(f"bench train: {cfg_path.name}, round {r + 1} of {rounds}: 1 rank ({steps[0]} steps), "
              f"then 2 ranks ({steps[1]} steps){', then the breakdown runs' if breakdown else ''}", file=sys.stderr)
        ones += _run_ranks(1, cfg_path, [_overrides(data, out / f"run1-{r}", steps[0], demo)], steps[0])
        twos += _run_ranks(2, cfg_path, [_overrides(data, out / f"run2-{r}", steps[1], demo)], steps[1])
        if breakdown:
            pair = _run_ranks(1, cfg_path, [_overrides(data, out / f"pair{i}-{r}", steps[0], demo) for i in (0, 1)],
                              steps[0])
            same = _run_ranks(2, cfg_path, [_overrides(data, out / f"same-{r}", steps[1], demo)], steps[1],
                              same_batches=True)[0]
            parts.append({"independent": sum(_rate(p) for p in pair) / _rate(ones[-1]),
                          "independent_slower": 2 * min(_rate(p) for p in pair) / _rate(ones[-1]),
                          "same_batches": 2 * _rate(same) / _rate(ones[-1])})
    scaling = [2 * _rate(two) / _rate(one) for one, two in zip(ones, twos)]
    return ones, twos, scaling, parts


def _ml100k(tmp: Path, quick: bool) -> dict:
    """The scaling figure on the ML-100K config (`ML100K`; {} where the file is absent)."""
    from genrec.data.convert import convert
    from genrec.data.prepare import prepare
    from genrec.models.config import JobConfig
    from genrec.models.config_loader import load_config
    from genrec.models.train.trainer import epoch_steps

    if not ML100K.is_file():
        print(f"bench train: {ML100K} not found (GENREC_ML100K_UDATA): no ML-100K scaling figure", file=sys.stderr)
        return {}
    cfg = load_config(JobConfig, ML100K_CONFIG, [])
    convert("movielens", [ML100K], tmp / "ml100k-logs", progress=False)
    prepare(tmp / "ml100k-logs", tmp / "ml100k", cfg.data.features, cfg.data.prepare.split, progress=False)
    cfg.data.path = str(tmp / "ml100k")
    epochs = ML100K_EPOCHS[quick]
    steps = (epochs * epoch_steps(cfg, 1), epochs * epoch_steps(cfg, 2))
    ones, twos, scaling, _ = _take_turns(ML100K_CONFIG, tmp / "ml100k", tmp / "ml100k-runs", steps, ROUNDS[quick],
                                         demo=False)
    mid = _median_round(scaling)
    one, two = ones[mid], twos[mid]
    return {
        "scaling_2rank_vs_1rank_ml100k": scaling[mid],
        "scaling_2rank_vs_1rank_ml100k_spread": _spread(scaling),
        "samples_per_s_1rank_ml100k": _rate(one),
        "samples_per_s_2rank_ml100k": 2 * _rate(two),
        "per_step_ms_ml100k": {"1rank": 1e3 * one["seconds"] / steps[0], "2rank": 1e3 * two["seconds"] / steps[1]},
        "epochs_timed_ml100k": epochs,
    }


def _median_round(values: list[float]) -> int:
    """The index of the median value, the lower middle of an even count: one round's own
    figure, whose other figures then describe the same round."""
    return sorted(range(len(values)), key=lambda r: values[r])[(len(values) - 1) // 2]


def _spread(values: list[float]) -> dict:
    """Median (`_median_round`'s value, not statistics.median), min, max and count."""
    return {"median": values[_median_round(values)], "min": min(values), "max": max(values), "n": len(values)}


def _scaling_breakdown(scaling: list[float], parts: list[dict]) -> dict:
    """Where the 2-rank run's samples/s go, each figure a median over the rounds (1 rank's
    samples/s = 1 in the same round). Two 1-rank runs side by side, with nothing between
    them, give what the machine gives two processes (its cores' shared caches, memory and
    neighbours): `scaling_2independent_vs_1rank` adds their rates, and
    `..._slower_vs_1rank` is twice the slower one's, the most two ranks in lock step can
    get (on a shared VM one core can run 10% slower than the other for minutes).
    `scaling_2rank_same_batches_vs_1rank`, 2 ranks that read the same batches, adds the
    collectives and the store's exchange but no imbalance; the 2-rank run adds the other
    rank's longer or shorter batches. `scaling_lost_to` gives the gaps between these
    medians: how much of the ideal 2 each part costs."""
    figure = {key: _spread([p[key] for p in parts]) for key in ("independent", "independent_slower", "same_batches")}
    lock_step, same = figure["independent_slower"]["median"], figure["same_batches"]["median"]
    return {
        "scaling_2independent_vs_1rank": figure["independent"]["median"],
        "scaling_2independent_vs_1rank_spread": figure["independent"],
        "scaling_2independent_slower_vs_1rank": lock_step,
        "scaling_2independent_slower_vs_1rank_spread": figure["independent_slower"],
        "scaling_2rank_same_batches_vs_1rank": same,
        "scaling_2rank_same_batches_vs_1rank_spread": figure["same_batches"],
        "scaling_lost_to": {"shared_machine": 2.0 - lock_step, "communication": lock_step - same,
                            "batch_imbalance": same - _spread(scaling)["median"]},
    }


def run(quick: bool = False) -> dict:
    from genrec.data.prepare import prepare
    from genrec.data.synth import synthesize
    from genrec.models.config import JobConfig
    from genrec.models.config_loader import load_config

    steps = 10 if quick else 50
    users, events = (400, 30_000) if quick else (2000, 200_000)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"bench train: synthesizing {events:,} events", file=sys.stderr)
        synthesize(tmp / "logs", num_users=users, num_items=2000, num_events=events, seed=0, progress=False)
        cfg = load_config(JobConfig, CONFIG, _overrides(tmp / "data", tmp / "run1", steps))
        prepare(tmp / "logs", tmp / "data", cfg.data.features, cfg.data.prepare.split, progress=False)
        # One thread everywhere, as each of the 2 ranks has: the comparison is about ranks,
        # and MFU is against the peak of the same single thread.
        torch.set_num_threads(1)
        peak = matmul_peak_gflops()
        # 1 and 2 ranks take turns, ROUNDS[quick] times: on a shared 2-core machine one pair of runs
        # was measured anywhere between 0.96x and 1.5x.
        rounds = ROUNDS[quick]
        ones, twos, scaling, parts = _take_turns(CONFIG, tmp / "data", tmp, (steps, steps), rounds, breakdown=True)
        ml100k = _ml100k(tmp, quick)
    # The round with the median scaling gives the other figures, so they describe one pair.
    mid = _median_round(scaling)
    one, two = ones[mid], twos[mid]
    per_step_1 = one["seconds"] / steps
    per_step_2 = two["seconds"] / steps
    # The store's fused backward runs inside autograd and is not separable by a hook; the
    # forward's share is reported, and the backward is counted with dense compute.
    sparse_share = one["sparse_forward_s"] / one["seconds"]
    comm_share = max(per_step_2 - per_step_1, 0.0) / per_step_2
    return {
        "samples_per_s_1rank": _rate(one),
        "samples_per_s_2rank": 2 * _rate(two),
        "scaling_2rank_vs_1rank": scaling[mid],
        "scaling_2rank_vs_1rank_spread": _spread(scaling),
        **_scaling_breakdown(scaling, parts),
        "tokens_per_s_1rank": one["tokens"] / one["seconds"],
        "mfu": one["flops"] / one["seconds"] / 1e9 / peak,
        "matmul_peak_gflops_fp32_1thread": peak,
        "step_time_shares": {
            "sparse_lookup": sparse_share,
            "dense_compute_and_optimizer": 1.0 - sparse_share,
            "communication_2rank": comm_share,
        },
        # Per step of rank 0: the training thread's CPU time and the rest of the step, which it
        # spends off the CPU, waiting for the other rank in a collective or preempted ("waiting";
        # measured without the profiler), with the CPU time of the rank's other threads, which
        # share the cores, and how often they (or anything else) preempted the training thread
        # ("preemptions", per step). Then, under the profiler (which slows the 2-rank step
        # by a third here, and its per-op times are not to be trusted on 2 busy cores), the spans
        # of the store's all-to-alls and DDP's all-reduce, and the rest ("compute").
        "per_step_ms_2rank": {"step": 1e3 * per_step_2, "cpu": 1e3 * two["cpu_seconds"] / steps,
                              "waiting": 1e3 * (two["seconds"] - two["cpu_seconds"]) / steps,
                              # the rank's other threads (gloo's I/O loop and workers)
                              "helper_threads_cpu": 1e3 * two["helper_threads_cpu_s"] / steps,
                              "preemptions": two["preemptions"] / steps,
                              # measured without the profiler, from both ranks' clocks
                              "alltoall_calls": two["alltoall_per_step"],
                              "alltoall_wait_for_other_rank": two["alltoall_wait_for_other_rank_ms"],
                              "alltoall_own": two["alltoall_own_ms"],
                              "alltoall_own_median_per_call": two["alltoall_own_median_ms"],
                              # the backward's all-to-all travels during the dense optimizer
                              # step (the store's deferred row updates): what is left to wait
                              "alltoall_deferred_blocked": two["alltoall_deferred_blocked_ms"],
                              "profiled_step": two["profiled_step_ms"],
                              "alltoall": two["alltoall_ms"], "allreduce": two["allreduce_ms"],
                              # the same collectives alone between the ranks (`_collective_floor`)
                              "alltoall_floor": two["alltoall_floor_ms"],
                              "alltoall_floor_helper_cpu": two["alltoall_floor_helper_cpu_ms"],
                              "allreduce_floor": two["allreduce_floor_ms"],
                              "allreduce_floor_helper_cpu": two["allreduce_floor_helper_cpu_ms"],
                              "allreduce_calls": two["allreduce_per_step"],
                              "collectives_floor": (two["alltoall_per_step"] * two["alltoall_floor_ms"]
                                                    + two["allreduce_per_step"] * two["allreduce_floor_ms"]),
                              "compute": two["profiled_step_ms"] - two["alltoall_ms"]},
        "per_step_ms_1rank": {"step": 1e3 * per_step_1, "cpu": 1e3 * one["cpu_seconds"] / steps,
                              "waiting": 1e3 * (one["seconds"] - one["cpu_seconds"]) / steps,
                              "helper_threads_cpu": 1e3 * one["helper_threads_cpu_s"] / steps,
                              "preemptions": one["preemptions"] / steps,
                              "alltoall": 0.0, "allreduce": 0.0, "compute": 1e3 * per_step_1},
        "steps": steps,
        "threads_per_rank": 1,
        **ml100k,
    }
