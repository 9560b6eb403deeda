"""What an operator sees of a real run: a fresh process that checkpoints and stops, then a
restarted one that resumes (started as the agent would: restart count and rendezvous round
in its environment). Checked: TensorBoard scalars read back with tensorboard's own reader,
the event log lines, the metrics fields, and `relight plan --from-run` on that run."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from relight.runtime.goodput_plan import main as plan_main
from relight.runtime.goodput_plan import measure_run

ROOT = Path(__file__).resolve().parents[2]
AGENT_ENV = ("TORCHELASTIC_RESTART_COUNT", "RELIGHT_RDZV_ROUND")


def _train(run: Path, extra: list[str], agent_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in AGENT_ENV}
    env.update(OMP_NUM_THREADS="1", RELIGHT_LOG_LEVEL="INFO", **agent_env)
    proc = subprocess.run(
        [sys.executable, "-m", "relight.runtime.train", "--config", "configs/tiny.toml",
         "--model.n_layers=1", "--train.steps=6", "--checkpoint.every=2", "--train.device=cpu",
         "--train.watchdog_timeout_s=0", f"--checkpoint.url={run / 'ckpt'}",
         f"--train.metrics_path={run / 'metrics.jsonl'}",
         f"--train.tensorboard_dir={run / 'tb'}", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Steps 1-4 in a fresh process (saves at 2 and 4), then 5-6 in a restarted one."""
    d = tmp_path_factory.mktemp("run")
    first = _train(d, ["--train.stop_at=4"], {})
    second = _train(d, [], {"TORCHELASTIC_RESTART_COUNT": "1", "RELIGHT_RDZV_ROUND": "3"})
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    return {"dir": d, "logs": [first, second], "records": records}


def _scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(tb_dir.glob("events.out.tfevents.*")):  # one file per process
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_tensorboard_scalars_match_the_metrics(run: dict) -> None:
    s = _scalars(run["dir"] / "tb")
    recs = run["records"]
    assert [st for st, _ in s["train/loss"]] == [1, 2, 3, 4, 5, 6]
    for tag, key in (("train/loss", "loss"), ("perf/tokens_per_s", "tokens_per_s"),
                     ("perf/step_time_s", "step_time_s"), ("ckpt/stall_s", "ckpt_stall_s")):
        for (step, value), r in zip(s[tag], recs, strict=True):
            assert step == r["step"]
            assert value == pytest.approx(r[key], rel=1e-6), (tag, step)
    assert [v for _, v in s["job/restarts"]] == [0, 0, 0, 0, 1, 1]
    assert [v for _, v in s["job/rdzv_round"]] == [3, 3]  # only the agent-started process
    assert "perf/mfu" not in s  # no known peak on a CPU: MFU is null, so not written
    # Commit age: none before the first commit (step 2 commits synchronously or during
    # step 3), then non-negative, and after the restore it counts from step 4's commit.
    age = dict(s["ckpt/since_commit_s"])
    assert 1 not in age and all(v >= 0 for v in age.values())
    assert {5, 6} <= set(age)


def test_event_log_lines_carry_rank_and_step(run: dict) -> None:
    first, second = run["logs"]
    assert "[rank 0 step 2] checkpoint step 2 committed" in first \
        or "[rank 0 step 3] checkpoint step 2 committed" in first
    assert "[rank 0 step 4] checkpoint step 4 committed" in first
    assert "[rank 0 step 4] restore from step 4 at layout single" in second
    assert "rendezvous round 3" in second and "restart 1, rendezvous round 3" in second
    assert "rendezvous round" not in first  # no agent said: the round is omitted
    assert "[rank 0 step 6] checkpoint step 6 committed" in second


def test_metrics_mark_each_process_and_its_restore(run: dict) -> None:
    recs = run["records"]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [("startup_s" in r) for r in recs] == [True, False, False, False, True, False]
    assert recs[0]["restore_s"] is None and recs[4]["restore_s"] > 0
    assert recs[4]["startup_s"] > recs[4]["restore_s"]
    assert [r["ckpt_saved"] for r in recs] == [False, True, False, True, False, True]
    assert [r.get("rdzv_round") for r in recs] == [None] * 4 + [3, 3]
    assert [r["restarts"] for r in recs] == [0, 0, 0, 0, 1, 1]


def test_plan_from_run_uses_the_measured_inputs(run: dict, capsys, tmp_path: Path) -> None:
    recs = run["records"]
    m = measure_run(run["dir"])
    assert (m.steps, m.lifetimes, m.world_size, m.saves, m.interval_steps) == (6, 2, 1, 3, 2)
    assert m.save_stall_s == pytest.approx(statistics.fmean(
        r["ckpt_stall_s"] for r in recs if r["ckpt_saved"]))
    assert m.step_time_s == pytest.approx(statistics.median(
        r["step_time_s"] for r in recs if r["step"] not in (1, 5)))
    # The restart gap: end of step 4 to the start of step 5 in the next process.
    assert m.restore_basis.startswith("restart gap")
    assert m.restore_time_s == pytest.approx(
        recs[4]["time"] - recs[4]["step_time_s"] - recs[3]["time"])
    assert m.restore_time_s > recs[4]["restore_s"]

    plot = tmp_path / "goodput.png"
    rc = plan_main(["--from-run", str(run["dir"]), "--mtbf-hours-per-gpu", "1",
                    "--gpus", "1024", "--json", "--plot", str(plot)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and plot.stat().st_size > 1000
    assert out["inputs"]["save_stall_s"] == pytest.approx(m.save_stall_s)
    assert out["inputs"]["restore_time_s"] == pytest.approx(m.restore_time_s)
    assert out["current_interval_s"] == pytest.approx(2 * m.step_time_s)
    assert out["measured"]["interval_steps"] == 2
    assert 0 < out["current_goodput"] <= out["optimal_goodput"] < 1

    rc = plan_main(["--from-run", str(run["dir"]), "--mtbf-hours-per-gpu", "1"])
    text = capsys.readouterr().out
    assert rc == 0 and "restore time" in text and "current interval" in text
    assert "1 GPUs" in text  # --gpus defaults to the run's world size


def test_plan_from_run_without_metrics_exits_3(tmp_path: Path, capsys) -> None:
    assert plan_main(["--from-run", str(tmp_path), "--mtbf-hours-per-gpu", "1"]) == 3
    assert "no metrics file" in capsys.readouterr().err


def test_a_failed_restore_is_logged_as_a_fault(run: dict, caplog) -> None:
    """An explicit restore_step that is not committed: the rank says `fault detected` with
    its rank and step, then raises (the process exits non-zero and the agent restarts)."""
    from relight.ckpt.errors import CheckpointNotFoundError
    from relight.runtime.config import load_config
    from relight.runtime.train import run_training

    cfg = load_config(ROOT / "configs/tiny.toml", [
        "--model.n_layers=1", "--train.steps=6", "--train.watchdog_timeout_s=0",
        "--train.device=cpu", f"--checkpoint.url={run['dir'] / 'ckpt'}",
        "--checkpoint.restore_step=5"])
    with caplog.at_level("ERROR", logger="relight.runtime.train"), \
            pytest.raises(CheckpointNotFoundError):
        run_training(cfg)
    lines = [r.getMessage() for r in caplog.records if "fault detected" in r.getMessage()]
    assert lines and lines[0].startswith("[rank 0 step 0] fault detected: "
                                         "CheckpointNotFoundError")
