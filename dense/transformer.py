"""Softmax-attention blocks over jagged tokens: the original SASRec block and a pre-LN
Transformer block. Same jagged interface and masks as HSTU (see kernels.py).

SASRec (Kang & McAuley, ICDM 2018; the block of its public implementations), kind "sasrec":

    q = LayerNorm(x)                    queries are normalized, keys and values are not
    h = q + W_o MHA(q, x, x)            the residual adds the normalized queries
    g = LayerNorm(h)
    y = g + Dropout(W_2 Dropout(ReLU(W_1 g)))     FFN width ffn_multiplier * D (1 in SASRec)

Pre-LN Transformer, kind "transformer":

    h = x + Dropout(W_o MHA(LayerNorm(x)))
    y = h + Dropout(FFN(LayerNorm(h)))     FFN = Linear -> GELU -> Linear
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TowerConfig
from .jagged import JaggedLayout
from .kernels import KERNELS


class _SoftmaxBlock(nn.Module):
    """What both softmax blocks share: their shapes, the kernel, and the forward pass
    `finish(x, u, attention(project(x)))`; subclasses define the layers, `project` and
    `finish`."""

    def _setup(self, cfg: TowerConfig, kernel: str) -> None:
        self.num_heads, self.attention_dim, self.linear_dim = cfg.num_heads, cfg.attention_dim, cfg.linear_dim
        self.dropout_p = cfg.dropout
        self.kernel_name = kernel
        self.kernel = KERNELS[("transformer", kernel)]
        self.bucket_min_fill = cfg.bucket_min_fill

    def forward(self, x_TD: torch.Tensor, layout: JaggedLayout, return_kv: bool = False):
        """-> y_TD, or (y_TD, k_THd, v_THd) with return_kv (for the history cache)."""
        u, q, k, v = self.project(x_TD)
        # Dropout on the attention weights in training, as in SASRec.
        p = self.dropout_p if self.training else 0.0
        if self.kernel_name == "sdpa":
            attn = self.kernel(q, k, v, layout, p, self.bucket_min_fill)
        else:
            attn = self.kernel(q, k, v, layout, p)
        y = self.finish(x_TD, u, attn.flatten(1))
        return (y, k, v) if return_kv else y


class TransformerBlock(_SoftmaxBlock):
    def __init__(self, cfg: TowerConfig, kernel: str) -> None:
        super().__init__()
        self._setup(cfg, kernel)
        H, dq, dv, D = cfg.num_heads, cfg.attention_dim, cfg.linear_dim, cfg.embedding_dim
        self.attn_input_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(D, H * (2 * dq + dv))
        self.output = nn.Linear(H * dv, D)
        self.ffn_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.ffn = nn.Sequential(nn.Linear(D, cfg.ffn_multiplier * D), nn.GELU(),
                                 nn.Linear(cfg.ffn_multiplier * D, D))
        self.dropout = nn.Dropout(cfg.dropout)

    def project(self, x_TD: torch.Tensor):
        """-> (None, q [T, H, dq], k [T, H, dq], v [T, H, dv])."""
        H, dq, dv = self.num_heads, self.attention_dim, self.linear_dim
        q, k, v = self.qkv(self.attn_input_norm(x_TD)).split([H * dq, H * dq, H * dv], dim=-1)
        shape = x_TD.shape[:-1]
        return None, q.reshape(*shape, H, dq), k.reshape(*shape, H, dq), v.reshape(*shape, H, dv)

    def finish(self, x_TD: torch.Tensor, u: None, attn: torch.Tensor) -> torch.Tensor:
        h = x_TD + self.dropout(self.output(attn))
        return h + self.dropout(self.ffn(self.ffn_norm(h)))


class SASRecBlock(_SoftmaxBlock):
    """The original SASRec block (see the module docstring)."""

    def __init__(self, cfg: TowerConfig, kernel: str) -> None:
        super().__init__()
        self._setup(cfg, kernel)
        H, dq, dv, D = cfg.num_heads, cfg.attention_dim, cfg.linear_dim, cfg.embedding_dim
        self.attn_input_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.q = nn.Linear(D, H * dq)
        self.kv = nn.Linear(D, H * (dq + dv))
        self.output = nn.Linear(H * dv, D)
        self.ffn_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        hidden = cfg.ffn_multiplier * D
        self.ffn = nn.Sequential(nn.Linear(D, hidden), nn.Dropout(cfg.dropout), nn.ReLU(), nn.Linear(hidden, D),
                                 nn.Dropout(cfg.dropout))

    def project(self, x_TD: torch.Tensor):
        """-> (normalized queries [T, D], q [T, H, dq], k [T, H, dq], v [T, H, dv])."""
        H, dq, dv = self.num_heads, self.attention_dim, self.linear_dim
        x_norm = self.attn_input_norm(x_TD)
        k, v = self.kv(x_TD).split([H * dq, H * dv], dim=-1)
        shape = x_TD.shape[:-1]
        return (x_norm, self.q(x_norm).reshape(*shape, H, dq), k.reshape(*shape, H, dq),
                v.reshape(*shape, H, dv))

    def finish(self, x_TD: torch.Tensor, x_norm: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        g = self.ffn_norm(x_norm + self.output(attn))
        return g + self.ffn(g)
