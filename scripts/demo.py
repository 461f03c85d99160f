"""`genrec demo`: the whole job on a small synthetic ad log, with no servers to start.

    synth -> prepare -> train (HSTU, retrieval + ranking) -> export -> eval -> one ranking query
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
DEMO_MANIFEST = "demo_manifest.json"
DEMO_OUTPUTS = ("logs", "data", "run", "artifact", "report")
"""What the demo writes into --out beside its manifest (and, while a step runs, that step's
hidden staging folder): `--overwrite` replaces a folder that holds nothing else."""
_OWN = re.compile(rf"({'|'.join(DEMO_OUTPUTS)})|\.({'|'.join(DEMO_OUTPUTS)})\.(tmp|old)-.+")


def _say(message: str) -> None:
    print(f"\n== {message}", file=sys.stderr, flush=True)


def run_demo(out: str | Path, *, overwrite: bool = False, steps: int | None = None) -> dict:
    from genrec.data.files import OutputExistsError, atomic_write_json, claim_output_dir
    from genrec.data.prepare import prepare
    from genrec.data.synth import synthesize
    from genrec.models.config import JobConfig
    from genrec.models.config_loader import load_config
    from genrec.models.evaluation.evaluate import run_evaluation
    from genrec.models.serving.export import export_checkpoint
    from genrec.models.serving.ranker import load_artifact
    from genrec.models.serving.requests import split_requests
    from genrec.models.train.trainer import run_training

    out = claim_output_dir(out, overwrite=overwrite, manifest=DEMO_MANIFEST)
    foreign = sorted(p.name for p in out.iterdir() if p.name != DEMO_MANIFEST and not _OWN.fullmatch(p.name)) \
        if out.is_dir() else []
    if foreign:  # the demo's manifest lists no files: without this, replacing the folder would delete them
        raise OutputExistsError(f"refusing to replace {out}: it holds {', '.join(foreign[:5])}, which the demo did "
                                "not write and replacing it would delete; move them away or choose another --out")
    # Paths as TOML strings (json.dumps escapes a backslash or a quote in --out).
    overrides = [f"data.path={json.dumps(str(out / 'data'))}", f"train.out_dir={json.dumps(str(out / 'run'))}"]
    if steps is not None:
        overrides += [f"train.max_steps={steps}", f"train.checkpoint_every={max(steps // 2, 1)}"]
    cfg = load_config(JobConfig, CONFIG, overrides)  # a bad --steps is refused before anything is removed
    steps = cfg.train.max_steps
    if out.exists():
        shutil.rmtree(out)  # empty, or a demo folder (its manifest says so)
    atomic_write_json(out / DEMO_MANIFEST, {"format": "genrec.demo/1", "steps": steps})

    _say("1/6 synthesize an ad log (3,000 users, 5,000 ads, 300,000 impressions)")
    synthesize(out / "logs", num_users=3000, num_items=5000, num_events=300_000, seed=0)
    _say("2/6 prepare per-user sequences (leave-one-out split)")
    prepare(out / "logs", out / "data", cfg.data.features, cfg.data.prepare.split)
    _say(f"3/6 train HSTU for {steps} steps (next-ad retrieval + click / conversion ranking)")
    run_training(cfg)
    _say("4/6 export the serving artifact")
    artifact = export_checkpoint(out / "run", out / "artifact")
    _say("5/6 evaluate on the test split")
    report = run_evaluation(out / "run", out / "data", split="test", out_dir=out / "report")
    _say("6/6 one ranking query through the serving path")
    ranker = load_artifact(artifact)
    history = split_requests(out / "data", cfg.data.features, 1)[0]
    answer = ranker.rank({**history, "k": 100, "n": 5, "exclude_seen": True})
    print(json.dumps(answer, indent=2))
    summary = json.loads((report / "report.json").read_text())
    headline = {k: summary[k] for k in ("retrieval.hr@10", "retrieval.ndcg@10", "ranking.click.auc") if k in summary}
    print(f"\ndemo done in {out}: report {report / 'report.md'}, artifact {artifact}; {headline}")
    return {"report": summary, "answer": answer}
