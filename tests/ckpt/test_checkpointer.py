"""The engine as an object: each `CheckpointManager` saves on a `Checkpointer` of its
own, so two managers in one process keep their own plans, staging buffers and save
threads; `ckpt.save` / `ckpt.load` use the process's default one."""

from __future__ import annotations

import gc
import threading

import torch

from relight import ckpt


def _state(seed: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 64, generator=g), "step": seed}


def _save_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in ("ckpt-save-worker", "ckpt-stage")}


def test_two_managers_keep_their_own_plans_and_round_trip(tmp_path) -> None:
    model = ckpt.CheckpointManager(str(tmp_path / "model"), keep_last=2)
    ema = ckpt.CheckpointManager(str(tmp_path / "ema"), keep_last=2)
    assert model.checkpointer is not ema.checkpointer
    assert ckpt.default_checkpointer() not in (model.checkpointer, ema.checkpointer)
    for step in range(1, 4):  # interleaved async saves of two differently shaped states
        model.save(step, _state(step, 128))
        ema.save(step, _state(100 + step, 32))
        model.wait()
        ema.wait()
        # Each engine still holds the plan of its own state: the other's save, of another
        # layout, did not replace it (one engine per process made a new plan every save).
        assert model.checkpointer.cached.plan.tensors["w"].shape == (128, 64)
        assert ema.checkpointer.cached.plan.tensors["w"].shape == (32, 64)
    model_plan, ema_plan = model.checkpointer.cached.ident, ema.checkpointer.cached.ident
    model.save(4, _state(4, 128))
    model.wait()
    assert model.checkpointer.cached.ident == model_plan  # the cached plan served again
    assert ema.checkpointer.cached.ident == ema_plan
    got, got_ema = _state(0, 128), _state(0, 32)
    assert model.restore(got) == 4 and ema.restore(got_ema) == 3
    assert torch.equal(got["w"], _state(4, 128)["w"]) and got["step"] == 4
    assert torch.equal(got_ema["w"], _state(103, 32)["w"]) and got_ema["step"] == 103
    model.close()
    ema.close()


def test_a_dropped_checkpointer_lets_its_save_threads_end(tmp_path) -> None:
    before = _save_threads()
    cp = ckpt.Checkpointer()
    cp.save(_state(1, 16), str(tmp_path / "a"), async_save=True).wait()
    mine = _save_threads() - before
    assert len(mine) == 2  # the save worker and its staging thread
    del cp
    gc.collect()
    for t in mine:  # told to end when the checkpointer was collected; they only return
        t.join(timeout=60)
        assert not t.is_alive(), f"{t.name} still running after its checkpointer was dropped"


def test_module_level_save_and_load_use_the_default_checkpointer(tmp_path) -> None:
    ckpt.save(_state(7, 24), str(tmp_path / "c"))
    assert ckpt.default_checkpointer().cached.plan.tensors["w"].shape == (24, 64)
    got = _state(0, 24)
    info = ckpt.load(got, str(tmp_path / "c"))
    assert torch.equal(got["w"], _state(7, 24)["w"]) and got["step"] == 7
    assert info.bytes_read >= 24 * 64 * 4
