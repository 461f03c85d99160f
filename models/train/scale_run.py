"""The SSD tier's scale run: a table larger than RAM, trained, snapshotted, killed and resumed.

    python -m genrec.models.train.scale_run --dir /big/disk/scale --rows 100000000

One rank, one table at dim 64 (row-wise Adagrad) with `--host-rows` in DRAM and the rest
on the SSD tier in `--dir`; the demo-size HSTU tower (Adam) reads rows of 64 Zipf(1.05) ids
of the table per step. A first process materializes every row, trains with `read_ahead` of
the next batch, snapshots every `--snapshot-every` steps (the first full, then deltas
chained to it: TieredEmbeddingCollection.save_snapshot, with the tower's and optimizer's
state beside it) and kills itself with SIGKILL after step `--kill-at`. A second
process loads the last complete snapshot and trains on: its losses must equal the first
process's, step for step, bit for bit. Prints a JSON of what was measured: rows, bytes on
disk, peak RSS, steps/s, /proc/self/io bytes, snapshot seconds, and whether the losses
matched. Needs disk for the tier and one full snapshot (about 2 x 292 bytes per row).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time

import torch

ROWS_PER_STEP, LENGTH = 64, 64


def _io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return {k: int(fields[k]) for k in ("read_bytes", "write_bytes")}


def _memory() -> dict[str, int]:
    """Peak RSS (mapped slab pages the kernel may evict count in it) and the heap's share now."""
    out = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon", "RssFile")):
            key, val = line.split(":")
            out[key.strip().lower() + "_bytes"] = int(val.split()[0]) * 1024
    return out


def _say(msg: str) -> None:
    print(f"[scale run] {msg}", file=sys.stderr, flush=True)


def _setup(args):
    from genrec.dense import TowerConfig, build_tower
    from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection

    table = TableConfig(name="t", embedding_dim=64, feature_names=["f"], device_rows=args.host_rows // 8,
                        host_rows=args.host_rows)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[table], ssd_dir=os.path.join(args.dir, "ssd"),
                                                 ssd_slab_rows=1 << 20, snapshot_max_deltas=args.max_deltas))
    torch.manual_seed(0)
    tower = build_tower(TowerConfig(kind="hstu", embedding_dim=64, num_layers=2, num_heads=2, attention_dim=32,
                                    linear_dim=32, max_seq_len=LENGTH, dropout=0.0))
    return tec, tower, torch.optim.Adam(tower.parameters(), lr=1e-3)


