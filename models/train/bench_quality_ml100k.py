"""`genrec bench quality-ml100k`: HSTU against the faithful SASRec on MovieLens-100K, over seeds.

Trains `configs/ml100k.toml` (HSTU) and `configs/ml100k-sasrec.toml` (SASRec) on seeds
0..N-1, each a `genrec train` process with one thread, two side by side on the machine's
cores; evaluates every best-validation checkpoint once on the test split (full corpus,
seen items filtered, leave-one-out); and compares the two recipes as the README does, by a
paired bootstrap over users of each user's mean over the seeds (`genrec eval --compare`
with the runs of each recipe). Reports:

    hstu_hr_at_10, hstu_ndcg_at_10              medians over the seeds (test)
    sasrec_hr_at_10, sasrec_ndcg_at_10
    hstu_minus_sasrec_ndcg_at_10 (and hr_at_10) of the per-user means: diff, ci95, p_value
    ci_excludes_0                               the target: HSTU ahead, its interval above 0
    per_seed                                    test figures and best validation NDCG@10

N is `GENREC_BENCH_SEEDS` (default 16, the README's comparison: about an hour on 2
cores); `--quick` runs 2 seeds of 10 epochs. The file is `../shared/data/ml-100k/u.data`
beside the repository, or `GENREC_ML100K_UDATA`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from genrec.models.train.bench import ML100K, REPO

RECIPES = {"hstu": REPO / "configs" / "ml100k.toml", "sasrec": REPO / "configs" / "ml100k-sasrec.toml"}
METRICS = ("hr@10", "ndcg@10")


def _train_all(root: Path, data: Path, seeds: list[int], quick: bool) -> None:
    """Every (recipe, seed) run, two processes at a time; a failed run fails the bench with its log."""
    jobs = [(name, seed) for seed in seeds for name in RECIPES]
    running: list[tuple[subprocess.Popen, Path]] = []
    while jobs or running:
        while jobs and len(running) < 2:
            name, seed = jobs.pop(0)
            run = root / f"{name}-s{seed}"
            sets = [f"data.path={json.dumps(str(data))}", f"train.out_dir={json.dumps(str(run))}",
                    f"train.seed={seed}", "train.num_threads=1", "train.tensorboard=false"]
            if quick:
                sets += ["train.num_epochs=10", "train.early_stop_patience=0"]
            log = root / f"{run.name}.log"
            cmd = [sys.executable, "-m", "genrec.scripts.cli", "train", "--config", str(RECIPES[name])]
            for s in sets:
                cmd += ["--set", s]
            print(f"bench quality-ml100k: training {run.name}", file=sys.stderr, flush=True)
            with open(log, "w") as f:
                running.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT), log))
        proc, log = running.pop(0)
        if proc.wait() != 0:
            for other, _ in running:
                other.kill()
                other.wait()  # gone before the temporary folder it writes in is removed
            tail = "\n".join(log.read_text().splitlines()[-20:])
            raise RuntimeError(f"bench quality-ml100k: {log.stem} failed (exit {proc.returncode}):\n{tail}")


def _best_valid(run: Path) -> float:
    return json.loads((run / "best.json").read_text())["value"]


def run(quick: bool = False) -> dict:
    from genrec.data.convert import convert
    from genrec.data.prepare import prepare
    from genrec.models.config import JobConfig
    from genrec.models.config_loader import load_config
    from genrec.models.evaluation.evaluate import run_evaluation

    if not ML100K.is_file():
        raise FileNotFoundError(f"bench quality-ml100k needs MovieLens-100K: {ML100K} not found "
                                "(set GENREC_ML100K_UDATA)")
    raw = os.environ.get("GENREC_BENCH_SEEDS", "16")
    if not (quick or raw.strip().isdigit()):
        raise ValueError(f"bench quality-ml100k: GENREC_BENCH_SEEDS must be a whole number of seeds, got {raw!r}")
    seeds = list(range(2 if quick else int(raw)))
    if len(seeds) < 2:
        raise ValueError("bench quality-ml100k: GENREC_BENCH_SEEDS must be at least 2 (a median of seeds)")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="genrec-bench-ml100k-") as tmp:
        root = Path(tmp)
        cfg = load_config(JobConfig, RECIPES["hstu"], [])
        convert("movielens", [ML100K], root / "logs", progress=False)
        prepare(root / "logs", root / "data", cfg.data.features, cfg.data.prepare.split, progress=False)
        start = time.time()
        _train_all(root, root / "data", seeds, quick)
        train_wall_s = time.time() - start
        runs = {name: [root / f"{name}-s{s}" for s in seeds] for name in RECIPES}
        report_dir = run_evaluation(runs["hstu"], root / "data", "test", out_dir=root / "report",
                                    compare=runs["sasrec"], progress=False)
        report = json.loads((report_dir / "report.json").read_text())
        valid = {name: [_best_valid(r) for r in rs] for name, rs in runs.items()}

    def test(run: Path, metric: str) -> float:
        first = run == runs["hstu"][0]  # the report's own model; the other runs are its columns
        return report[f"retrieval.{metric}" if first else f"baselines.{run.name}.retrieval.{metric}"]

    mean = f"comparisons.mean of {len(seeds)} runs minus mean of {len(seeds)} compare runs.retrieval"
    result = {"bench": "quality-ml100k", "quick": quick, "data": "MovieLens-100K, test split", "seeds": seeds,
              "configs": {name: str(path.relative_to(REPO)) for name, path in RECIPES.items()}}
    for name in RECIPES:
        for metric in METRICS:
            result[f"{name}_{metric.replace('@', '_at_')}"] = statistics.median(test(r, metric) for r in runs[name])
    for metric in METRICS:
        key = f"hstu_minus_sasrec_{metric.replace('@', '_at_')}"
        result[key] = report[f"{mean}.{metric}.diff"]
        result[f"{key}_ci95"] = [report[f"{mean}.{metric}.low"], report[f"{mean}.{metric}.high"]]
        result[f"{key}_p_value"] = report[f"{mean}.{metric}.p_value"]
    result["ci_excludes_0"] = result["hstu_minus_sasrec_ndcg_at_10_ci95"][0] > 0
    result["per_seed"] = {
        f"{name}-s{seed}": {"best_valid_ndcg_at_10": valid[name][i],
                            **{f"test_{m.replace('@', '_at_')}": test(runs[name][i], m) for m in METRICS}}
        for name in RECIPES for i, seed in enumerate(seeds)}
    result["train_wall_s"] = train_wall_s
    result["conditions"] = {"load_average_before_training": list(load_before), "threads_per_run": 1,
                            "runs_side_by_side": 2}
    return result
