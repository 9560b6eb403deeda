"""`relight ckpt export / import-dcp / diff`: round trips bitwise, streaming, exit codes."""

from __future__ import annotations

import json
import struct
import weakref
from pathlib import Path

import pytest
import torch

import relight.ckpt.export as export
from relight import ckpt
from relight.ckpt.cli import main

DTYPE_OF = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
            "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(640, 300, generator=g),           # grid, 2 chunks
            "layers.0.norm": torch.randn(300, generator=g).to(torch.bfloat16),  # packed
            "layers.0.bias": torch.randn(17, generator=g, dtype=torch.float64),
            "layers.0.half": torch.randn(5, 3, generator=g).to(torch.float16),
            "ids": torch.randint(-2**40, 2**40, (33,), generator=g),
            "mask": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
        },
        "optim": {"exp_avg.embed.weight": torch.randn(640, 300, generator=g)},
        "step": 7,
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _read_safetensors(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A reader written from the format's spec, independent of ckpt.export."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + n])
    data = raw[8 + n:]
    out = {}
    ends = []
    for k, v in header.items():
        if k == "__metadata__":
            continue
        lo, hi = v["data_offsets"]
        ends.append((lo, hi))
        dt = DTYPE_OF[v["dtype"]]
        buf = bytearray(data[lo:hi])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[k] = t.view(dt).reshape(v["shape"])
    ends.sort()
    assert ends[0][0] == 0 and ends[-1][1] == len(data)
    # contiguous, as the spec says
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))
    return header, out


@pytest.fixture
def run(tmp_path) -> tuple[str, dict]:
    sd = _state()
    root = str(tmp_path / "run")
    ckpt.CheckpointManager(root, keep_last=None).save(7, sd, async_save=False)
    return root, sd