def _batch(rows: int, step: int):
    """Step `step`'s ids: Zipf(1.05) ranks, scattered over the id space by a fixed hash."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(step)
    u = torch.rand(ROWS_PER_STEP * LENGTH, generator=g, dtype=torch.float64)
    # inverse CDF of a continuous Zipf(1.05) over [1, rows]: closed form, no table of `rows`
    a = 1.05
    rank = ((rows ** (1 - a) - 1) * u + 1) ** (1 / (1 - a))
    ids = (rank.long().clamp(1, rows) - 1) * 2654435761 % rows
    return KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([ids.numel()]))


def _step(tec, tower, opt, kjt) -> float:
    offsets = torch.arange(0, ROWS_PER_STEP * LENGTH + 1, LENGTH)
    ts = torch.arange(ROWS_PER_STEP * LENGTH) * 60
    loss = tower(tec(kjt)["f"].values(), offsets, ts).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _complete_snapshots(snap_root: str) -> list[str]:
    if not os.path.isdir(snap_root):
        return []
    done = [d for d in sorted(os.listdir(snap_root)) if os.path.exists(os.path.join(snap_root, d, "dense.pt"))]
    return [os.path.join(snap_root, d) for d in done]


def train(args) -> None:
    """One process: fresh (materialize) or resumed from the last complete snapshot."""
    from genrec.sparse.snapshot import read_manifest

    torch.set_num_threads(1)
    tec, tower, opt = _setup(args)
    snap_root, log = os.path.join(args.dir, "snapshots"), open(args.log, "a")
    first, report = 1, {}
    if args.resume:
        last = _complete_snapshots(snap_root)[-1]
        t0 = time.perf_counter()
        tec.load_snapshot(last)
        dense = torch.load(os.path.join(last, "dense.pt"), weights_only=True)
        tower.load_state_dict(dense["tower"])
        opt.load_state_dict(dense["optimizer"])
        first, report["load_seconds"] = dense["step"] + 1, time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        for start in range(0, args.rows, 1 << 20):
            ids = torch.arange(start, min(args.rows, start + (1 << 20)))
            tec.stores["t"].lookup_train(ids, torch.ones_like(ids), None)
            if (start >> 20) % 16 == 0:
                _say(f"materialized {start + ids.numel():,} / {args.rows:,} rows")
        report["materialize_seconds"] = time.perf_counter() - t0
        report.update(_memory())
        log.write(json.dumps({"report": dict(report, process="first")}) + "\n")
        log.flush()
        report = {}
    io0, t0, snaps = _io(), time.perf_counter(), []
    for step in range(first, args.steps + 1):
        if step < args.steps:
            tec.read_ahead([_batch(args.rows, step + 1)])
        loss = _step(tec, tower, opt, _batch(args.rows, step))
        log.write(json.dumps({"step": step, "loss": loss, "resumed": args.resume}) + "\n")
        log.flush()
        if step == args.kill_at and not args.resume:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash at a chosen step: no cleanup runs
        if step % args.snapshot_every == 0:
            path, s0 = os.path.join(snap_root, f"step-{step:06d}"), time.perf_counter()
            tec.save_snapshot(path)
            tmp = os.path.join(path, "dense.pt.tmp")
            torch.save({"tower": tower.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, os.path.join(path, "dense.pt"))
            snaps.append({"step": step, "seconds": time.perf_counter() - s0, "kind": read_manifest(path)["kind"]})
            _say(f"step {step}: snapshot {snaps[-1]}")
            done = step - first + 1  # what a killed process leaves of its figures
            log.write(json.dumps({"progress": {"process": "resumed" if args.resume else "first", "step": step,
                                               "steps_per_s": done / (time.perf_counter() - t0),
                                               "io": {k: v - io0[k] for k, v in _io().items()},
                                               **_memory(),
                                               "snapshot": snaps[-1]}}) + "\n")
    seconds = time.perf_counter() - t0
    report.update(steps=args.steps - first + 1, train_seconds=seconds, steps_per_s=(args.steps - first + 1) / seconds,
                  io={k: v - io0[k] for k, v in _io().items()}, snapshots=snaps, process="resumed" if args.resume else "first",
                  **_memory(),
                  stats=tec.stats()["t"])
    log.write(json.dumps({"report": report}) + "\n")


def _losses(path: str, resumed: bool) -> dict[int, float]:
    out = {}
    for line in open(path):
        rec = json.loads(line)
        if "step" in rec and rec["resumed"] == resumed:
            out[rec["step"]] = rec["loss"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a new or empty directory on the disk under test")
    p.add_argument("--rows", type=int, default=100_000_000)
    p.add_argument("--host-rows", type=int, default=2_000_000)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--snapshot-every", type=int, default=250)
    p.add_argument("--max-deltas", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=900)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.log:  # a child process
        train(args)
        return 0
    if os.path.exists(args.dir) and os.listdir(args.dir):
        raise SystemExit(f"scale run: --dir {args.dir} is not empty (it is never cleared: give a new one)")
    if not args.snapshot_every <= args.kill_at < args.steps:
        raise SystemExit("scale run: --kill-at must be at least --snapshot-every and below --steps")
    os.makedirs(os.path.join(args.dir, "ssd"))
    log = os.path.join(args.dir, "steps.jsonl")
    cmd = [sys.executable, "-m", "genrec.models.train.scale_run", *(argv if argv is not None else sys.argv[1:]), "--log", log]
    first = subprocess.run(cmd)
    if first.returncode != -signal.SIGKILL:
        raise SystemExit(f"scale run: the first process ended with exit {first.returncode}, not killed after "
                         f"step {args.kill_at}; see its output above")
    _say(f"the first process killed itself (SIGKILL) after step {args.kill_at}; resuming")
    subprocess.run([*cmd, "--resume"], check=True)
    before, after = _losses(log, False), _losses(log, True)
    reports = [json.loads(line) for line in open(log) if line.startswith(('{"report"', '{"progress"'))]
    same = sorted(set(before) & set(after))
    result = {"rows": args.rows, "host_rows": args.host_rows, "disk_bytes": _du(args.dir),
              "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
              "resumed_steps_compared": len(same), "losses_identical": bool(same) and all(before[s] == after[s] for s in same),
              "reports": reports, "load_average": os.getloadavg()}
    print(json.dumps(result, indent=1))
    return 0 if result["losses_identical"] else 1


def _du(path: str) -> int:
    """Allocated bytes under `path`, a hard-linked file (a delta's links to its base) once."""
    seen = {}
    for root, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(root, f))
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


if __name__ == "__main__":
    sys.exit(main())
