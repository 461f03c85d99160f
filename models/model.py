"""The generative recommender: per-event tokens from sparse features -> sequence tower -> heads.

Knows nothing about parallelism: the embedding module and the tower are built
(and sharded / wrapped) elsewhere and handed in.

Worked example (feature spec sparse = ["item_id", "action", "category_id"], sum combine):

    history of user 7: items [11, 12, 13], actions [1, 0, 1], categories [4, 4, 9]
    token_t = E_item[item_t] + E_action[action_t] + E_category[category_t]      [3, D]
    states  = tower(tokens, offsets=[0, 3], timestamps)                          [3, D]
    retrieval: states[0] predicts item 12, states[1] predicts item 13 (a softmax against
               negatives: a shared uniform pool, per-position draws, the batch's other
               targets, or the whole corpus; `ModelConfig.negatives`)
    ranking:   candidates [31, 32] get tokens without the action feature (unknown when
               serving), are appended after the history under the target-aware mask,
               and each candidate state goes through one MLP per task (click, conversion).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.data.batch import Batch
from genrec.data.config import FeatureSpec
from genrec.models.corpus_softmax import LogitsWorkspace, corpus_cross_entropy
from genrec.models.ids import jagged_ranges, sorted_positions


@dataclass(kw_only=True)
class ModelConfig:
    token_combine: Literal["sum", "concat"] = "sum"
    """How an event's feature embeddings become one token: a sum (all tables must have the
    tower's dimension) or a concatenation followed by a linear projection."""
    retrieval: bool = True
    """Train the retrieval head (next-item sampled softmax at every position)."""
    ranking: bool = False
    """Train the ranking head (candidates after the history, one BCE per task)."""
    retrieval_weight: float = 1.0
    """Weight of the retrieval loss when both heads train."""
    contrastive_weight: float = 0.0
    """Weight of a two-view contrastive term (the unsupervised half of DuoRec, Qiu et al.,
    WSDM 2022, with SimCSE's dropout views): in training without ranking candidates the
    tower runs twice over the same tokens under different dropout masks, and each position's
    two states are each other's positive in an InfoNCE against the other rows' positions.
    0: off (one tower pass)."""
    contrastive_temperature: float = 0.1
    """Temperature of that InfoNCE over cosine similarities."""
    negatives: Literal["shared", "per_position", "in_batch", "full"] = "shared"
    """The retrieval softmax's negatives. "shared": `num_negatives` items drawn uniformly
    from the corpus, one pool for the whole batch; "per_position": `num_negatives` uniform
    draws for every position (the HSTU / SASRec references); "in_batch": the batch's other
    target items, with the logQ correction for their popularity; "full": every corpus item
    (exact softmax, for corpora up to `full_softmax_max_items`)."""
    num_negatives: int = 128
    """Negatives per batch ("shared") or per position ("per_position")."""
    in_batch_negatives: bool = False
    """Also use the batch's other target items as negatives ("shared" / "per_position";
    "in_batch" always does)."""
    full_softmax_max_items: int = 200_000
    """Largest corpus "full" accepts: above it, use "shared" with a large pool."""
    mask_seen: bool = False
    """With "full": the items of a position's own history (up to and including its event)
    are no negatives of its softmax, except the target itself. Evaluation filters a user's
    seen items out of the ranking, so the loss need not spend its gradient pushing them
    below the unseen ones."""
    similarity: Literal["cosine", "dot"] = "cosine"
    """How a state scores an item in the retrieval softmax, at evaluation and at serving:
    "cosine" (both L2-normalized, the HSTU reference) or "dot" (raw inner product, as
    SASRec-style softmax models; an item row's norm can then carry its popularity)."""
    temperature: float = 0.05
    """Softmax temperature: the similarity is divided by it (use 1.0 with "dot")."""
    min_target_action: int | None = None
    """Only positions whose next event has action >= this are retrieval targets (e.g. 1:
    predict clicked ads, not mere impressions). None: every next event is a target."""
    ranking_tasks: list[str] = field(default_factory=lambda: ["click", "conversion"])
    """Label columns predicted by the ranking head (a subset of `data.features.labels`)."""
    task_weights: list[float] = field(default_factory=lambda: [1.0, 1.0])
    """Loss weight per ranking task."""
    ranking_hidden_dim: int = 64
    """Hidden width of each task's MLP."""
    ranking_head_input: Literal["state", "state_and_token", "cross"] = "state"
    """What the task MLP reads: the candidate's tower state; "state_and_token": the state
    concatenated with the candidate's own token (a wide path: per-ad and per-context effects
    reach the head directly, as the sparse features do in DLRM-style rankers); "cross": those
    two and their elementwise product (the user-ad affinity as a feature: an MLP learns a dot
    product slowly)."""


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1, eps=1e-6)


