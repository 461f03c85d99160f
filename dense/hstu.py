"""HSTU block (Zhai et al., ICML 2024) over jagged tokens.

    x_n = LayerNorm(x)
    U, V, Q, K = split(SiLU(x_n @ W_uvqk + b))          (SiLU on U only: production variant)
    A = SiLU(alpha Q K^T + rab) / n  * mask              (pointwise, no softmax; see kernels.py)
    y = x + Linear(Dropout(U * LayerNorm(A V)))
    with lowpass_mix a > 0 (TowerConfig): U * ((1 - a) LayerNorm(A V) + a LayerNorm(F)),
    F = LPF(V) + beta * (V - LPF(V)), LPF the mean of each token's last `lowpass_window` V rows

Tokens are jagged: x_TD holds every row's tokens back to back (see jagged.py).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from .config import TowerConfig
from .jagged import JaggedLayout
from .kernels import KERNELS, HSTUAttentionParams


class HSTUBlock(nn.Module):
    def __init__(self, cfg: TowerConfig, kernel: str) -> None:
        super().__init__()
        H, dq, dv, D = cfg.num_heads, cfg.attention_dim, cfg.linear_dim, cfg.embedding_dim
        self.num_heads, self.attention_dim, self.linear_dim = H, dq, dv
        self.silu_u_only = cfg.uvqk_activation == "silu_u"
        self.input_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.uvqk = nn.Linear(D, H * (2 * dv + 2 * dq))  # rows: u, v, q, k
        edges = list(itertools.accumulate([0, H * dv, H * dv, H * dq, H * dq]))
        self._spans = list(zip(edges[:-1], edges[1:]))
        self.attn_norm = nn.LayerNorm(H * dv, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)
        self.output = nn.Linear(H * dv, D)
        nn.init.normal_(self.uvqk.weight, std=0.02)  # the reference's init
        nn.init.zeros_(self.uvqk.bias)
        self.kernel = KERNELS[("hstu", kernel)]
        self.params = HSTUAttentionParams(
            alpha=cfg.attention_dim ** -0.5 if cfg.scale_qk else 1.0, normalizer=cfg.normalizer,
            max_seq_len=cfg.max_seq_len, num_time_buckets=cfg.num_time_buckets,
            time_bucket_divisor=cfg.time_bucket_divisor, bucket_min_fill=cfg.bucket_min_fill,
            block_elems=cfg.attention_block_elems)
        self.ts_w = nn.Parameter(torch.zeros(cfg.num_time_buckets + 1)) \
            if cfg.attention_bias in ("time_and_position", "time") else None
        self.pos_w = nn.Parameter(torch.zeros(cfg.max_seq_len)) \
            if cfg.attention_bias in ("time_and_position", "position") else None
        for w in (self.ts_w, self.pos_w):
            if w is not None:
                nn.init.normal_(w, std=0.02)
        self.lowpass_mix, self.lowpass_window = cfg.lowpass_mix, cfg.lowpass_window
        if self.lowpass_mix:
            self.lowpass_norm = nn.LayerNorm(H * dv, eps=cfg.layer_norm_eps)
            self.lowpass_beta = nn.Parameter(torch.ones(H * dv))

    def project(self, x_TD: torch.Tensor):
        """-> (u [T, H*dv], q [T, H, dq], k [T, H, dq], v [T, H, dv]).

        One product per output, each with its rows of the one `uvqk` weight: every output
        is then a tensor of its own, and its gradient goes to x and to its rows of W alone.
        Split out of one [T, H * (2 dv + 2 dq)] product, the four gradients would be
        concatenated back in the backward, and q, k, v copied to contiguous tensors for the
        kernel (measured 6% of a 128 x 200 x 50 training step with one head, 10% with two)."""
        H, dq, dv = self.num_heads, self.attention_dim, self.linear_dim
        xn = self.input_norm(x_TD)
        w, b = self.uvqk.weight, self.uvqk.bias
        u, v, q, k = (F.linear(xn, w[s:e], b[s:e]) for s, e in self._spans)
        if self.silu_u_only:
            u = F.silu(u)
        else:
            u, v, q, k = (F.silu(t) for t in (u, v, q, k))
        shape = x_TD.shape[:-1]
        return u, q.reshape(*shape, H, dq), k.reshape(*shape, H, dq), v.reshape(*shape, H, dv)

    def finish(self, x_TD: torch.Tensor, u: torch.Tensor, attn: torch.Tensor,
               v_lpf: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """attn [..., H*dv] -> block output; `v_lpf` = (V, LPF(V)) from `lowpass` with lowpass_mix."""
        mixed = self.attn_norm(attn)
        if self.lowpass_mix:
            v, lpf = v_lpf
            f = lpf + self.lowpass_beta * (v - lpf)
            mixed = (1 - self.lowpass_mix) * mixed + self.lowpass_mix * self.lowpass_norm(f)
        return x_TD + self.output(self.dropout(u * mixed))

    def lowpass(self, v_TX: torch.Tensor, layout: JaggedLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(V, LPF(V)) [T, H*dv]: each token's mean over its own V and the V of the up to
        window - 1 tokens before its position in the row (a candidate's position is right
        after the history: it averages the history's last tokens, never other candidates)."""
        T = v_TX.shape[0]
        row_T = torch.repeat_interleave(torch.arange(layout.batch_size, device=v_TX.device), layout.lengths_B,
                                        output_size=T)
        pos_T = layout.positions_T
        anchor_T = layout.offsets_B1[row_T] + pos_T  # index of the token at the row's position pos
        acc = v_TX
        for m in range(1, self.lowpass_window):
            src = (anchor_T - m).clamp(min=0)
            acc = acc + v_TX[src] * (pos_T >= m).unsqueeze(1).to(v_TX.dtype)
        n_T = (pos_T + 1).clamp(max=self.lowpass_window).unsqueeze(1).to(v_TX.dtype)
        return v_TX, acc / n_T

    def lowpass_candidates(self, v_BMX: torch.Tensor, values_BHLd: torch.Tensor,
                           history_lengths_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`lowpass` of candidates [B, M, H*dv] scored against cached history values."""
        B, H, L, dv = values_BHLd.shape
        if L == 0:  # no row has history: each candidate's window is itself
            return v_BMX, v_BMX
        hist_BX = values_BHLd.transpose(1, 2).reshape(B, L, H * dv)
        acc, rows = v_BMX, torch.arange(B, device=v_BMX.device)
        for m in range(1, self.lowpass_window):
            ok = (history_lengths_B >= m).to(v_BMX.dtype).unsqueeze(1)
            acc = acc + (hist_BX[rows, (history_lengths_B - m).clamp(min=0)].to(v_BMX.dtype) * ok).unsqueeze(1)
        n_B = (history_lengths_B + 1).clamp(max=self.lowpass_window).to(v_BMX.dtype)
        return v_BMX, acc / n_B[:, None, None]

    def forward(self, x_TD: torch.Tensor, layout: JaggedLayout, return_kv: bool = False):
        """-> y_TD, or (y_TD, k_THd, v_THd) with return_kv (for the history cache)."""
        u, q, k, v = self.project(x_TD)
        attn = self.kernel(q, k, v, layout, self.ts_w, self.pos_w, self.params)
        v_lpf = self.lowpass(v.flatten(1), layout) if self.lowpass_mix else None
        y = self.finish(x_TD, u, attn.flatten(1), v_lpf)
        return (y, k, v) if return_kv else y
