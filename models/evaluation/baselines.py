"""Ranking baselines scored on the same candidates as the model: each ad's own rate in the
training split, and the planted oracle of a synthetic log.

Worked example (labels ["click"]), train split events of ad 31: 40 impressions, 4 clicks;
ad 32: never in train; the train click rate is 0.07:

    AdRateScorer(data_dir, "item_id", ["click"]).probs(tensor([31, 32]))
        -> [[(4 + 0.07 * 20) / (40 + 20)],     # 0.09
            [0.07]]                            # never trained on: the mean rate
    OracleScorer.from_prepared(manifest, "user_id", "ts", "item_id").probs(users_C, ts_C, items_C)
        -> [C, 1]: the p_click column `genrec synth` wrote for those events (from_prepared
           gives None when the prepared data's sources have no such column)

The ad-rate baseline is what a per-ad counter (no user, no context, no sequence) reaches;
the oracle is the best any model can do on those events. A model's AUC between them says
how much of the learnable signal it has picked up.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

AD_RATE = "ad rate"
"""Name of the per-ad rate baseline in the report."""
ORACLE = "oracle"
"""Name of the planted-truth baseline in the report."""
ORACLE_COLUMN = "p_click"
"""The oracle probability column of a synthetic log (`data.synth`)."""
ORACLE_TASK = "click"
"""The task the oracle column scores."""
ORACLE_MAX_EVENTS = 20_000_000
"""Largest log the oracle is joined from (it holds ~40 bytes per logged event in memory)."""
PRIOR_EVENTS = 20.0
"""Pseudo-impressions at the split's mean rate added to every ad (shrinks rare ads)."""


class AdRateScorer:
    """Per-ad label rates from the prepared training split, shrunk toward the mean."""

    def __init__(self, data_dir: str | Path, item: str, labels: list[str]) -> None:
        items, values = [], {lab: [] for lab in labels}
        for part in sorted((Path(data_dir) / "train").glob("*.parquet")):
            table = pq.read_table(part, columns=[item, *labels])
            items.append(table.column(item).combine_chunks().values.to_numpy())
            for lab in labels:
                values[lab].append(table.column(lab).combine_chunks().values.to_numpy().astype(np.float64))
        item_ids = np.concatenate(items) if items else np.zeros(0, np.int64)
        self.item_ids_N, inverse = np.unique(item_ids, return_inverse=True)
        counts_N = np.bincount(inverse, minlength=self.item_ids_N.size)
        self.rates_NL = np.zeros((self.item_ids_N.size, len(labels)))
        self.prior_L = np.zeros(len(labels))
        for j, lab in enumerate(labels):
            y = np.concatenate(values[lab]) if values[lab] else np.zeros(0)
            self.prior_L[j] = y.mean() if y.size else 0.0
            hits_N = np.bincount(inverse, weights=y, minlength=self.item_ids_N.size)
            self.rates_NL[:, j] = (hits_N + PRIOR_EVENTS * self.prior_L[j]) / (counts_N + PRIOR_EVENTS)

    def probs(self, item_ids_C: torch.Tensor) -> torch.Tensor:
        """[C, num_labels]: each candidate ad's rate; ads not in train get the mean rate."""
        ids = item_ids_C.numpy()
        pos = np.clip(np.searchsorted(self.item_ids_N, ids), 0, max(self.item_ids_N.size - 1, 0))
        found = self.item_ids_N.size > 0
        hit = (self.item_ids_N[pos] == ids) if found else np.zeros(ids.size, bool)
        out = np.where(hit[:, None], self.rates_NL[pos] if found else 0.0, self.prior_L[None, :])
        return torch.from_numpy(out.astype(np.float32))


def _event_key(user: np.ndarray, ts: np.ndarray, item: np.ndarray) -> np.ndarray:
    """A 64-bit mix of (user, ts, item) to sort and search on; matches are checked field by field."""
    with np.errstate(over="ignore"):
        h = user.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        h ^= ts.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
        h ^= item.astype(np.uint64) * np.uint64(0x165667B19E3779F9)
    return h


class OracleScorer:
    """The planted click probability of each logged event, looked up by (user, ts, item)."""

    def __init__(self, user_N: np.ndarray, ts_N: np.ndarray, item_N: np.ndarray, p_N: np.ndarray) -> None:
        key = _event_key(user_N, ts_N, item_N)
        order = np.argsort(key, kind="stable")
        self.key_N, self.user_N, self.ts_N, self.item_N, self.p_N = (
            key[order], user_N[order], ts_N[order], item_N[order], p_N[order])

    @staticmethod
    def from_prepared(manifest: dict, user_col: str, ts_col: str, item_col: str) -> "OracleScorer | None":
        """From the logs a prepared directory was made of (its manifest's sources), when every
        source has the oracle column and integer ids and the log has at most
        `ORACLE_MAX_EVENTS` rows; else None (no oracle to show)."""
        cols = [user_col, ts_col, item_col, ORACLE_COLUMN]
        if sum(int(src.get("rows", 0)) for src in manifest.get("sources", [])) > ORACLE_MAX_EVENTS:
            return None
        parts = []
        for source in manifest.get("sources", []):
            path = Path(source["path"])
            if not path.is_file() or ORACLE_COLUMN not in pq.read_schema(path).names:
                return None
            parts.append(pq.read_table(path, columns=cols))
        # String ids were hashed by prepare: the log's own values would never match the candidates'.
        if not parts or any(not pa.types.is_integer(t.schema.field(c).type) for t in parts for c in cols[:3]):
            return None
        arrays = [np.concatenate([t.column(c).to_numpy() for t in parts]) for c in cols]
        return OracleScorer(*arrays)

    def probs(self, user_C: torch.Tensor, ts_C: torch.Tensor, item_C: torch.Tensor) -> torch.Tensor | None:
        """[C, 1] oracle probabilities, or None when some candidate is not in the logs."""
        u, t, i = user_C.numpy(), ts_C.numpy(), item_C.numpy()
        pos = np.clip(np.searchsorted(self.key_N, _event_key(u, t, i)), 0, self.key_N.size - 1)
        # A hash collision would land on a neighbour: the fields must match exactly.
        if not ((self.user_N[pos] == u) & (self.ts_N[pos] == t) & (self.item_N[pos] == i)).all():
            return None
        return torch.from_numpy(self.p_N[pos].astype(np.float32))[:, None]
