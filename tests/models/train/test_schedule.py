import io
import math

import pytest
import torch

from genrec.models.train.schedule import OptimConfig, build_dense_optimizer, warmup_cosine


class _Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head_norm = torch.nn.Parameter(torch.ones(2, 4))  # a norm gain kept as a matrix
        self.frozen = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)


def _lrs(warmup: int, total: int, min_ratio: float, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = warmup_cosine(opt, warmup_steps=warmup, total_steps=total, min_lr_ratio=min_ratio)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_warmup_then_cosine_shape() -> None:
    lrs = _lrs(warmup=4, total=14, min_ratio=0.1, steps=20)
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])  # linear, first step nonzero
    assert lrs[4] == pytest.approx(2.0)  # start of decay is the peak
    decay = lrs[4:15]
    assert all(a > b for a, b in zip(decay, decay[1:]))  # strictly decreasing
    assert lrs[9] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # halfway: midpoint of cosine
    assert lrs[14] == pytest.approx(0.2)  # lr * min_lr_ratio at total_steps
    assert lrs[15:] == pytest.approx([0.2] * 5)  # and stays there


def test_no_warmup_starts_at_peak() -> None:
    lrs = _lrs(warmup=0, total=10, min_ratio=0.0, steps=11)
    assert lrs[0] == pytest.approx(2.0)
    assert lrs[10] == pytest.approx(0.0)
    assert lrs[5] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize(
    "kwargs", [dict(warmup_steps=11, total_steps=10, min_lr_ratio=0.1),
               dict(warmup_steps=0, total_steps=0, min_lr_ratio=0.1),
               dict(warmup_steps=0, total_steps=10, min_lr_ratio=1.5)],
)
def test_bad_schedule_arguments_are_refused(kwargs: dict) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError):
        warmup_cosine(opt, **kwargs)


def test_param_groups_exempt_norms_and_biases_from_decay() -> None:
    tower = _Tower()
    opt = build_dense_optimizer(tower.named_parameters(), OptimConfig(lr=0.1, weight_decay=0.5))
    groups = {g["name"]: g for g in opt.param_groups}
    ids = {name: {id(p) for p in g["params"]} for name, g in groups.items()}
    assert ids["decay"] == {id(tower.proj.weight)}
    assert ids["no_decay"] == {id(tower.proj.bias), id(tower.norm.weight), id(tower.norm.bias),
                               id(tower.head_norm)}
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert all(id(tower.frozen) not in s for s in ids.values())

    # Decoupled decay: with zero gradients Adam's update is 0, so only the decay group moves,
    # by exactly lr * weight_decay * w.
    before = {n: p.detach().clone() for n, p in tower.named_parameters()}
    for p in tower.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(tower.proj.weight, before["proj.weight"] * (1 - 0.1 * 0.5))
    torch.testing.assert_close(tower.norm.weight, before["norm.weight"])
    torch.testing.assert_close(tower.proj.bias, before["proj.bias"])


def test_states_load_with_weights_only() -> None:
    tower = _Tower()
    cfg = OptimConfig(warmup_steps=2)
    opt = build_dense_optimizer(tower.named_parameters(), cfg)
    sched = warmup_cosine(opt, warmup_steps=2, total_steps=10, min_lr_ratio=cfg.min_lr_ratio)
    tower.proj.weight.sum().backward()
    opt.step()
    sched.step()
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    opt2 = build_dense_optimizer(_Tower().named_parameters(), cfg)
    sched2 = warmup_cosine(opt2, warmup_steps=2, total_steps=10, min_lr_ratio=cfg.min_lr_ratio)
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["scheduler"])
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_betas_must_be_a_pair() -> None:
    with pytest.raises(ValueError, match="betas"):
        build_dense_optimizer(_Tower().named_parameters(), OptimConfig(betas=[0.9]))
