"""Progress of long CLI work: callbacks that reach the total, a bar only on a terminal."""

from __future__ import annotations

import io

import torch
from rich.console import Console

import relight.ckpt.export as export
from relight import ckpt
from relight.ckpt.cli import ProgressBar, main
from relight.ckpt.verify import verify


def _checkpoint(url: str) -> int:
    g = torch.Generator().manual_seed(1)
    sd = {"model": {"a": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g)},
          "optim": {"m": torch.randn(50, generator=g)}}
    ckpt.save(sd, url).wait()
    return (300 * 200 + 7) * 4  # bytes of the model/... tensors


def test_callbacks_reach_the_total(tmp_path) -> None:
    url = str(tmp_path / "c")
    model_bytes = _checkpoint(url)
    calls: list[tuple[int, int, str]] = []

    def rec(done: int, total: int, item: str) -> None:
        calls.append((done, total, item))

    export.export_safetensors(url, tmp_path / "m.safetensors", progress=rec)
    assert calls[-1][:2] == (model_bytes, model_bytes)
    assert [d for d, _, _ in calls] == sorted(d for d, _, _ in calls)
    calls.clear()
    export.export_dcp(url, tmp_path / "dcp", progress=rec)
    assert calls[-1][:2] == (model_bytes, model_bytes) and len(calls) == 2
    calls.clear()
    export.import_dcp(tmp_path / "dcp", str(tmp_path / "back"), progress=rec)
    assert calls[0][0] == 0 and calls[-1] == (model_bytes, model_bytes, "saved")
    calls.clear()
    export.diff(url, url, progress=rec)
    assert calls[-1][0] == calls[-1][1] == 2 * (model_bytes + 50 * 4)
    calls.clear()
    assert verify(url, progress=rec).ok
    assert [(d, t) for d, t, _ in calls] == [(0, 3), (1, 3), (2, 3)]
    assert {n for _, _, n in calls} == {"model/a", "model/b", "optim/m"}


def test_bar_renders_on_a_terminal_only(tmp_path, capsys) -> None:
    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=100)
    with ProgressBar("export", enabled=True, console=term) as bar:
        bar(512, 1024, "model/a")
    assert "export model/a" in buf.getvalue()

    buf = io.StringIO()
    with ProgressBar("export", enabled=False, console=Console(file=buf, force_terminal=True)) \
            as bar:
        bar(1, 2, "x")
    assert buf.getvalue() == ""  # --json turns it off

    url = str(tmp_path / "c")
    _checkpoint(url)
    capsys.readouterr()
    # Under pytest stderr is not a terminal: the commands print no bar, only their result.
    assert main(["verify", url]) == 0
    assert main(["export", url, "--to", str(tmp_path / "m.safetensors")]) == 0
    err = capsys.readouterr().err
    assert "\x1b[" not in err and "━" not in err
