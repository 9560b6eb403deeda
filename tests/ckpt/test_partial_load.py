"""Loads that do not match the checkpoint one to one: partial loads (`strict=False`),
errors that list every offender, JSON dicts merged into the target's, and an optimizer
without state yet."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from relight import ckpt


def _mlp(layers: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])


@pytest.fixture
def saved(tmp_path) -> str:
    url = str(tmp_path / "ck")
    ckpt.save({"model": _mlp(2, 0).state_dict(), "meta": {"step": 6}}, url)
    return url


def test_strict_false_skips_entries_the_checkpoint_lacks(saved) -> None:
    """A model with one layer more: strict names what is missing; strict=False loads the
    rest and leaves the new layer as it was, listing it in LoadInfo."""
    big = _mlp(3, 1)
    fresh = [p.detach().clone() for p in big[2].parameters()]
    target = {"model": big.state_dict(), "meta": {"step": 0}}
    with pytest.raises(ckpt.MissingKeyError, match=r"2 entries are .*'model/2\.bias', "
                       r"'model/2\.weight'.*strict=False"):
        ckpt.load(target, saved)
    info = ckpt.load(target, saved, strict=False)
    assert info.missing == ["model/2.bias", "model/2.weight"]
    assert info.unexpected == []
    ref = _mlp(2, 0)
    for i in range(2):
        assert torch.equal(big[i].weight, ref[i].weight)
        assert torch.equal(big[i].bias, ref[i].bias)
    assert all(torch.equal(a, b) for a, b in zip(big[2].parameters(), fresh, strict=True))
    assert target["meta"] == {"step": 6}


def test_strict_false_reports_what_it_ignored(saved) -> None:
    small = _mlp(1, 1)
    info = ckpt.load({"model": small.state_dict()}, saved, strict=False)
    assert info.missing == []
    assert info.unexpected == ["meta", "model/1.bias", "model/1.weight"]
    assert torch.equal(small[0].weight, _mlp(2, 0)[0].weight)


def test_missing_value_skipped_with_strict_false(saved) -> None:
    target = {"model": _mlp(2, 1).state_dict(), "meta": {"step": 0}, "sched": {"last": 3}}
    with pytest.raises(ckpt.MissingKeyError, match="'sched'"):
        ckpt.load(target, saved)
    info = ckpt.load(target, saved, strict=False)
    assert info.missing == ["sched"] and target["sched"] == {"last": 3}


def test_errors_give_the_count_and_the_first_few(tmp_path) -> None:
    url = str(tmp_path / "ck")
    ckpt.save({"a": torch.zeros(3)}, url)
    target = {"a": torch.zeros(3), **{f"t{i}": torch.zeros(2) for i in range(8)}}
    with pytest.raises(ckpt.MissingKeyError) as e:
        ckpt.load(target, url)
    msg = str(e.value)
    assert "8 entries are" in msg and "'t0', 't1', 't2', 't3', 't4', and 3 more" in msg, msg
    assert e.value.tensor == "t0"
    ckpt.save({f"s{i}": torch.zeros(2) for i in range(3)}, tmp_path / "ck2")
    with pytest.raises(ckpt.ShapeMismatchError) as e:
        ckpt.load({f"s{i}": torch.zeros(4) for i in range(3)}, tmp_path / "ck2")
    assert "3 tensors are" in str(e.value)
    assert all(f"'s{i}': checkpoint (2,), state dict (4,)" in str(e.value) for i in range(3))


def test_json_dict_merged_into_the_target(saved) -> None:
    """Restoring {'step', 'epoch', 'data_pos'} from a checkpoint that saved {'step': 6}:
    strict names the keys the checkpoint lacks; strict=False merges into the target's
    own dict (the checkpoint's keys win, the others keep their values)."""
    meta = {"step": 0, "epoch": 0, "data_pos": 0}
    target = {"model": _mlp(2, 1).state_dict(), "meta": meta}
    with pytest.raises(ckpt.MissingKeyError, match=r"'meta/epoch'.*'meta/data_pos'|"
                       r"'meta/data_pos'.*'meta/epoch'"):
        ckpt.load(target, saved)
    assert meta == {"step": 0, "epoch": 0, "data_pos": 0}  # a failed load changes nothing
    info = ckpt.load(target, saved, strict=False)
    assert target["meta"] is meta and meta == {"step": 6, "epoch": 0, "data_pos": 0}
    assert sorted(info.missing) == ["meta/data_pos", "meta/epoch"]


def test_json_dict_gains_the_checkpoints_keys(tmp_path) -> None:
    url = str(tmp_path / "ck")
    ckpt.save({"meta": {"step": 6, "sub": {"a": 1, "b": 2}}, "cfg": [1, 2]}, url)
    target = {"meta": {"sub": {"a": 0}}, "cfg": None}
    ckpt.load(target, url)
    assert target == {"meta": {"step": 6, "sub": {"a": 1, "b": 2}}, "cfg": [1, 2]}


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _mlp(2, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_fresh_optimizer_error_says_what_to_do(tmp_path) -> None:
    model, opt = _trained(0)
    url = str(tmp_path / "ck")
    ckpt.save({"model": model, "optim": opt}, url)
    fresh = _mlp(2, 1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with pytest.raises(ckpt.MissingKeyError, match=r"'optim/state' is empty in the state dict"
                       r".*get_state_dict\(model, optimizer\)"):
        ckpt.load({"model": fresh, "optim": fresh_opt}, url)


def test_fresh_optimizer_from_get_state_dict_restores(tmp_path) -> None:
    """The usual way: the state dict of a fresh model and optimizer from
    `get_state_dict` (which creates the optimizer's state) loads every moment."""
    model, opt = _trained(0)
    msd, osd = get_state_dict(model, opt)
    url = str(tmp_path / "ck")
    ckpt.save({"model": msd, "optim": osd}, url)
    fresh = _mlp(2, 1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    ckpt.load({"model": fmsd, "optim": fosd}, url)
    set_state_dict(fresh, fresh_opt, model_state_dict=fmsd, optim_state_dict=fosd)
    for (_, a), (_, b) in zip(fresh.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh_opt.state[a][k], opt.state[b][k]), k
    assert fresh_opt.param_groups[0]["lr"] == 0.1


def test_manager_restore_strict_false_reports_what_was_missing(tmp_path) -> None:
    mgr = ckpt.CheckpointManager(tmp_path / "run")
    mgr.save(4, {"model": _mlp(2, 0).state_dict()}, async_save=False)
    big = _mlp(3, 1)
    assert mgr.restore({"model": big.state_dict()}, strict=False) == 4
    assert mgr.last_load is not None and mgr.last_load.step == 4
    assert mgr.last_load.missing == ["model/2.bias", "model/2.weight"]
    assert torch.equal(big[1].weight, _mlp(2, 0)[1].weight)
