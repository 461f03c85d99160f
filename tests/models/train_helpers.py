"""A tiny synthetic-ad-log job config shared by the training and evaluation tests."""

from pathlib import Path

from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict

FEATURES = ["item_id", "action", "advertiser_id", "category_id"]


def tiny_config(data: Path, out: Path, **train) -> JobConfig:
    raw = {
        "data": {
            "path": str(data),
            "features": {"sparse": FEATURES, "labels": ["click", "conversion"]},
            "loader": {"batch_size": 8, "max_seq_len": 24, "mode": "ranking", "num_candidates": 2},
        },
        "sparse": {"tables": [
            {"name": f, "embedding_dim": 16, "feature_names": [f], "learning_rate": 0.05,
             "device_rows": 64, "host_rows": 128}
            for f in FEATURES
        ]},
        "dense": {"embedding_dim": 16, "num_layers": 1, "num_heads": 2, "attention_dim": 8, "linear_dim": 8,
                  "max_seq_len": 32, "dropout": 0.0},
        "model": {"retrieval": True, "ranking": True, "num_negatives": 16, "min_target_action": None},
        "train": {"out_dir": str(out), "max_steps": 6, "checkpoint_every": 3, "log_every": 1,
                  "precision": "fp32", "tensorboard": False, "eval_max_users": 16, **train},
    }
    return from_dict(JobConfig, raw)
