"""A fresh optimizer's lazily created state, made before a load: AdamW gains every
per-parameter tensor a trained one holds, the weights stay bitwise as they were, and
optimizers that already hold state (or never have any) are left alone."""

from __future__ import annotations

import torch
from torch import nn

from relight.ckpt.flatten import flatten_state
from relight.ckpt.optim_state import materialize_optimizer_states


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _trained(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_fresh_adamw_gets_the_state_a_trained_one_has_and_the_weights_stay() -> None:
    fresh_model, trained_model = _model(), _model()
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.1, weight_decay=0.5)
    trained = torch.optim.AdamW(trained_model.parameters(), lr=0.1, weight_decay=0.5)
    _trained(trained_model, trained)
    before = [p.detach().clone() for p in fresh_model.parameters()]

    assert materialize_optimizer_states({"model": fresh_model, "optim": fresh}) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, fresh_model.parameters(),
                                                  strict=True))
    assert all(p.grad is None for p in fresh_model.parameters())
    assert fresh.param_groups[0]["lr"] == 0.1  # the learning rate is put back
    mine = flatten_state({"optim": fresh})
    theirs = flatten_state({"optim": trained})
    assert {n: (t.tensor.shape, t.tensor.dtype) for n, t in mine.tensors.items()} == \
        {n: (t.tensor.shape, t.tensor.dtype) for n, t in theirs.tensors.items()}
    assert set(mine.values) == set(theirs.values)


def test_optimizers_with_state_or_without_any_are_left_alone() -> None:
    model = _model()
    trained = torch.optim.AdamW(model.parameters(), lr=0.1)
    _trained(model, trained)
    snapshot = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)}
                for k, v in trained.state.items()}
    assert materialize_optimizer_states([trained]) == 0
    for k, v in trained.state.items():
        assert all(torch.equal(v[n], t) for n, t in snapshot[k].items())
    sgd_model = _model()
    before = [p.detach().clone() for p in sgd_model.parameters()]
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1)
    materialize_optimizer_states({"nested": {"opt": sgd}})
    assert not sgd.state  # plain SGD keeps none
    assert all(torch.equal(a, b) for a, b in zip(before, sgd_model.parameters(), strict=True))


def test_a_wrapper_that_holds_the_optimizer_has_the_wrapped_one_initialised() -> None:
    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        @property
        def param_groups(self):  # type: ignore[override]
            return self.optimizer.param_groups

        @property
        def state(self):  # type: ignore[override]
            return self.optimizer.state

        def step(self, closure=None):  # noqa: ANN001 - must never run here
            raise AssertionError("the wrapper's own step ran")

    inner = torch.optim.AdamW(_model().parameters(), lr=0.1)
    assert materialize_optimizer_states({"optim": Wrapper(inner)}) == 1
    assert len(inner.state) == 4 and all("exp_avg" in s for s in inner.state.values())
