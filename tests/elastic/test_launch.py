"""`relight run` (elastic.launch.main): embedded etcd, torchrun underneath."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relight.elastic.launch import LaunchError, main, parse_launch_args, split_command
from tests.elastic.agents import ROOT

pytestmark = [pytest.mark.etcd, pytest.mark.multirank, pytest.mark.timeout(120)]


def relight_run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys; from relight.cli import main; sys.exit(main(['run', *sys.argv[1:]]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=100)


def etcd_processes_in(run_dir: Path) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "etcd" in cmdline and str(run_dir) in cmdline:
            found.append(pid)
    return found


def test_the_training_commands_own_arguments_are_not_parsed_by_the_launcher() -> None:
    # `--metrics=` and `--log=` are prefixes of two launcher options each (torchrun's
    # --metrics-port/--metrics-host, --log-dir/--log-...): parsed, they were ambiguous.
    for command in (["python", "x.py", "--metrics=foo", "--log=bar", "-m", "y"],
                    ["python", "-m", "pkg.train", "--metrics=foo", "--nproc-per-node=9"],
                    ["./bin/train", "--log=x"]):
        positional = split_command(command)
        args = parse_launch_args(["--nproc-per-node=2", "--rdzv-id=j"], positional)
        assert args.nproc_per_node == "2" and args.rdzv_id == "j"
        script_args = [a for a in positional if a not in ("--module", "--no-python")][1:]
        assert args.training_script_args == script_args
        assert args.training_script == (command[2] if command[1] == "-m"
                                        else command[0] if command[0].startswith("./")
                                        else command[1])


def test_split_command() -> None:
    assert split_command(["python", "-m", "relight.runtime.train", "--x"]) == [
        "--module", "relight.runtime.train", "--x"]
    assert split_command([sys.executable, "-u", "train.py", "a"]) == ["train.py", "a"]
    assert split_command(["./bin/train", "a"]) == ["--no-python", "./bin/train", "a"]
    with pytest.raises(LaunchError, match="after '--'"):
        split_command([])
    with pytest.raises(LaunchError, match="-X"):
        split_command(["python3", "-X", "dev", "t.py"])
    # A command without its interpreter: said plainly, not torchrun's flag clash.
    with pytest.raises(LaunchError, match="python -m relight.runtime.train"):
        split_command(["-m", "relight.runtime.train"])


def test_run_with_embedded_etcd(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    res = relight_run("--nproc-per-node=2", "--run-dir", str(run_dir), "--",
                      sys.executable, "-m", "tests.elastic.scripts.allreduce", str(out),
                      cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "embedded etcd at 127.0.0.1:" in res.stderr
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert {s["world"] for s in seen} == {2} and {s["sum"] for s in seen} == {3.0}
    assert (run_dir / "etcd" / "data").is_dir()  # etcd kept its data in the run dir
    assert [json.loads(line)["ev"] for line in
            (run_dir / "events.jsonl").read_text().splitlines()] == ["rdzv_start", "rdzv_done"]
    assert etcd_processes_in(run_dir) == []  # and was stopped at the end


def test_no_warm_start_runs_fresh_interpreters(tmp_path) -> None:
    worker = str(Path(__file__).parent / "scripts" / "warm_worker.py")
    res = relight_run("--no-warm-start", "--nproc-per-node=1", "--run-dir",
                      str(tmp_path / "run"), "--", sys.executable, worker,
                      str(tmp_path / "o"), "exit0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warm starts through" not in res.stderr
    rec = json.loads((tmp_path / "o").read_text().splitlines()[0])
    assert not rec["torch_preloaded"]


def test_failing_command_returns_nonzero_and_stops_etcd(tmp_path) -> None:
    # The command exits with the preemption status 76 at once, every time: a notice that
    # never clears. Relight's agent gives a preempted group its --max-restarts slot back
    # only if it ran RELIGHT_PREEMPTION_FREE_AFTER_S (60 s), so here the slots are spent
    # and the job fails instead of restarting forever.
    run_dir = tmp_path / "run"
    res = relight_run("--max-restarts=1", "--run-dir", str(run_dir), "--", "sh", "-c",
                      "exit 76", cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "sh" in res.stderr and "76" in res.stderr  # torchrun's failure summary
    # Not a Python command: warm starts fall back to cold ones, and say so.
    assert "cold starts (warm starts unavailable" in res.stderr
    events = [json.loads(line) for line in
              (run_dir / "events.jsonl").read_text().splitlines()]
    done = [e for e in events if e["ev"] == "rdzv_done"]
    assert [e["reason"] for e in done] == ["start", "fault"]  # the first try, one restart
    assert etcd_processes_in(run_dir) == []


def test_preempted_groups_do_not_spend_restart_slots(tmp_path, monkeypatch) -> None:
    # Three preemptions in a row (exit 76), then the work completes, under --max-restarts=1:
    # torchrun's agent would fail the job at the second preemption.
    monkeypatch.setenv("RELIGHT_PREEMPTION_FREE_AFTER_S", "0")
    run_dir = tmp_path / "run"
    script = ('n=$(cat count 2>/dev/null || echo 0); echo $((n + 1)) > count; '
              '[ "$n" -ge 3 ] && exit 0; exit 76')
    res = relight_run("--max-restarts=1", "--run-dir", str(run_dir), "--", "sh", "-c",
                      script, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "count").read_text().strip() == "4"
    events = [json.loads(line) for line in
              (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in events if e["ev"] == "rdzv_done"] == [
        "start", "fault", "fault", "fault"]
    refunds = [e for e in events if e["ev"] == "restart_not_counted"]
    assert len(refunds) == 3 and {e["reason"] for e in refunds} == {"preempted"}
    assert etcd_processes_in(run_dir) == []


# 2 (a usage error) takes the same path as 65; the long tier runs it too.
@pytest.mark.parametrize("status", [65, pytest.param(2, marks=pytest.mark.long)])
def test_fatal_exit_statuses_are_not_restarted(tmp_path, status) -> None:
    # 65: every committed checkpoint damaged; 2: bad config. A restart would rerun the same
    # failure, so the job ends at once with slots left (torchrun's agent spends all 3;
    # test_failing_command_... above pins that other statuses still restart).
    run_dir = tmp_path / "run"
    script = f'n=$(cat count 2>/dev/null || echo 0); echo $((n + 1)) > count; exit {status}'
    res = relight_run("--max-restarts=3", "--run-dir", str(run_dir), "--", "sh", "-c",
                      script, cwd=tmp_path)
    assert res.returncode != 0
    assert (tmp_path / "count").read_text().strip() == "1"
    events = [json.loads(line) for line in
              (run_dir / "events.jsonl").read_text().splitlines()]
    refused = [e for e in events if e["ev"] == "restart_refused"]
    assert len(refused) == 1 and refused[0]["exit_codes"] == [status]
    assert etcd_processes_in(run_dir) == []


def test_warm_start_forks_workers_with_torch_imported(tmp_path) -> None:
    """Warm starts (the default): the workers are forked by the node's server (torch already
    imported: the script itself never imports it), their exit statuses reach the agent
    (a fault is restarted), and the server is gone when the job ends."""
    run_dir = tmp_path / "run"
    worker = str(Path(__file__).parent / "scripts" / "warm_worker.py")
    script = (f'import subprocess, sys; n = len(open("{tmp_path}/o").read().splitlines()) '
              f'if __import__("os").path.exists("{tmp_path}/o") else 0; '
              f'sys.argv = ["{worker}", "{tmp_path}/o", "exit0" if n >= 2 else "exit1"]; '
              f'exec(open("{worker}").read())')
    (tmp_path / "job.py").write_text(script)
    res = relight_run("--nproc-per-node=2", "--max-restarts=1",
                      "--run-dir", str(run_dir), "--", sys.executable, str(tmp_path / "job.py"),
                      cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warm starts through" in res.stderr
    recs = [json.loads(line) for line in (tmp_path / "o").read_text().splitlines()]
    assert len(recs) == 4  # two workers failed (exit 1), the group restarted once
    assert all(r["torch_preloaded"] for r in recs)
    assert len({r["ppid"] for r in recs}) == 1  # one server forked them all
    assert not [p for p in os.listdir("/proc") if p == str(recs[0]["ppid"])]
    assert etcd_processes_in(run_dir) == []


def test_usage_errors(capsys) -> None:
    assert main(["--nproc-per-node=2"]) == 2
    assert "after '--'" in capsys.readouterr().err
    assert main(["--standalone", "--", "true"]) == 2
    assert "--standalone" in capsys.readouterr().err
    assert main(["--", "python", "-X", "dev", "t.py"]) == 2


def test_the_agent_starts_its_warm_server_before_importing_torch() -> None:
    """The fork server imports torch and the training module while the agent imports its
    own (torchrun): `elastic.launch` must not import torch before `main` starts it."""
    res = subprocess.run([sys.executable, "-c", (
        "import sys, elastic.launch; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"imported before the warm server starts: {res.stdout}"


def test_a_worker_imports_tensorstore_only_when_an_array_needs_it(tmp_path: Path) -> None:
    """tensorstore and ml_dtypes are over a second of every worker's (and warm server's)
    start: the trainer, the agent's config check and a file store must not import them;
    a memory store (which lives in tensorstore) still works."""
    res = subprocess.run([sys.executable, "-c", (
        "import sys, relight.runtime.train, relight.runtime.launch_hints\n"
        "from relight import storage\n"
        f"relight.runtime.launch_hints.training_hints(['--module', 'relight.runtime.train', "
        f"'--checkpoint.url={tmp_path}'])\n"
        f"storage.open_store({str(tmp_path)!r}).put('k', b'v')\n"
        "print(sorted(m for m in ('tensorstore', 'ml_dtypes') if m in sys.modules))\n"
        "store = storage.open_store('memory://lazy/p')\n"
        "store.put('k', b'v')\n"
        "print(store.get('k'), 'tensorstore' in sys.modules)\n")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["[]", "b'v' True"], res.stdout
