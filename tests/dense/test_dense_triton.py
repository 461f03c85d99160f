"""The Triton HSTU kernel (dense/triton_hstu.py) against the float64 PyTorch reference, on
CPU under Triton's interpreter: forward and every gradient (q, k, v, both bias tables),
jagged rows of length 0, 1 and past several blocks, ranking candidates, dq != dv, each
normalizer, fp32 and bf16; the bias gradients are the same on every run; the tower runs
it end to end when asked for kernel="triton".

Triton is the `[gpu]` extra, which the README's test install (and CI) installs; the
interpreter is switched on by tests/conftest.py, before anything imports Triton.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from genrec.dense import TowerConfig, build_tower, triton_hstu
from genrec.dense.jagged import make_layout
from genrec.dense.kernels import HSTUAttentionParams, hstu_attention_reference

pytest.importorskip("triton", reason='Triton is the [gpu] extra: pip install -e ".[test,gpu]"')
# tests/conftest.py turns the interpreter on before anything imports Triton
assert triton_hstu.interpreted(), "TRITON_INTERPRET=1 must be set before Triton is imported"

LENGTHS = [5, 0, 1, 70, 3, 33]   # empty, length 1, past two 32-token blocks
TARGETS = [1, 0, 0, 6, 3, 0]     # row 4: candidates only
H, DQ, DV = 2, 8, 12             # dq != dv, neither a power of two


def _case(seed=0, targets=True, query="next"):
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    T = int(off[-1])
    gaps = (10 ** (5 * torch.rand(T, generator=g))).long()  # seconds to days
    ts = torch.cat([torch.cumsum(gaps[int(off[b]):int(off[b + 1])], 0) for b in range(len(LENGTHS))])
    qtime = torch.randint(10**6, 10**7, (len(LENGTHS),), generator=g)
    layout = make_layout(off, ts, torch.tensor(TARGETS) if targets else None, 80, time_bias_query=query,
                         query_time_B=qtime)
    q, k = (torch.randn(T, H, DQ, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(T, H, DV, generator=g, dtype=torch.float64)
    ts_w = torch.randn(41, generator=g, dtype=torch.float64)
    pos_w = torch.randn(80, generator=g, dtype=torch.float64)
    dout = torch.randn(T, H, DV, generator=g, dtype=torch.float64)
    return layout, (q, k, v, ts_w, pos_w), dout


def _params(normalizer="max_seq_len"):
    return HSTUAttentionParams(alpha=DQ ** -0.5, normalizer=normalizer, max_seq_len=80, num_time_buckets=40,
                               time_bucket_divisor=0.301, bucket_min_fill=0.75, block_elems=10_000)


def _run(kernel, layout, inputs, dout, p, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
    out = kernel(*leaves[:3], layout, leaves[3], leaves[4], p)
    (out.double() * dout).sum().backward()
    return [out.detach().double()] + [x.grad.double() for x in leaves]


def _scale(x):
    return float(x.abs().max()) + 1e-12


@pytest.mark.parametrize("normalizer", ["max_seq_len", "num_keys", "none"])
@pytest.mark.parametrize("targets", [True, False], ids=["candidates", "causal"])
def test_triton_matches_the_float64_reference_forward_and_backward(normalizer, targets):
    layout, inputs, dout = _case(targets=targets)
    p = _params(normalizer)
    want = _run(hstu_attention_reference, layout, inputs, dout, p, torch.float64)
    got = _run(triton_hstu.hstu_attention_triton, layout, inputs, dout, p, torch.float32)
    for name, w, g in zip(["out", "dq", "dk", "dv", "d_ts_w", "d_pos_w"], want, got):
        # fp32 against float64: a relative error of 1e-4 of the tensor's largest value
        err = float((w - g).abs().max()) / _scale(w)
        assert err < 1e-4, f"{name}: max error {err:.2e} of max |value| {_scale(w):.3g}"
    # every bias slot that occurs gets a gradient: the rows above reach many of them
    assert int((want[4] != 0).sum()) > 10 and int((want[5] != 0).sum()) > 60


def test_triton_bf16_against_the_float64_reference():
    layout, inputs, dout = _case(seed=3)
    p = _params("num_keys")
    want = _run(hstu_attention_reference, layout, inputs, dout, p, torch.float64)
    got = _run(triton_hstu.hstu_attention_triton, layout, inputs, dout, p, torch.bfloat16)
    for name, w, g in zip(["out", "dq", "dk", "dv", "d_ts_w", "d_pos_w"], want, got):
        # bf16 inputs (8 bits of mantissa) with fp32 accumulation: 3% of the largest value
        err = float((w - g).abs().max()) / _scale(w)
        assert err < 3e-2, f"{name}: max error {err:.2e} of max |value| {_scale(w):.3g}"


def test_triton_bias_gradients_are_the_same_on_every_run():
    layout, inputs, dout = _case(seed=5)
    p = _params()
    a = _run(triton_hstu.hstu_attention_triton, layout, inputs, dout, p, torch.float32)
    b = _run(triton_hstu.hstu_attention_triton, layout, inputs, dout, p, torch.float32)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_tower_with_kernel_triton_matches_the_chunked_tower():
    cfg = TowerConfig(embedding_dim=16, num_layers=2, num_heads=2, attention_dim=8, linear_dim=12,
                      max_seq_len=80, num_time_buckets=40, dropout=0.0, time_bias_query="next")
    ref = build_tower(dataclasses.replace(cfg, kernel="chunked")).eval()
    tri = build_tower(dataclasses.replace(cfg, kernel="triton")).eval()
    tri.load_state_dict(ref.state_dict())
    layout, _, _ = _case(seed=7)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(layout.num_tokens, 16, generator=g)
    off, ts = layout.offsets_B1, layout.timestamps_T
    outs = []
    for tower in (ref, tri):
        xx = x.clone().requires_grad_()
        y = tower(xx, off, ts, num_targets_B=torch.tensor(TARGETS))
        y.square().sum().backward()
        outs.append((y.detach(), xx.grad, [p.grad for p in tower.parameters()]))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-4, rtol=1e-4)
    for a, b in zip(outs[0][2], outs[1][2]):
        assert torch.allclose(a, b, atol=1e-3 * _scale(a), rtol=1e-3)


def test_triton_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layout, inputs, _ = _case()
    with pytest.raises(RuntimeError, match="CUDA"):
        triton_hstu.hstu_attention_triton(*[x.float() for x in inputs[:3]], layout, None, None, _params())


def test_triton_kernels_compile_for_cuda_without_a_gpu():
    # The interpreter runs the kernels' Python; the GPU compiles them. Compile all three for
    # sm_90 in bf16 (the training precision on CUDA) down to cubin, outside the interpreter.
    code = ("from genrec.dense import triton_hstu; "
            "print(triton_hstu.compile_for_cuda(arch=90, dtype='bf16', dq=8, dv=12))")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert set(sizes) == {"fwd", "bwd_kv", "bwd_q"} and all(n > 10_000 for n in sizes.values()), sizes
