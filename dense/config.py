"""Configuration of the sequence tower (HSTU or the SASRec-style Transformer baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class TowerConfig:
    """One sequence tower: jagged per-event embeddings in, jagged per-event states out.

    Defaults follow the HSTU paper / the public generative-recommenders reference
    (`research/modeling/sequential/hstu.py`): pointwise SiLU attention divided by the
    maximum sequence length, relative position + log-bucketed time-gap bias, SiLU on all of
    U, V, Q, K and unscaled Q K^T.
    """

    kind: Literal["hstu", "sasrec", "transformer"] = "hstu"
    """Which block: "hstu" (Zhai et al., ICML 2024), "sasrec" (the original SASRec block:
    normalized queries, raw keys and values, ReLU FFN) or "transformer" (pre-LN causal
    softmax attention + GELU FFN)."""
    embedding_dim: int = 64
    """D: width of the input tokens and of the output states."""
    num_layers: int = 2
    """Number of stacked blocks."""
    num_heads: int = 2
    """H: attention heads."""
    attention_dim: int = 32
    """d_qk: per-head width of queries and keys."""
    linear_dim: int = 32
    """d_v: per-head width of values (and of U in HSTU)."""
    dropout: float = 0.2
    """Dropout before the output projection (HSTU) / on attention output and FFN (Transformer)."""
    max_seq_len: int = 256
    """Bound on history + candidates per row. Sizes the relative position bias (and absolute
    position embeddings); the default HSTU normalizer divides by it."""
    num_time_buckets: int = 128
    """Time-gap buckets: bucket = floor(log(max(|dt|, 1)) / 0.301) clamped to [0, this]."""
    time_bucket_divisor: float = 0.301
    """Divisor of the natural log in the time-gap bucketing (the reference's 0.301)."""
    normalizer: Literal["max_seq_len", "num_keys", "none"] = "max_seq_len"
    """HSTU: what n in SiLU(QK^T + rab) / n is. "max_seq_len" (reference): the constant
    `max_seq_len`; "num_keys": per query, the number of keys it may see; "none": 1."""
    attention_bias: Literal["time_and_position", "position", "time", "none"] = "time_and_position"
    """HSTU relative attention bias (rab): learned per relative position and/or per
    log-bucketed time gap, shared by all heads."""
    time_bias_query: Literal["own", "next"] = "own"
    """HSTU: the query time ts_q(i) of the time-gap bias ts_w[bucket(ts_q(i) - ts(j))]. "own":
    the query's own time (the diagonal is always bucket 0). "next" (the public reference): the
    time of the event being predicted, ts(i + 1) of the same row, so each key carries "time
    since that event, at prediction time"; a row's last history event takes the caller's
    `query_time_B` (e.g. the request time) or else its own time, and ranking candidates their
    own (impression) time. Keys always use their own time."""
    uvqk_activation: Literal["silu_all", "silu_u"] = "silu_all"
    """HSTU: SiLU on all of U, V, Q, K (paper) or on U only (production variant)."""
    scale_qk: bool = False
    """HSTU: multiply Q K^T by d_qk^-0.5 (production variant). The Transformer always scales."""
    position_embedding: Literal["auto", "none", "absolute"] = "auto"
    """Learned absolute position embedding added to the input. "auto": none for HSTU (it has
    rab), absolute for the Transformer (SASRec). Candidates all take the position right
    after their row's history."""
    input_scale: Literal["none", "sqrt_dim"] = "none"
    """Multiply the input tokens by sqrt(embedding_dim) before adding positions (the public
    HSTU / SASRec references do, so that N(0, 0.02)-initialized rows are not drowned by the
    position embedding)."""
    input_dropout: float = 0.0
    """Dropout on the input tokens (after scaling and positions); the references use 0.2."""
    lowpass_mix: float = 0.0
    """HSTU: weight a of a causal low-pass branch (BSARec's inductive bias, Shin et al., AAAI
    2024, made causal): each token's values V are also averaged over its row's last
    `lowpass_window` tokens, itself included (a ranking candidate: itself and the history's
    last ones), F = LPF(V) + beta * (V - LPF(V)) with beta learned per channel, and the
    gate reads (1 - a) * LN(A V) + a * LN(F). 0: off."""
    lowpass_window: int = 8
    """HSTU: the low-pass branch's window, in tokens."""
    ffn_multiplier: int = 4
    """Transformer: FFN hidden width = ffn_multiplier * embedding_dim."""
    kernel: Literal["auto", "reference", "chunked", "triton", "sdpa"] = "auto"
    """Attention implementation. "reference": plain padded PyTorch (the specification);
    "chunked": HSTU length-bucketed, query-blocked kernel that never materializes [B, N, N]
    (on CUDA tensors with Triton installed it runs "triton"); "triton": HSTU Triton kernels
    on the jagged tokens (CUDA; CPU only under TRITON_INTERPRET=1);
    "sdpa": Transformer length-bucketed scaled_dot_product_attention. "auto": the fast one."""
    attention_block_elems: int = 4_000_000
    """Chunked/bucketed kernels: upper bound on elements of one [rows, H, q_block, keys]
    attention tile, which sets the peak attention memory."""
    bucket_min_fill: float = 0.75
    """Length bucketing: a row joins the current bucket while its length is at least this
    fraction of the bucket's longest row (bounds padding waste)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of storing them."""
    target_micro_batch: int = 256
    """`score_targets`: candidates per row scored at once against the cached history
    (M-FALCON micro-batch); bounds memory, never changes the result."""
    layer_norm_eps: float = 1e-6
    """Epsilon of every LayerNorm."""

    def __post_init__(self) -> None:
        if self.kind not in ("hstu", "sasrec", "transformer"):
            raise ValueError(f"dense.kind must be 'hstu', 'sasrec' or 'transformer', got {self.kind!r}")
        if self.num_time_buckets > 255:
            raise ValueError(f"dense.num_time_buckets must be <= 255 (uint8 bucket index), got {self.num_time_buckets}")
        for name in ("embedding_dim", "num_layers", "num_heads", "attention_dim", "linear_dim",
                     "max_seq_len", "num_time_buckets", "target_micro_batch",
                     "attention_block_elems", "ffn_multiplier", "lowpass_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"dense.{name} must be positive, got {getattr(self, name)}")
        for name in ("dropout", "input_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"dense.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.lowpass_mix <= 1.0:
            raise ValueError(f"dense.lowpass_mix must be in [0, 1], got {self.lowpass_mix}")
        if self.lowpass_mix and self.kind != "hstu":
            raise ValueError(f"dense.lowpass_mix is an HSTU branch; kind {self.kind!r} has none")
        if not 0.0 < self.bucket_min_fill <= 1.0:
            raise ValueError(f"dense.bucket_min_fill must be in (0, 1], got {self.bucket_min_fill}")
        if self.time_bias_query not in ("own", "next"):
            raise ValueError(f'dense.time_bias_query must be "own" or "next", got {self.time_bias_query!r}')
        if self.kind == "hstu" and self.kernel == "sdpa":
            raise ValueError('dense.kernel="sdpa" is a Transformer kernel; HSTU takes "chunked" or "triton"')
        if self.kind != "hstu" and self.kernel in ("chunked", "triton"):
            raise ValueError(f'dense.kernel="{self.kernel}" is an HSTU kernel; kind {self.kind!r} takes "sdpa"')

    @property
    def resolved_kernel(self) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "chunked" if self.kind == "hstu" else "sdpa"

    @property
    def uses_absolute_positions(self) -> bool:
        if self.position_embedding == "auto":
            return self.kind != "hstu"
        return self.position_embedding == "absolute"
