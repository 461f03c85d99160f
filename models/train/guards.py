"""Stopping a run at a step whose loss or gradient norm is not finite.

    parts = {"loss": 3.2, "retrieval_loss": 2.9, "grad_norm": 1.4, "lr": 1e-3}
    check_finite_step(parts, step=7)   # after the step, before any checkpoint of it

A NaN or infinite loss (a learning rate far too high, an overflow) otherwise trained on:
every later loss was NaN, the checkpoints written after it held NaN weights (a resume
started from them), and the run ended with a validation error that named no step or, with
no retrieval validation, as if it had finished.
"""

from __future__ import annotations

import math


class NonFiniteLoss(ValueError):
    """A step's loss or gradient norm is NaN or infinite. A ValueError: the command line
    says it in one line."""


def check_finite_step(parts: dict[str, float], *, step: int) -> None:
    """Raise `NonFiniteLoss` naming `step` and its loss terms when the step's `loss` or
    `grad_norm` (where clipping measured it) is NaN or infinite. Called after the step and
    before its checkpoint: whatever the step wrote into the weights is never saved. With
    several ranks no collective: the other ranks fail at their next collective (gloo and
    NCCL report a peer gone), and no checkpoint of the step completes, since every rank
    must report its files before one is marked complete."""
    bad = [k for k in ("loss", "grad_norm") if k in parts and not math.isfinite(parts[k])]
    if not bad:
        return
    terms = ", ".join(f"{k}={float(v):.4g}" for k, v in parts.items() if k.endswith("loss") or k == "grad_norm")
    raise NonFiniteLoss(
        f"the training loss of step {step} is not finite ({terms}); stopped before that step reached a "
        "checkpoint. Lower train.optim.lr or the tables' learning_rate, or set train.optim.grad_clip_norm"
    )