def retrieval_vectors(x: torch.Tensor, similarity: str) -> torch.Tensor:
    """States or item rows as the retrieval head's inner product sees them (fp32)."""
    return _normalize(x) if similarity == "cosine" else x.float()


def _seen_before(
    item_ids_T: torch.Tensor, offsets_B1: torch.Tensor, src_P: torch.Tensor, target_ids_P: torch.Tensor,
    corpus_N: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(query index, corpus position) of every item in query p's history up to and including
    its own event `src_P[p]`, except items equal to p's target: the `mask_seen` pairs."""
    row_P = torch.searchsorted(offsets_B1, src_P, right=True) - 1
    start_P = offsets_B1[row_P]
    counts_P = src_P - start_P + 1
    p_idx = torch.repeat_interleave(torch.arange(src_P.numel(), device=src_P.device), counts_P)
    seen = item_ids_T[jagged_ranges(start_P, counts_P)]
    pos, known = sorted_positions(corpus_N, seen)
    keep = known & (seen != target_ids_P[p_idx])
    return p_idx[keep], pos[keep]


def interleave_jagged(
    a_TD: torch.Tensor, a_lengths_B: torch.Tensor, b_TD: torch.Tensor, b_lengths_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise concatenation of two jagged tensors: row i = a_i followed by b_i.

    Returns (values, offsets_B1, b_positions): where b's rows landed in the result.
    """
    lengths_B = a_lengths_B + b_lengths_B
    offsets_B1 = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths_B)
    a_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(a_lengths_B)
    b_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(b_lengths_B)
    rows_B = torch.arange(len(a_lengths_B), device=a_TD.device)
    a_row = torch.repeat_interleave(rows_B, a_lengths_B)
    b_row = torch.repeat_interleave(rows_B, b_lengths_B)
    a_pos = offsets_B1[a_row] + torch.arange(a_TD.shape[0], device=a_TD.device) - a_offsets[a_row]
    b_pos = offsets_B1[b_row] + a_lengths_B[b_row] + torch.arange(b_TD.shape[0], device=a_TD.device) - b_offsets[b_row]
    out = a_TD.new_empty((a_TD.shape[0] + b_TD.shape[0],) + tuple(a_TD.shape[1:]))
    out[a_pos] = a_TD
    out[b_pos] = b_TD
    return out, offsets_B1, b_pos


class GenerativeRecommender(nn.Module):
    """Tokens from the embedding module, the tower, and the retrieval / ranking heads.

    `embeddings` follows TorchRec's contract: `forward(kjt) -> dict[feature, JaggedTensor]`
    (the tiered store, or a TorchRec `EmbeddingCollection`). `feature_dims` gives each
    feature's embedding dimension; the tower maps `[T, D] -> [T, D]` over jagged rows.
    """

    def __init__(
        self,
        *,
        features: FeatureSpec,
        cfg: ModelConfig,
        embeddings: nn.Module,
        feature_dims: dict[str, int],
        tower: nn.Module,
        dim: int,
    ) -> None:
        super().__init__()
        missing = [f for f in features.sparse if f not in feature_dims]
        if missing:
            raise ValueError(f"data.features.sparse names {missing}, which no sparse table serves")
        if features.item not in features.sparse:
            raise ValueError(f"data.features.item {features.item!r} must be one of data.features.sparse")
        if feature_dims[features.item] != dim:
            raise ValueError(
                f"the item table's dimension ({feature_dims[features.item]}) must equal dense.embedding_dim "
                f"({dim}): the retrieval head scores tower states against item rows"
            )
        unknown_tasks = [t for t in cfg.ranking_tasks if t not in features.labels]
        if cfg.ranking and unknown_tasks:
            raise ValueError(f"model.ranking_tasks {unknown_tasks} are not in data.features.labels {features.labels}")
        if cfg.ranking and len(cfg.task_weights) != len(cfg.ranking_tasks):
            raise ValueError("model.task_weights needs one weight per model.ranking_tasks entry")
        if not (cfg.retrieval or cfg.ranking):
            raise ValueError("model: enable at least one of retrieval, ranking")
        if cfg.negatives in ("shared", "per_position") and cfg.num_negatives < 1:
            raise ValueError(f"model.num_negatives must be >= 1 with model.negatives = {cfg.negatives!r}, "
                             f"got {cfg.num_negatives}")
        if cfg.mask_seen and (cfg.negatives != "full" or cfg.in_batch_negatives):
            raise ValueError("model.mask_seen needs model.negatives = 'full' without model.in_batch_negatives, "
                             f"got negatives = {cfg.negatives!r}, in_batch_negatives = {cfg.in_batch_negatives}")
        self.features = features
        self.cfg = cfg
        self.embeddings = embeddings
        self.tower = tower
        self.dim = dim
        # Candidates carry every feature but the action: it is what we predict.
        self.candidate_features = [f for f in features.sparse if f != features.action]
        self.project = None
        if cfg.token_combine == "concat":
            self.project = nn.ModuleDict({
                "history": nn.Linear(sum(feature_dims[f] for f in features.sparse), dim),
                "candidates": nn.Linear(sum(feature_dims[f] for f in self.candidate_features), dim),
            })
        else:
            wrong = {f: d for f, d in feature_dims.items() if f in features.sparse and d != dim}
            if wrong:
                raise ValueError(f"model.token_combine = 'sum' needs every table at dim {dim}; got {wrong}")
        self.label_index = [features.labels.index(t) for t in cfg.ranking_tasks] if cfg.ranking else []
        self.task_heads = None
        if cfg.ranking:
            head_in = {"state": 1, "state_and_token": 2, "cross": 3}[cfg.ranking_head_input] * dim
            self.task_heads = nn.Sequential(
                nn.Linear(head_in, cfg.ranking_hidden_dim), nn.SiLU(), nn.Linear(cfg.ranking_hidden_dim, len(cfg.ranking_tasks))
            )
        self.register_buffer("item_corpus", torch.zeros(0, dtype=torch.int64), persistent=False)
        self._logits_workspace = LogitsWorkspace()  # the fused full-softmax loss's reused logits
        self.item_log_q: torch.Tensor | None = None

    def set_item_corpus(self, item_ids: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """The ids negatives are drawn from (the prepared data's item list, sorted), and
        their training counts (the logQ correction of in-batch negatives)."""
        self.item_corpus = item_ids.to(torch.int64)
        if self.cfg.negatives == "full" and self.item_corpus.numel() > self.cfg.full_softmax_max_items:
            raise ValueError(
                f"model.negatives = 'full' over {self.item_corpus.numel()} items exceeds "
                f"model.full_softmax_max_items ({self.cfg.full_softmax_max_items}); use 'shared' with a large "
                "model.num_negatives, or raise the limit")
        self.item_log_q = None
        if counts is not None:
            q = counts.double().clamp(min=1)
            self.item_log_q = torch.log(q / q.sum()).float()

    # ---- tokens -------------------------------------------------------------------------

    def _lookup(self, kjts: list[KeyedJaggedTensor], replicated: list[bool] | None = None) -> list[dict]:
        """Embedding rows of several KJTs; the sharded store looks them all up in one exchange
        (`lookup_many`; `replicated` marks KJTs every rank passes alike), any other module one
        by one."""
        with record_function("genrec.sparse_forward"):  # a range for `genrec profile`
            return self._rows_of(kjts, replicated)

    def _rows_of(self, kjts: list[KeyedJaggedTensor], replicated: list[bool] | None = None) -> list[dict]:
        """`_lookup` outside a profiler range (for lookups inside another stage's range, whose
        time a stage of their own would count twice)."""
        many = getattr(self.embeddings, "lookup_many", None)
        if many is None:
            return [self.embeddings(k) for k in kjts]
        return many(kjts, replicated) if replicated and any(replicated) else many(kjts)

    def _combine(self, embedded: dict, keys: list[str], which: str) -> torch.Tensor:
        """One token per event from its features' rows (`model.token_combine`)."""
        parts = [embedded[k].values() for k in keys]
        if self.project is None:
            return torch.stack(parts).sum(0)
        return self.project[which](torch.cat(parts, dim=-1))

    def _candidate_kjt(self, candidates: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict({k: candidates[k] for k in self.candidate_features})

    def read_ahead(self, batch: Batch) -> int:
        """Start the disk reads of an upcoming batch's SSD-tier rows, its history's and
        candidates' (negatives are drawn in its step), without waiting: advice only, see
        TieredEmbeddingCollection.read_ahead (collective with several ranks). Returns the
        SSD rows this rank advised; 0 for a module that cannot read ahead."""
        read_ahead = getattr(self.embeddings, "read_ahead", None)
        if read_ahead is None:
            return 0
        kjts = [batch.history]
        if self.cfg.ranking and batch.candidates is not None:
            kjts.append(self._candidate_kjt(batch.candidates))
        return read_ahead(kjts)

    def _items_kjt(self, item_ids: torch.Tensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=[self.features.item], values=item_ids,
            lengths=torch.ones(item_ids.shape[0], dtype=torch.int32, device=item_ids.device),
        )

    def item_rows(self, item_ids: torch.Tensor, replicated: bool = False) -> torch.Tensor:
        """Embedding rows of `item_ids` from the item feature's table: [N, D]. `replicated`:
        every rank looks up the same ids (see `TieredEmbeddingCollection.lookup_many`)."""
        return self._rows_of([self._items_kjt(item_ids)], [replicated])[0][self.features.item].values()

    def _history_states(self, batch: Batch, tokens_TD: torch.Tensor) -> torch.Tensor:
        with record_function("genrec.tower"):
            return self.tower(tokens_TD, batch.history_offsets_B1, batch.timestamps_T,
                              query_time_B=batch.query_time_B)

    def encode(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """History states [T, D] (causal), the task heads' input per candidate (`head_input`:
        [C, D] or [C, 2D]; None without candidates), and the history's item rows [T, D] (the
        retrieval head's positives)."""
        return self._encode(batch)[:3]

    def _embed(self, batch: Batch, extra_item_ids: torch.Tensor | None = None):
        """The batch's rows (history, then candidates, if any), its history tokens [T, D] and
        item rows [T, D], and the rows [N, D] of `extra_item_ids` (None without), looked up
        with the batch's: one exchange of the sharded store instead of two (each is a few
        all-to-alls, about a millisecond apiece between two CPU ranks)."""
        kjts = [batch.history] + ([] if batch.candidates is None else [self._candidate_kjt(batch.candidates)])
        if extra_item_ids is not None:  # the corpus of a full softmax: the same on every rank
            kjts.append(self._items_kjt(extra_item_ids))
        embedded = self._lookup(kjts, [False] * (len(kjts) - 1) + [extra_item_ids is not None])
        extra_ND = None if extra_item_ids is None else embedded[-1][self.features.item].values()
        tokens_TD = self._combine(embedded[0], self.features.sparse, "history")
        return embedded, tokens_TD, embedded[0][self.features.item].values(), extra_ND

    def _encode(self, batch: Batch, extra_item_ids: torch.Tensor | None = None):
        """`encode`, and the rows [N, D] of `extra_item_ids` (None without), looked up with the
        batch's (`_embed`)."""
        embedded, tokens_TD, item_rows_TD, extra_ND = self._embed(batch, extra_item_ids)
        lengths_B = batch.history_lengths_B
        if batch.candidates is None:
            return self._history_states(batch, tokens_TD), None, item_rows_TD, extra_ND
        cand_TD = self._combine(embedded[1], self.candidate_features, "candidates")
        cand_lengths_B = batch.candidates.lengths().view(len(batch.candidates.keys()), -1)[0].long()
        values, offsets_B1, cand_pos = interleave_jagged(tokens_TD, lengths_B, cand_TD, cand_lengths_B)
        ts, _, _ = interleave_jagged(
            batch.timestamps_T.unsqueeze(-1), lengths_B, batch.candidate_timestamps_C.unsqueeze(-1), cand_lengths_B
        )
        with record_function("genrec.tower"):
            states = self.tower(values, offsets_B1, ts.squeeze(-1), num_targets_B=cand_lengths_B,
                                query_time_B=_request_time(batch, cand_lengths_B))
        hist_mask = torch.ones(states.shape[0], dtype=torch.bool, device=states.device)
        hist_mask[cand_pos] = False
        return states[hist_mask], self.head_input(states[cand_pos], cand_TD), item_rows_TD, extra_ND

    # ---- heads --------------------------------------------------------------------------

    def retrieval_loss(self, batch: Batch, states_TD: torch.Tensor, item_rows_TD: torch.Tensor,
                       corpus_rows_ND: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax of each position's state against the next event's item row and the
        negatives that `model.negatives` names (`model.similarity` / temperature).
        `corpus_rows_ND`: the corpus's rows when already looked up ("full" negatives)."""
        cfg = self.cfg
        vec = lambda x: retrieval_vectors(x, cfg.similarity)  # noqa: E731
        if self.item_corpus.numel() == 0:
            raise ValueError("retrieval needs the item corpus: call set_item_corpus() with the prepared item ids")
        item_ids_T = batch.history[self.features.item].values()
        lengths_B = batch.history_lengths_B
        offsets_B1 = batch.history_offsets_B1
        # Position t predicts position t + 1 of the same row: every position but each row's last.
        is_last = torch.zeros(item_ids_T.shape[0], dtype=torch.bool, device=item_ids_T.device)
        is_last[offsets_B1[1:][lengths_B > 0] - 1] = True
        src = torch.nonzero(~is_last).squeeze(-1)
        tgt = src + 1
        if cfg.min_target_action is not None:
            actions = batch.history[self.features.action].values()
            keep = actions[tgt] >= cfg.min_target_action
            src, tgt = src[keep], tgt[keep]
        P, device = src.numel(), states_TD.device
        # The negatives are looked up even when no position is a target: the sharded store's
        # forward and backward are collectives, so every rank makes the same calls each step.
        if cfg.negatives == "full":
            neg_ids = self.item_corpus.to(device)
        elif cfg.negatives == "per_position":
            draws = torch.randint(len(self.item_corpus), (P * cfg.num_negatives,))
            neg_ids = self.item_corpus[draws].to(device)
        elif cfg.negatives == "shared":
            neg_ids = _rank0s(self.item_corpus[torch.randint(len(self.item_corpus), (cfg.num_negatives,))].to(device))
        else:  # in-batch only: no lookup, on every rank alike
            neg_ids = item_ids_T.new_zeros(0)
        if corpus_rows_ND is not None and cfg.negatives == "full":
            neg_rows = corpus_rows_ND
        else:
            # Shared negatives: rank 0's draw on every rank (`_rank0s`); per position: its own,
            # none on a rank without positions, which still makes the lookup (a collective).
            neg_rows = (self.item_rows(neg_ids, replicated=cfg.negatives == "shared") if cfg.negatives != "in_batch"
                        else states_TD.new_zeros(0, self.dim))
        if P == 0:
            return (neg_rows.sum() + states_TD.sum() + item_rows_TD.sum()) * 0.0
        query = vec(states_TD[src])
        target_ids = item_ids_T[tgt]
        if cfg.negatives == "full" and not cfg.in_batch_negatives:
            # Every target is a corpus row: one cross-entropy over the corpus is the softmax of
            # [positive, every other item] without a second copy of the logits to mask.
            target_pos, known = sorted_positions(self.item_corpus.to(device), target_ids)
            if bool(known.all()):
                # 1 / temperature scales the queries, not the [queries, corpus] logits: the
                # division over the logits and its backward were 7% of a Beauty step.
                scaled, corpus = query * (1.0 / cfg.temperature), vec(neg_rows)
                p_idx = seen_pos = None
                if cfg.mask_seen:
                    p_idx, seen_pos = _seen_before(item_ids_T, offsets_B1, src, target_ids, self.item_corpus.to(device))
                if scaled.device.type == "cpu" and not torch.is_autocast_enabled("cpu"):
                    return corpus_cross_entropy(scaled, corpus, target_pos, p_idx, seen_pos, self._logits_workspace)
                logits = scaled @ corpus.T
                if p_idx is not None:
                    logits = logits.index_put((p_idx, seen_pos), logits.new_tensor(float("-inf")))
                return F.cross_entropy(logits, target_pos)
        positive = vec(item_rows_TD[tgt])
        pos_logit = (query * positive).sum(-1, keepdim=True)
        log_q = None
        if cfg.negatives == "in_batch" and self.item_log_q is not None:
            # logQ (Yi et al., 2019): the batch's targets are a sample drawn by popularity, the
            # positive among them, so every one of them, the positive included, is corrected
            # by log q(item) (scaled to the logit's units). Then a uniform q changes nothing.
            pos, _ = sorted_positions(self.item_corpus.to(device), target_ids)
            log_q = cfg.temperature * self.item_log_q.to(device)[pos]
            pos_logit = pos_logit - log_q[:, None]
        logits = [pos_logit]
        if cfg.negatives == "per_position":
            negative = vec(neg_rows).view(P, cfg.num_negatives, -1)
            neg_logits = torch.einsum("pd,pkd->pk", query, negative)
            logits.append(neg_logits.masked_fill(neg_ids.view(P, -1) == target_ids[:, None], float("-inf")))
        elif neg_ids.numel():
            neg_logits = query @ vec(neg_rows).T
            # An accidental hit (a negative that is the target itself) is not a negative.
            logits.append(neg_logits.masked_fill(neg_ids[None, :] == target_ids[:, None], float("-inf")))
        if cfg.negatives == "in_batch" or cfg.in_batch_negatives:
            in_batch = query @ positive.T
            if log_q is not None:
                in_batch = in_batch - log_q[None, :]
            # Another position with the same target item is no negative (the diagonal included).
            logits.append(in_batch.masked_fill(target_ids[None, :] == target_ids[:, None], float("-inf")))
        logits = torch.cat(logits, dim=1) / cfg.temperature
        return F.cross_entropy(logits, torch.zeros(P, dtype=torch.long, device=logits.device))

    def head_input(self, cand_states_CD: torch.Tensor, cand_tokens_CD: torch.Tensor) -> torch.Tensor:
        """What the task heads read for each candidate (`model.ranking_head_input`)."""
        mode = self.cfg.ranking_head_input
        if mode == "state":
            return cand_states_CD
        tokens = cand_tokens_CD.to(cand_states_CD.dtype)
        parts = [cand_states_CD, tokens] + ([cand_states_CD * tokens] if mode == "cross" else [])
        return torch.cat(parts, dim=-1)

    def ranking_logits(self, cand_states_CD: torch.Tensor) -> torch.Tensor:
        return self.task_heads(cand_states_CD).float()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Training loss and its parts."""
        use_candidates = self.cfg.ranking and batch.candidates is not None
        if self.cfg.contrastive_weight > 0 and self.training and not use_candidates:
            return self._forward_two_views(_without_candidates(batch))
        states, cand_states, item_rows, corpus_rows = self._encode(
            batch if use_candidates else _without_candidates(batch), self._softmax_corpus(batch))
        with record_function("genrec.loss"):
            return self._loss(batch, states, cand_states, item_rows, use_candidates, corpus_rows)

    def _softmax_corpus(self, batch: Batch) -> torch.Tensor | None:
        """The item ids of a "full" softmax (None otherwise): the whole corpus, known before the
        tower runs, so its rows come with the batch's (one exchange of the sharded store)."""
        corpus = self.item_corpus if self.cfg.retrieval and self.cfg.negatives == "full" else None
        if corpus is None or corpus.numel() == 0:
            return None  # retrieval_loss names a missing corpus
        return corpus.to(batch.history.values().device)

    def _forward_two_views(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """`forward` under `model.contrastive_weight`: the tokens are looked up once and the
        tower runs twice (two dropout masks); the next-item loss reads the first view."""
        # The corpus of a full softmax comes with the history's rows, as in `forward`, marked as
        # the same on every rank (counted once, not once per rank, by the store's admission).
        _, tokens_TD, item_rows_TD, corpus_rows = self._embed(batch, self._softmax_corpus(batch))
        states, states2 = self._history_states(batch, tokens_TD), self._history_states(batch, tokens_TD)
        with record_function("genrec.loss"):
            loss, parts = self._loss(batch, states, None, item_rows_TD, False, corpus_rows)
            cl = self.contrastive_loss(batch, states, states2)
        parts["contrastive_loss"] = float(cl.detach())
        return loss + self.cfg.contrastive_weight * cl, parts

    def contrastive_loss(self, batch: Batch, view1_TD: torch.Tensor, view2_TD: torch.Tensor) -> torch.Tensor:
        """Symmetric InfoNCE between two views of the same positions: position t of one view
        against every position of the other view that belongs to another row (the other
        positions of its own row are neither positives nor negatives), both ways."""
        T = view1_TD.shape[0]
        row_T = torch.repeat_interleave(torch.arange(batch.batch_size, device=view1_TD.device),
                                        batch.history_lengths_B.to(view1_TD.device), output_size=T)
        own_row = (row_T[:, None] == row_T[None, :]) & ~torch.eye(T, dtype=torch.bool, device=row_T.device)
        sim = (_normalize(view1_TD) @ _normalize(view2_TD).T) / self.cfg.contrastive_temperature
        sim = sim.masked_fill(own_row, float("-inf"))
        labels = torch.arange(T, device=sim.device)
        return 0.5 * (F.cross_entropy(sim, labels) + F.cross_entropy(sim.T, labels))

    def _loss(self, batch: Batch, states, cand_states, item_rows, use_candidates: bool, corpus_rows=None):
        """The retrieval and ranking losses of one batch's states (see `forward`)."""
        loss = states.new_zeros((), dtype=torch.float32)
        parts: dict[str, float] = {}
        if self.cfg.retrieval:
            r = self.retrieval_loss(batch, states, item_rows, corpus_rows)
            loss = loss + self.cfg.retrieval_weight * r
            parts["retrieval_loss"] = float(r.detach())
        if use_candidates:
            logits = self.ranking_logits(cand_states)
            labels = batch.labels_CL[:, self.label_index].float()
            for i, task in enumerate(self.cfg.ranking_tasks):
                # No candidate in the batch (windows of one event): zero, not an empty mean's NaN.
                bce = (F.binary_cross_entropy_with_logits(logits[:, i], labels[:, i]) if logits.shape[0]
                       else logits[:, i].sum())
                loss = loss + self.cfg.task_weights[i] * bce
                parts[f"{task}_loss"] = float(bce.detach())
        return loss, parts

    # ---- scoring (evaluation and serving) ------------------------------------------------

    @torch.no_grad()
    def user_embeddings(self, batch: Batch) -> torch.Tensor:
        """Each user's last history state as retrieval scores it (`retrieval_vectors`): [B, D]."""
        assert bool((batch.history_lengths_B > 0).all()), "every user needs a history to be scored"
        tokens_TD = self._combine(self._lookup([batch.history])[0], self.features.sparse, "history")
        with record_function("genrec.tower"):
            last_BD = self.tower.last_states(tokens_TD, batch.history_offsets_B1, batch.timestamps_T,
                                             query_time_B=batch.query_time_B)
        return retrieval_vectors(last_BD, self.cfg.similarity)

    @torch.no_grad()
    def item_embeddings(self, item_ids: torch.Tensor, block: int = 65536) -> torch.Tensor:
        """Item rows as retrieval scores them (`retrieval_vectors`), in blocks: [N, D]."""
        sim = self.cfg.similarity
        return torch.cat([retrieval_vectors(self.item_rows(item_ids[i : i + block]), sim)
                          for i in range(0, len(item_ids), block)])

    @torch.no_grad()
    def rank_probabilities(self, batch: Batch) -> torch.Tensor:
        """Per-candidate, per-task probabilities [C, num_tasks]."""
        _, cand_states, _ = self.encode(batch)
        return torch.sigmoid(self.ranking_logits(cand_states))


def _request_time(batch: Batch, cand_lengths_B: torch.Tensor) -> torch.Tensor:
    """When a ranking batch's candidates are requested: `query_time_B` if given, else each
    row's first candidate's time (its last event's for a row without candidates), so that
    training encodes the history as serving does for a request at that time."""
    if batch.query_time_B is not None:
        return batch.query_time_B
    ts_C = batch.candidate_timestamps_C
    first_B = torch.ops.fbgemm.asynchronous_complete_cumsum(cand_lengths_B)[:-1]
    last_B = (batch.history_offsets_B1[1:] - 1).clamp(min=0)
    own_B = batch.timestamps_T[last_B] if batch.timestamps_T.numel() else torch.zeros_like(cand_lengths_B)
    if not ts_C.numel():
        return own_B
    return torch.where(cand_lengths_B > 0, ts_C[first_B.clamp(max=ts_C.numel() - 1)], own_B)


def _rank0s(ids_K: torch.Tensor) -> torch.Tensor:
    """Rank 0's `ids_K` on every rank (in place; one rank: as is). The ranks start from one
    seed, but dropout over each rank's own number of tokens moves each one's torch RNG its own
    way, so their draws differ from the first step on; the store counts a replicated lookup's
    ids on rank 0 only, and the other ranks' pools went uncounted (admission, LFU)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(ids_K, src=0)
    return ids_K


def _without_candidates(batch: Batch) -> Batch:
    if batch.candidates is None:
        return batch
    return Batch(
        user_ids_B=batch.user_ids_B, history=batch.history, timestamps_T=batch.timestamps_T,
        history_lengths_B=batch.history_lengths_B, targets_B=batch.targets_B, query_time_B=batch.query_time_B,
    )
