"""Sparse optimizers on packed rows, and the deterministic row initializer.

A stored row is `[values (D) | optimizer state (S)]` in one fp32 tensor row, so moving a
row between tiers moves its state with it in one copy and a row is never torn from its
state.

    rowwise_adagrad  S = 1       [sum of mean squared gradients]   (FBGEMM EXACT_ROWWISE_ADAGRAD)
    adam             S = 2D + 1  [m (D), v (D), per-row step]
    sgd              S = 0

Legend: U = unique rows in the batch, D = embedding dim, W = D + S.
"""

from __future__ import annotations

import math

import torch

from .config import TableConfig
from .hashing import uniform01_f32


def state_width(cfg: TableConfig) -> int:
    return {"rowwise_adagrad": 1, "adam": 2 * cfg.embedding_dim + 1, "sgd": 0}[cfg.optimizer]


def row_width(cfg: TableConfig) -> int:
    return cfg.embedding_dim + state_width(cfg)


def init_scale(cfg: TableConfig) -> float:
    if cfg.init_scale is not None:
        return cfg.init_scale
    return math.sqrt(1.0 / cfg.num_embeddings) if cfg.num_embeddings else 0.01


def initial_values(cfg: TableConfig, ids_U: torch.Tensor) -> torch.Tensor:
    """fp32 [U, D] initial row values: a pure function of (table seed, id)."""
    d = cfg.embedding_dim
    if cfg.initializer == "zeros" or ids_U.numel() == 0:
        return torch.zeros(ids_U.numel(), d)
    a = init_scale(cfg)
    if cfg.initializer == "uniform":
        return uniform01_f32(cfg.seed, ids_U, d).mul_(2.0 * a).sub_(a)
    u_UK = uniform01_f32(cfg.seed, ids_U, 2 * d).to(torch.float64)  # Box-Muller on two streams
    r = torch.sqrt(-2.0 * torch.log1p(-u_UK[:, :d]))
    return (r * torch.cos(2.0 * math.pi * u_UK[:, d:]) * a).to(torch.float32)


def initial_rows(cfg: TableConfig, ids_U: torch.Tensor) -> torch.Tensor:
    """fp32 [U, W]: initial values with zero optimizer state."""
    rows_UW = torch.zeros(ids_U.numel(), row_width(cfg))
    rows_UW[:, : cfg.embedding_dim] = initial_values(cfg, ids_U)
    return rows_UW


def sum_squares(g_UD: torch.Tensor) -> torch.Tensor:
    """Row sums of g^2 in one fixed order: columns zero-padded to a power of two, then
    halved pairwise (x[:h] + x[h:]) down to one. The native step (csrc/store.c) adds in
    the same order, so both give the same bits; a library reduction's order is its own."""
    sq_UP = g_UD * g_UD
    d = sq_UP.shape[1]
    p = 1 << max(d - 1, 0).bit_length()
    if p != d:
        sq_UP = torch.nn.functional.pad(sq_UP, (0, p - d))
    while sq_UP.shape[1] > 1:
        h = sq_UP.shape[1] // 2
        sq_UP = sq_UP[:, :h] + sq_UP[:, h:]
    return sq_UP[:, 0]


def apply_update(cfg: TableConfig, rows_UW: torch.Tensor, grad_UD: torch.Tensor) -> None:
    """Update packed rows in place from their summed gradients (one optimizer step each).
    Each operation rounds on its own (no fused multiply-add), as in csrc/store.c."""
    d = cfg.embedding_dim
    w_UD = rows_UW[:, :d]
    if cfg.weight_decay:
        grad_UD = grad_UD + cfg.weight_decay * w_UD
    if cfg.optimizer == "rowwise_adagrad":
        # FBGEMM: momentum += mean(g^2); w -= lr / (sqrt(momentum) + eps) * g.
        mom_U = rows_UW[:, d]
        mom_U.add_(sum_squares(grad_UD) / d)
        # sqrt through float64: torch's fp32 sqrt on CPU is not always correctly rounded
        # (measured: 20% of values off by an ulp), a float64 one rounded to fp32 is.
        root_U = mom_U.double().sqrt_().float()
        mult_U1 = (root_U + cfg.eps).reciprocal_().mul_(-cfg.learning_rate).unsqueeze(1)
        w_UD.add_(grad_UD * mult_U1)
    elif cfg.optimizer == "sgd":
        w_UD.sub_(grad_UD * cfg.learning_rate)
    else:  # adam with a per-row step count (lazy Adam: rows not seen do not decay)
        m_UD, v_UD, step_U = rows_UW[:, d : 2 * d], rows_UW[:, 2 * d : 3 * d], rows_UW[:, 3 * d]
        step_U.add_(1.0)
        m_UD.mul_(cfg.beta1).add_(grad_UD * (1 - cfg.beta1))
        v_UD.mul_(cfg.beta2).add_(grad_UD.square() * (1 - cfg.beta2))
        # Bias corrections in float64: 1 - 0.999**t in fp32 loses ~4 digits at small t.
        step64_U1 = step_U.to(torch.float64).unsqueeze(1)
        bc1_U1 = (1 - torch.pow(cfg.beta1, step64_U1)).to(rows_UW.dtype)
        bc2_U1 = (1 - torch.pow(cfg.beta2, step64_U1)).to(rows_UW.dtype)
        w_UD.sub_(cfg.learning_rate * (m_UD / bc1_U1) / ((v_UD / bc2_U1).sqrt() + cfg.eps))
