"""The sequence tower: a stack of HSTU or Transformer blocks on jagged tokens, plus the
per-layer key/value cache for incremental candidate scoring (M-FALCON).

Worked example (D = 4, two users; user 0 has 3 events, user 1 has 1):

    values_TD     float [4, 4]     rows 0..2 are user 0's events, row 3 is user 1's
    offsets_B1    [0, 3, 4]
    timestamps_T  [100, 160, 200, 50]
    tower(values_TD, offsets_B1, timestamps_T)              -> states [4, 4], causal

Ranking with 2 candidates for user 0 and 1 for user 1, appended after each history:

    values_TD     [7, 4]  = [h0 h1 h2 c0 c1 | h3 c2]
    offsets_B1    [0, 5, 7]
    num_targets_B [2, 1]
    tower(values_TD, offsets_B1, timestamps_T, num_targets_B)   -> states [7, 4]

The same candidate states, history encoded once:

    states, cache = tower.encode_history(history_TD, [0, 3, 4], ts_T)
    cand_states_CD = tower.score_targets(cache, [c0 c1 c2], [0, 2, 3], cand_ts_C)

Each row's last state only (what retrieval reads; rows 2 and 3 of the first example):

    tower.last_states(values_TD, [0, 3, 4], timestamps_T)           -> [2, 4]

With TowerConfig.time_bias_query="next", history event i's time bias is taken at the time of
event i + 1; pass the time of the prediction (e.g. the request time) for each row's last
history event as query_time_B [B] to forward / encode_history, same value to both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import TowerConfig
from . import fused as _fused
from .hstu import HSTUBlock
from .jagged import JaggedLayout, make_layout
from .bias import time_buckets
from .kernels import _inv_n, hstu_target_attention_fused, relative_bias
from .transformer import SASRecBlock, TransformerBlock


@dataclass
class HistoryCache:
    """Everything `score_targets` needs about the encoded histories (padded per row)."""

    history_lengths_B: torch.Tensor
    """int64 [B]."""
    timestamps_BL: torch.Tensor
    """int64 [B, L] (L = longest history; padding is 0)."""
    valid_BL: torch.Tensor
    """bool [B, L]."""
    keys: list[torch.Tensor]
    """Per layer [B, H, L, d_qk]; 0 at padding."""
    values: list[torch.Tensor]
    """Per layer [B, H, L, d_v]; 0 at padding (`score_targets` relies on it: HSTU's
    pointwise attention weights padded keys by their value row, not by a mask)."""


class SequenceTower(nn.Module):
    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        block = {"hstu": HSTUBlock, "sasrec": SASRecBlock, "transformer": TransformerBlock}[cfg.kind]
        self.layers = nn.ModuleList(block(cfg, cfg.resolved_kernel) for _ in range(cfg.num_layers))
        self.position_embedding = (nn.Embedding(cfg.max_seq_len, cfg.embedding_dim)
                                   if cfg.uses_absolute_positions else None)
        if self.position_embedding is not None:
            nn.init.normal_(self.position_embedding.weight, std=0.02)
        self.input_scale = cfg.embedding_dim ** 0.5 if cfg.input_scale == "sqrt_dim" else 1.0
        self.input_dropout = nn.Dropout(cfg.input_dropout) if cfg.input_dropout > 0 else nn.Identity()
        # Softmax stacks end with a norm (SASRec's last LayerNorm); HSTU's reference returns
        # the residual stream as is.
        self.final_norm = (nn.LayerNorm(cfg.embedding_dim, eps=cfg.layer_norm_eps)
                           if cfg.kind != "hstu" else nn.Identity())
        self.activation_checkpointing = cfg.activation_checkpointing

    def _check_values(self, values_TD: torch.Tensor, offsets_B1: torch.Tensor, what: str) -> None:
        if values_TD.dim() != 2 or values_TD.shape[1] != self.cfg.embedding_dim:
            raise ValueError(f"{what} must be [T, {self.cfg.embedding_dim}] (TowerConfig.embedding_dim), "
                             f"got {tuple(values_TD.shape)}")
        if values_TD.shape[0] != int(offsets_B1[-1]):
            raise ValueError(f"{what} has {values_TD.shape[0]} rows but offsets end at {int(offsets_B1[-1])}")

    def _embed_input(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens as the first block sees them: scaled, plus absolute positions, dropout."""
        if self.input_scale != 1.0:
            x = x * self.input_scale
        if self.position_embedding is not None:
            x = x + self.position_embedding(positions)
        return self.input_dropout(x)

    def _run_layers(self, x_TD: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x_TD = checkpoint(layer, x_TD, layout, use_reentrant=False)
            else:
                x_TD = layer(x_TD, layout)
        return self.final_norm(x_TD)

    def _layout(self, offsets_B1, timestamps_T, num_targets_B, query_time_B) -> JaggedLayout:
        return make_layout(offsets_B1, timestamps_T, num_targets_B, self.cfg.max_seq_len,
                           time_bias_query=self.cfg.time_bias_query, query_time_B=query_time_B)

    def forward(self, values_TD: torch.Tensor, offsets_B1: torch.Tensor, timestamps_T: torch.Tensor,
                num_targets_B: torch.Tensor | None = None,
                query_time_B: torch.Tensor | None = None) -> torch.Tensor:
        """Jagged [T, D] -> jagged [T, D]; the last num_targets_B[b] tokens of row b are
        ranking candidates under the target-aware mask (None: plain causal).

        query_time_B: int64 [B] or None; under TowerConfig.time_bias_query="next" the query
        time of row b's last history event (the request time at serving, the target event's
        time at evaluation); None: its own time. Ignored under "own"."""
        self._check_values(values_TD, offsets_B1, "values_TD")
        layout = self._layout(offsets_B1, timestamps_T, num_targets_B, query_time_B)
        return self._run_layers(self._embed_input(values_TD, layout.positions_T), layout)

    @torch.no_grad()
    def encode_history(self, values_TD: torch.Tensor, offsets_B1: torch.Tensor,
                       timestamps_T: torch.Tensor, query_time_B: torch.Tensor | None = None,
                       last_only: bool = False) -> tuple[torch.Tensor, HistoryCache]:
        """Causal encoding of the histories, keeping each layer's keys and values; equals the
        history rows of forward(history + candidates, num_targets_B, query_time_B) for the
        same query_time_B (candidates never change the history's query times).

        last_only: the states are each row's last history state [B, D] (what retrieval reads)
        instead of [T, D]; the last layer then attends from those rows only (see `last_states`)."""
        states, (K, V, ts_BL, valid_BL), layout = self._encode_rows(values_TD, offsets_B1, timestamps_T,
                                                                   query_time_B, keep_kv=True,
                                                                   last_only=last_only)
        cache = HistoryCache(history_lengths_B=layout.lengths_B, timestamps_BL=ts_BL, valid_BL=valid_BL,
                             keys=K, values=V)
        return states, cache

    @torch.no_grad()
    def last_states(self, values_TD: torch.Tensor, offsets_B1: torch.Tensor, timestamps_T: torch.Tensor,
                    query_time_B: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's last state [B, D]: forward(...)[offsets_B1[1:] - 1] (every row needs a
        token), for inference. The last layer's other rows feed nothing, so that layer
        projects every token (its keys and values) but attends from each row's last token
        only: at length N it does 1/N of its attention and output work."""
        return self._encode_rows(values_TD, offsets_B1, timestamps_T, query_time_B, keep_kv=False,
                                 last_only=True)[0]

    def _encode_rows(self, values_TD, offsets_B1, timestamps_T, query_time_B, *, keep_kv: bool,
                     last_only: bool):
        """-> (states [T, D], or [B, D] with last_only; (keys, values, timestamps_BL, valid_BL),
        the padded per-layer cache (keep_kv), only the last layer's without it; layout)."""
        self._check_values(values_TD, offsets_B1, "values_TD")
        layout = self._layout(offsets_B1, timestamps_T, None, query_time_B)
        if last_only and layout.batch_size and int(layout.lengths_B.min()) == 0:
            raise ValueError("last_only needs at least one token in every row (offsets_B1 has an empty row)")
        x_TD = self._embed_input(values_TD, layout.positions_T)
        last = self.layers[-1]
        # A block whose output mixes in neighbours' values (HSTU's lowpass) runs whole.
        trim = last_only and not getattr(last, "lowpass_mix", 0)
        kvs, uq = [], None
        for layer in self.layers:
            if trim and layer is last:
                u, q, k, v = layer.project(x_TD)
                uq = (u, q)
            else:
                x_TD, k, v = layer(x_TD, layout, return_kv=True)
            if keep_kv or (trim and layer is last):
                kvs.append((k, v))
        B, L = layout.batch_size, layout.max_len
        index = layout.padded_index()

        def pad(t_TX: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [B, H, L, d]
            if t_TX.shape[0] == B * L:  # every row L long: the padded order is the jagged one
                out = t_TX
            else:
                out = t_TX.new_zeros((B * L,) + t_TX.shape[1:])
                out[index] = t_TX
            return out.view(B, L, *t_TX.shape[1:]).transpose(1, 2).contiguous()

        ts = layout.timestamps_T.new_zeros(B * L)
        ts[index] = layout.timestamps_T
        valid = torch.zeros(B * L, dtype=torch.bool, device=values_TD.device)
        valid[index] = True
        padded = ([pad(k) for k, _ in kvs], [pad(v) for _, v in kvs], ts.view(B, L), valid.view(B, L))
        if last_only:
            last_B = layout.offsets_B1[1:] - 1
            if trim:
                u, q = uq
                x_TD = self._last_row_attention(last, x_TD[last_B], None if u is None else u[last_B], q[last_B],
                                                padded[0][-1], padded[1][-1], padded[2], padded[3],
                                                layout.lengths_B, layout.query_timestamps_T[last_B])
            else:
                x_TD = x_TD[last_B]
        return self.final_norm(x_TD), padded, layout

    def _last_row_attention(self, layer, x_BD, u_BX, q_BHd, K_BHLd, V_BHLd, ts_BL, valid_BL, lengths_B,
                            query_ts_B) -> torch.Tensor:
        """`layer`'s output for each row's last token (position lengths_B - 1, query time
        query_ts_B) attending to the row's padded keys and values (itself included)."""
        B, H, L, _ = K_BHLd.shape
        q = q_BHd.unsqueeze(2)                                       # [B, H, 1, dq]
        if self.cfg.kind == "hstu":
            p = layer.params
            if p.alpha != 1.0:
                q = q * p.alpha
            s = torch.matmul(q, K_BHLd.transpose(-1, -2))           # [B, H, 1, L]
            keys_L = torch.arange(L, device=q.device)
            rab = relative_bias((lengths_B - 1)[:, None], query_ts_B[:, None], keys_L[None, :], ts_BL,
                                layer.ts_w, layer.pos_w, p)          # [B, L]
            if rab is not None:
                s = s + rab[:, None, None, :].to(s.dtype)
            # Padded keys need no mask: their value rows are 0.
            attn = torch.matmul(F.silu(s), V_BHLd)                  # [B, H, 1, dv]
            inv_n = _inv_n(lengths_B - 1, lengths_B, p)             # the kernels' 1 / n of row len - 1
            attn = attn * (inv_n if isinstance(inv_n, float) else inv_n.to(attn.dtype)[:, None, None, None])
        else:
            s = torch.matmul(q, K_BHLd.transpose(-1, -2)) * layer.attention_dim ** -0.5
            s = s.masked_fill(~valid_BL[:, None, None, :], float("-inf"))
            a = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1)
            attn = torch.matmul(a.to(V_BHLd.dtype), V_BHLd)
        return layer.finish(x_BD, u_BX, attn.reshape(B, H * V_BHLd.shape[-1]))

    @torch.no_grad()
    def score_targets(self, cache: HistoryCache, target_values_CD: torch.Tensor,
                      target_offsets_B1: torch.Tensor, target_timestamps_C: torch.Tensor,
                      micro_batch: int | None = None) -> torch.Tensor:
        """Candidate states against the cached histories; equals the candidate rows of
        forward(history + candidates, num_targets_B=candidate counts). A candidate reads
        the history and itself only (the target-aware mask), so any number of candidates
        per row may be scored against a history shorter than max_seq_len: each one's state
        is the one forward(history + that candidate) gives it. Candidates are scored
        `micro_batch` (None: TowerConfig.target_micro_batch) per row at a time; each costs
        O(history) per layer.
        Candidates are queries at their own time under either `time_bias_query`."""
        self._check_values(target_values_CD, target_offsets_B1, "target_values_CD")
        B = cache.history_lengths_B.numel()
        if target_offsets_B1.shape != (B + 1,):
            raise ValueError(f"target_offsets_B1 must be [{B + 1}] (batch size of the cache + 1), "
                             f"got {tuple(target_offsets_B1.shape)}")
        target_offsets_B1 = target_offsets_B1.long()
        counts_B = target_offsets_B1[1:] - target_offsets_B1[:-1]
        if B and int(cache.history_lengths_B.max()) + 1 > self.cfg.max_seq_len:
            raise ValueError("history + one candidate exceed TowerConfig.max_seq_len")
        max_c = int(counts_B.max()) if B else 0
        out = target_values_CD.new_empty(target_values_CD.shape)
        m = micro_batch or self.cfg.target_micro_batch
        for c0 in range(0, max_c, m):
            c_M = torch.arange(c0, min(max_c, c0 + m), device=counts_B.device)
            valid_BM = c_M[None, :] < counts_B[:, None]
            idx_BM = torch.where(valid_BM, target_offsets_B1[:-1, None] + c_M[None, :], 0)
            x = target_values_CD[idx_BM]                       # [B, M, D]
            ts_BM = target_timestamps_C.long()[idx_BM]
            y = self._score_micro_batch(cache, x, ts_BM)
            out[idx_BM[valid_BM]] = y[valid_BM]
        return out

    def _score_micro_batch(self, cache: HistoryCache, x_BMD: torch.Tensor, ts_BM: torch.Tensor) -> torch.Tensor:
        hist_B = cache.history_lengths_B
        B, M, _ = x_BMD.shape
        x_BMD = self._embed_input(x_BMD, hist_B[:, None].expand(B, M))
        L = cache.timestamps_BL.shape[1]
        # Bias indices depend only on positions and timestamps: once per micro-batch, not per layer.
        # The chunked kernel's fused tile scores candidates too; "reference" keeps plain PyTorch.
        # Candidates scored at one time per row (a request's candidates) share their bias row:
        # then plain matrix products over all of them beat the per-row native kernel.
        shared_time = bool((ts_BM == ts_BM[:, :1]).all()) if M else True
        fused = (self.cfg.kind == "hstu" and self.cfg.resolved_kernel == "chunked" and not shared_time
                 and self.layers[0].params.fused and _fused.supports(x_BMD, *cache.keys, *cache.values))
        if self.cfg.kind == "hstu" and not fused:
            p = self.layers[0].params
            pos_idx = (hist_B[:, None, None] - torch.arange(L, device=x_BMD.device)).clamp(0, p.max_seq_len - 1)
            ts_q = ts_BM[:, :1] if shared_time else ts_BM
            t_idx = time_buckets(ts_q[:, :, None] - cache.timestamps_BL[:, None, :],
                                 p.num_time_buckets, p.time_bucket_divisor)
        for layer, K, V in zip(self.layers, cache.keys, cache.values):
            u, q, k, v = layer.project(x_BMD)                 # q, k: [B, M, H, dq]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, M, d]
            valid = cache.valid_BL[:, None, None, :]
            fused_attn = None
            if fused:
                fused_attn = hstu_target_attention_fused(
                    q, k, v, K, V, layer.ts_w, layer.pos_w, hist_B, cache.timestamps_BL, ts_BM, layer.params)
            v_lpf = (layer.lowpass_candidates(v.transpose(1, 2).reshape(B, M, -1), V, hist_B)
                    if self.cfg.kind == "hstu" and layer.lowpass_mix else None)
            if fused_attn is not None:
                x_BMD = layer.finish(x_BMD, u, fused_attn.transpose(1, 2).reshape(B, M, -1), v_lpf)
                continue
            if self.cfg.kind == "hstu" and layer.params.alpha != 1.0:
                q = q * layer.params.alpha  # on q [B, H, M, d], not on the scores [B, H, M, L]
            s_hist = torch.matmul(q.to(K.dtype), K.transpose(-1, -2))  # [B, H, M, L]
            s_self = (q * k).sum(-1, keepdim=True)            # [B, H, M, 1]
            hist_scale = None
            if self.cfg.kind == "hstu":
                p = layer.params
                rab = None
                if layer.pos_w is not None:
                    rab = layer.pos_w[pos_idx]
                if layer.ts_w is not None:
                    rab = layer.ts_w[t_idx] if rab is None else rab + layer.ts_w[t_idx]
                zero = hist_B.new_zeros(1)
                rab_self = relative_bias(zero, zero, zero, zero, layer.ts_w, layer.pos_w, p)
                if rab is not None:
                    s_self = s_self + rab_self
                native = shared_time and self.cfg.resolved_kernel == "chunked" and _fused.supports(s_hist)
                if p.normalizer == "max_seq_len":
                    inv_n = 1.0 / p.max_seq_len
                elif p.normalizer == "num_keys":
                    inv_n = 1.0 / (hist_B.float() + 1)[:, None, None, None]
                else:
                    inv_n = 1.0
                # No mask pass over the scores: a padded key's value row is 0 (HistoryCache),
                # and 1 / n scales the [B, H, M, dv] product instead.
                if native:  # SiLU(s + bias) in one pass; every row of a user shares its bias row
                    a_hist = _fused.bias_silu_(s_hist.view(B, s_hist.shape[1] * s_hist.shape[2], L),
                                               None if rab is None else rab.view(B, L))
                    a_hist = a_hist.view(s_hist.shape)
                else:
                    if rab is not None:
                        s_hist.add_(rab[:, None].to(s_hist.dtype))
                    a_hist = F.silu(s_hist, inplace=True)
                hist_scale = inv_n
                a_self = F.silu(s_self) * inv_n
            else:
                scale = layer.attention_dim ** -0.5
                s = torch.cat([s_hist.masked_fill(~valid, float("-inf")), s_self], dim=-1) * scale
                a = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1)
                a_hist, a_self = a[..., :L], a[..., L:]
            attn = torch.matmul(a_hist.to(V.dtype), V).to(v.dtype)  # [B, H, M, dv]
            if hist_scale is not None:
                attn.mul_(hist_scale)
            attn = attn + a_self.to(v.dtype) * v
            attn = attn.transpose(1, 2).reshape(B, M, -1)
            x_BMD = layer.finish(x_BMD, u, attn) if v_lpf is None else layer.finish(x_BMD, u, attn, v_lpf)
        return self.final_norm(x_BMD)


def build_tower(cfg: TowerConfig) -> SequenceTower:
    """The tower for `cfg` (HSTU or Transformer), parameters in fp32 on CPU."""
    return SequenceTower(cfg)