def test_safetensors_roundtrip_bitwise(run, tmp_path, capsys) -> None:
    root, sd = run
    out = tmp_path / "model.safetensors"
    assert main(["export", root, "--step", "7", "--to", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors"] == len(sd["model"])
    header, got = _read_safetensors(out)
    assert header["__metadata__"]["relight_step"] == "7"
    assert set(got) == set(sd["model"])  # the model. prefix is dropped, optimizer left out
    for k, t in sd["model"].items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert _bits(got[k]) == _bits(t), k
    assert header["embed.weight"]["data_offsets"][1] - header["embed.weight"]["data_offsets"][0] \
        == 640 * 300 * 4

    assert main(["export", root, "--to", str(tmp_path / "all.safetensors"), "--all"]) == 0
    _, everything = _read_safetensors(tmp_path / "all.safetensors")
    assert _bits(everything["optim.exp_avg.embed.weight"]) == \
        _bits(sd["optim"]["exp_avg.embed.weight"])
    assert _bits(everything["model.embed.weight"]) == _bits(sd["model"]["embed.weight"])


def test_safetensors_reads_with_reference_library(run, tmp_path) -> None:
    st = pytest.importorskip("safetensors.torch")
    root, sd = run
    out = tmp_path / "m.safetensors"
    assert main(["export", root, "--to", str(out)]) == 0
    got = st.load_file(str(out))
    assert set(got) == set(sd["model"])
    for k, t in sd["model"].items():
        assert _bits(got[k]) == _bits(t), k


def test_export_streams_one_tensor_at_a_time(run, tmp_path, monkeypatch) -> None:
    root, _ = run
    live: list[weakref.ref] = []
    real = export.read_tensor

    def tracking(store, m, name):
        alive = [r for r in live if r() is not None]
        assert not alive, f"{len(alive)} earlier tensor(s) still held when reading {name}"
        t = real(store, m, name)
        live.append(weakref.ref(t))
        return t

    monkeypatch.setattr(export, "read_tensor", tracking)
    export.export_safetensors(root + "/step-000000000007", tmp_path / "a.safetensors",
                              all_tensors=True)
    assert len(live) == 9
    live.clear()
    export.export_dcp(root + "/step-000000000007", tmp_path / "dcp", all_tensors=True)
    assert len(live) == 9


def test_dcp_export_load_import_bitwise(run, tmp_path, capsys) -> None:
    import torch.distributed.checkpoint as dcp

    root, sd = run
    d = tmp_path / "dcp"
    assert main(["export", root, "--to-dcp", str(d), "--all"]) == 0
    target = {f"model.{k}": torch.zeros_like(t) for k, t in sd["model"].items()}
    target["optim.exp_avg.embed.weight"] = torch.zeros(640, 300)
    dcp.load(target, checkpoint_id=str(d), no_dist=True)  # plain DCP, no process group
    for k, t in sd["model"].items():
        assert _bits(target[f"model.{k}"]) == _bits(t), k

    back = str(tmp_path / "imported")
    assert main(["import-dcp", str(d), back, "--step", "7"]) == 0
    assert ckpt.CheckpointManager(back).committed_steps() == [7]
    loaded = {"model": {k: torch.zeros_like(t) for k, t in sd["model"].items()},
              "optim": {"exp_avg.embed.weight": torch.zeros(640, 300)}, "step": 0}
    ckpt.load(loaded, back + "/step-000000000007")
    for k, t in sd["model"].items():
        assert _bits(loaded["model"][k]) == _bits(t), k
    assert loaded["step"] == 7
    capsys.readouterr()
    # Every tensor and the JSON value "step" made the round trip Relight -> DCP -> Relight.
    assert main(["diff", root, back, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert not rep["only_a"] and not rep["only_b"] and not rep["mismatched"]
    assert len(rep["tensors"]) == 9 and all(v["identical"] for v in rep["tensors"].values())


def test_diff_reports_and_exit_codes(run, tmp_path, capsys) -> None:
    root, sd = run
    assert main(["diff", root, root, "--step-a", "7", "--step-b", "7"]) == 0
    assert "IDENTICAL" in capsys.readouterr().out

    other = _state()
    other["model"]["embed.weight"][3, 5] += 0.25
    other["model"]["layers.0.bias"] = torch.zeros(18, dtype=torch.float64)
    del other["model"]["mask"]
    other["model"]["extra"] = torch.ones(2)
    other["step"] = 8
    b = str(tmp_path / "b")
    ckpt.save(other, b).wait()
    assert main(["diff", root, b, "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["identical"] is False
    assert rep["only_a"] == ["model/mask"] and rep["only_b"] == ["model/extra"]
    assert rep["mismatched"] == {"model/layers.0.bias": "float64(17,) vs float64(18,)"}
    assert rep["values_differ"] == ["step"]
    w = rep["tensors"]["model/embed.weight"]
    a0 = float(sd["model"]["embed.weight"][3, 5])
    b0 = float(other["model"]["embed.weight"][3, 5])
    assert w["identical"] is False and w["max_abs"] == pytest.approx(abs(a0 - b0))
    assert w["max_rel"] == pytest.approx(abs(a0 - b0) / max(abs(a0), abs(b0)))
    assert rep["tensors"]["model/ids"]["identical"] is True
    assert main(["diff", root, b]) == 1
    assert "max_abs" in capsys.readouterr().out


def test_errors_and_exit_codes(run, tmp_path, capsys) -> None:
    root, _ = run
    assert main(["export", str(tmp_path / "nothing"), "--to", str(tmp_path / "x")]) == 3
    assert main(["export", root, "--step", "9", "--to", str(tmp_path / "x")]) == 3
    assert main(["export", root]) == 2  # --to or --to-dcp is required
    assert main(["import-dcp", str(tmp_path), str(tmp_path / "y")]) == 3
    assert main(["diff", root, str(tmp_path / "nothing")]) == 3
    no_model = str(tmp_path / "nomodel")
    ckpt.save({"optim": {"m": torch.ones(3)}}, no_model).wait()
    assert main(["export", no_model, "--to", str(tmp_path / "z")]) == 1
    assert "--all" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


def test_read_all_returns_every_tensor_whole(tmp_path) -> None:
    from relight.ckpt.export import read_all

    url = str(tmp_path / "c")
    state = {"model": {"w": torch.randn(5, 3)}, "optim": {"m": torch.arange(7)}}
    ckpt.save(state, url).wait()
    got = read_all(url)
    assert set(got) == {"model/w", "optim/m"}
    assert torch.equal(got["model/w"], state["model"]["w"])
    assert torch.equal(got["optim/m"], state["optim"]["m"])


# ------------------------------------------- DCP round trips with a real optimizer


def _trained_mlp(seed: int, steps: int = 2):
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(steps):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_same_training_state(model, opt, ref_model, ref_opt) -> None:
    for (name, a), (_, b) in zip(model.named_parameters(), ref_model.named_parameters(),
                                 strict=True):
        assert _bits(a.detach()) == _bits(b.detach()), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert _bits(opt.state[a][k]) == _bits(ref_opt.state[b][k]), (name, k)
    def plain(group: dict) -> dict:  # JSON has no tuples: AdamW's betas come back a list
        return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()
                if k != "params"}

    for ga, gb in zip(opt.param_groups, ref_opt.param_groups, strict=True):
        assert plain(ga) == plain(gb)


def _fresh_state(seed: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _trained_mlp(seed, steps=0)
    for g in opt.param_groups:  # the restore must bring the saved hyperparameters back
        g["lr"], g["weight_decay"] = 0.5, 0.0
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optim": osd}


def _apply(model, opt, sd) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def test_import_dcp_keeps_the_optimizer_and_exports_it_back(tmp_path, capsys) -> None:
    """DCP -> Relight -> DCP with model + AdamW state: the README's restore of model and
    optimizer from the imported step, then `dcp.load` of the export, both bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref_model, ref_opt = _trained_mlp(0)
    msd, osd = get_state_dict(ref_model, ref_opt)
    src = tmp_path / "dcp-src"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(src), no_dist=True)

    root = str(tmp_path / "run")
    assert main(["import-dcp", str(src), root, "--step", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["skipped"] == [] and out["values"] > 0, out
    model, opt, sd = _fresh_state(1)
    assert ckpt.CheckpointManager(root).restore(sd) == 5
    _apply(model, opt, sd)
    _assert_same_training_state(model, opt, ref_model, ref_opt)

    back = tmp_path / "dcp-back"
    assert main(["export", root, "--to-dcp", str(back), "--all"]) == 0
    model2, opt2, sd2 = _fresh_state(2)
    dcp.load(sd2, checkpoint_id=str(back), no_dist=True)
    _apply(model2, opt2, sd2)
    _assert_same_training_state(model2, opt2, ref_model, ref_opt)


def test_export_all_to_dcp_loads_a_full_model_and_optimizer(tmp_path) -> None:
    """Relight -> DCP: `export --all --to-dcp` writes the JSON values too (param_groups,
    the step), so `dcp.load` of {"model", "optim", "step"} finds every key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref_model, ref_opt = _trained_mlp(0)
    msd, osd = get_state_dict(ref_model, ref_opt)
    root = str(tmp_path / "run")
    ckpt.CheckpointManager(root).save(3, {"model": msd, "optim": osd, "step": 3},
                                      async_save=False)
    d = tmp_path / "dcp"
    assert main(["export", root, "--to-dcp", str(d), "--all"]) == 0
    model, opt, sd = _fresh_state(1)
    sd["step"] = 0
    dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    _apply(model, opt, sd)
    _assert_same_training_state(model, opt, ref_model, ref_opt)
    assert sd["step"] == 3
