"""Dense optimizer and learning-rate schedule.

Usage (the Trainer steps the scheduler once per optimizer step):

    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=100)
    optimizer = build_dense_optimizer(tower.named_parameters(), cfg)
    scheduler = warmup_cosine(
        optimizer, warmup_steps=cfg.warmup_steps, total_steps=10_000, min_lr_ratio=cfg.min_lr_ratio
    )
    for step in range(10_000):
        loss.backward()
        if cfg.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(tower.parameters(), cfg.grad_clip_norm)
        optimizer.step(); scheduler.step(); optimizer.zero_grad(set_to_none=True)

Both `optimizer.state_dict()` and `scheduler.state_dict()` hold only tensors and plain
values, so they round-trip through `torch.load(weights_only=True)` in checkpoints.
Sparse embedding rows have their own row-wise optimizers in `sparse/`; this is for the
dense tower and heads only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from genrec.models.config import OptimConfig


def _skips_decay(name: str, param: torch.Tensor) -> bool:
    # Vectors are biases, norm gains, or learned scalars: decaying them toward zero only
    # fights the normalization, so they are exempt. The name check catches norm weights
    # kept as matrices (e.g. a per-head norm stored [H, D]).
    return param.ndim < 2 or name.endswith(".bias") or "norm" in name.lower()


def build_dense_optimizer(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig
) -> torch.optim.AdamW:
    """AdamW with two param groups: "decay" (matrices) and "no_decay" (norms, biases).

    `named_params` is `module.named_parameters()`; frozen parameters are left out.
    """
    if len(cfg.betas) != 2:
        raise ValueError(f"optim.betas must have 2 values (beta1, beta2), got {cfg.betas}")
    decay, no_decay = [], []
    for name, param in named_params:
        if param.requires_grad:
            (no_decay if _skips_decay(name, param) else decay).append(param)
    if not decay and not no_decay:
        raise ValueError("build_dense_optimizer got no trainable parameters")
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps
    )


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> LambdaLR:
    """Linear warmup to the optimizer's lr, then cosine decay to lr * min_lr_ratio.

    The multiplier at scheduler step s (0-based, i.e. for the (s+1)-th optimizer step) is
    (s + 1) / warmup_steps during warmup, so the first step already trains; then it
    follows min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * t)) / 2 with
    t = (s - warmup_steps) / (total_steps - warmup_steps), clamped to [0, 1].
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    decay_steps = max(total_steps - warmup_steps, 1)

    # A plain function (not a lambda object with state) keeps LambdaLR.state_dict() free
    # of anything but numbers, so it loads with weights_only=True.
    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min((step - warmup_steps) / decay_steps, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return LambdaLR(optimizer, multiplier)
