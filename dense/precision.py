"""Mixed precision for the tower: autocast contexts and the fp16 grad scaler.

Weights stay fp32 (master weights); autocast runs matmuls in bf16/fp16 and keeps norms,
softmax and the HSTU SiLU/bias arithmetic in fp32 (the chunked kernel upcasts its tiles).
fp16 needs loss scaling (its range is too small for small gradients); bf16 does not.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

Precision = Literal["fp32", "bf16", "fp16"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: Precision, device_type: str = "cpu"):
    """Context manager running the forward (and loss) in `precision`; fp32 is a no-op."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in _DTYPES:
        raise ValueError(f"precision must be one of fp32, bf16, fp16, got {precision!r}")
    return torch.autocast(device_type=device_type, dtype=_DTYPES[precision])


def make_grad_scaler(precision: Precision, device_type: str = "cpu") -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16/fp32 get a disabled, pass-through one)."""
    return torch.amp.GradScaler(device_type, enabled=precision == "fp16")
