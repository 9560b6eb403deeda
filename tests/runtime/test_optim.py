"""LR schedule and gradient clipping (single process, no process group)."""

from __future__ import annotations

import math

import pytest
import torch

from relight.runtime.optim import LRSchedule, clip_grad_norm_


def test_warmup_then_cosine_to_the_floor() -> None:
    s = LRSchedule(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == pytest.approx(1.0)
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert s(14) == pytest.approx(0.1)
    assert s(100) == pytest.approx(0.1)
    assert all(s(i) >= s(i + 1) for i in range(4, 20))


def test_clip_scales_to_max_norm_and_reports_the_norm() -> None:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = clip_grad_norm_(params, 1.0, None)
    assert norm == pytest.approx(5.0)
    total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
    assert total == pytest.approx(1.0, rel=1e-5)


def test_clip_leaves_small_gradients_alone() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([0.3, 0.4])
    assert clip_grad_norm_([p], 1.0, None) == pytest.approx(0.5)
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4]))
