"""How a server answers: the limits of a request and the serving path's knobs
(`genrec serve`'s flags set them; `ServingConfig` checks them when made)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ServingConfig:
    max_k: int = 1000
    """Largest K (retrieved candidates) a request may ask for. K is not bounded by the tower's
    max_seq_len: under the target-aware mask a candidate sees the history and itself only,
    so candidates are scored in chunks that fit beside the history."""
    max_n: int = 1000
    """Largest N (returned items) a request may ask for."""
    max_history: int | None = None
    """Events kept per history (the most recent). None: the tower's max_seq_len - 1 (room
    for one candidate beside the longest history)."""
    max_request_events: int = 100_000
    """Requests with more events than this are rejected, not truncated (bounds parsing work)."""
    micro_batch: int = 512
    """M-FALCON: candidates per user scored at once against the cached history (the
    tower's own `target_micro_batch` does not apply). 500 candidates against a history of
    1,024 (one thread, D = 64, 2 layers) ranked in 7.7-8.2 ms as one micro-batch of 512,
    9.0-9.2 in two of 256, 9.5-10.3 in four of 128, 11.8-12.2 in eight of 64; the scores held
    at once are users x heads x micro_batch x history floats (64 MB for a batch of 16
    users, 2 heads, history 1,024)."""
    retrieval_block_rows: int = 1 << 20
    """Without the native scan (GENREC_DENSE_FUSED=0): item-index rows per matmul + top-k
    block (bounds the score buffer: 4 bytes per row and user of a server batch). One top-k
    over 1M scores costs about a third of 16 over 64K blocks and their merges."""
    history_dtype: str = "auto"
    """Dtype of the candidates' scores against the cached history (M-FALCON's [candidates x
    history] products, the rank step's largest cost): "bf16" (fp32 accumulation; ranking
    probabilities within about 2e-4 of fp32 in `genrec bench serve`), "fp32" (the training
    model's arithmetic: served scores equal it), or "auto": bf16 where the CPU multiplies bf16
    natively (AVX-512 BF16, AMX) and the products are large (`ranker.AUTO_BF16_MIN_SCORES`), else
    fp32. The retrieval user vector is fp32 either way."""
    advertiser_feature: str = "advertiser_id"
    """Item side feature that `allowed_advertisers` filters on. Another name than this default
    must be one of the artifact's item features (refused at load); the default may be absent,
    and then a request with `allowed_advertisers` gets a 422 naming it."""
    exact_retrieval: bool = False
    """Search the exact item index even when the artifact has an approximate one (recall checks)."""
    ann_nprobe: int | None = None
    """Lists the approximate index scans per query; None: the nprobe calibrated at export."""
    table_cache_mb: float = 256.0
    """Bound on the hot rows (fp32) held in this process per embedding table
    (models/serving/mapped.py); 0: none. Only tables whose rows as fp32 exceed it get a
    cache: a smaller table stays whole in the page cache, where a probe costs more than a
    read. The tables stay memory-mapped either way."""

    def __post_init__(self) -> None:
        # Refused here, not per request: micro_batch < 0 scored uninitialised states.
        for key in ("max_k", "max_n", "max_request_events", "micro_batch", "retrieval_block_rows",
                    "max_history", "ann_nprobe"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"ServingConfig.{key} must be an integer >= 1, got {v!r}")
        if not 0 <= self.table_cache_mb < float("inf"):
            raise ValueError(f"ServingConfig.table_cache_mb must be a finite number >= 0, got {self.table_cache_mb}")
        if self.history_dtype not in ("fp32", "bf16", "auto"):
            raise ValueError(f"ServingConfig.history_dtype must be one of ['auto', 'bf16', 'fp32'], "
                             f"got {self.history_dtype!r}")
