"""What the harness reads from the nodes' logs: the error a script failed with before its
first step, and a node that came after the job had finished."""

from __future__ import annotations

from pathlib import Path

from relight.chaos.logs import StepRecord
from relight.chaos.node_logs import (
    came_after_finish,
    closed_rendezvous,
    last_error,
    last_errors,
    with_last_errors,
)

# A node's log as `relight run` leaves it when a warm-started script cannot import a
# module: the worker's traceback twice (the agent restarted it once), the launcher's
# summary last.
FAILED_IMPORT = """\
relight run: warm starts through /tmp/relight-warm-1/s.sock (torch imported once)
2026-12-06 00:33:26,543 INFO relight.elastic.rendezvous: [job round=0] joined as rank 0 of 1
Traceback (most recent call last):
  File "/work/main/elastic/warm.py", line 219, in _become_worker
    runpy.run_path(argv[0], run_name="__main__")
  File "/proj/train.py", line 2, in <module>
    import helpers
ModuleNotFoundError: No module named 'helpers'
E1206 00:33:29.053000 19806 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 19822)
Traceback (most recent call last):
  File "/proj/train.py", line 2, in <module>
    import helpers
ModuleNotFoundError: No module named 'helpers'
Traceback (most recent call last):
  File "torch/distributed/run.py", line 900, in run
    elastic_launch(...)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
relight.elastic.warm FAILED
"""

CLOSED = """\
2026-12-06 00:40:01,002 INFO relight.elastic.rendezvous: [job round=3] joining
Traceback (most recent call last):
  File "elastic/launch.py", line 320, in _launch
    torchrun(args)
torch.distributed.elastic.rendezvous.api.RendezvousClosedError: rendezvous for job 'x' is \
closed (the job finished or was stopped)
"""


def test_last_error_is_the_scripts_not_the_launchers() -> None:
    assert last_error(FAILED_IMPORT) == "ModuleNotFoundError: No module named 'helpers'"
    assert last_error("no traceback here\n") is None


def test_last_errors_names_each_log_once(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"node-{i}.log").write_text(FAILED_IMPORT if i < 2 else "")
    logs = sorted(tmp_path.glob("*.log")) + [tmp_path / "missing.log"]
    assert last_errors(logs) == ["ModuleNotFoundError: No module named 'helpers' (node-0.log)"]


def test_a_run_without_a_step_says_why(tmp_path: Path) -> None:
    (tmp_path / "node-0.log").write_text(FAILED_IMPORT)
    detail = with_last_errors("agents exited {0: 1}", [], [tmp_path / "node-0.log"])
    assert detail == ("agents exited {0: 1}; the training script failed before its first "
                      "step: ModuleNotFoundError: No module named 'helpers' (node-0.log)")
    later = with_last_errors("x", [StepRecord(step=1, loss=1.0)], [tmp_path / "node-0.log"])
    assert "last error in the node logs: ModuleNotFoundError" in later


def test_a_node_that_came_after_the_finish_is_not_counted() -> None:
    logs = {0: "", 2: CLOSED}
    assert closed_rendezvous(CLOSED) and not closed_rendezvous(FAILED_IMPORT)
    # Node 0 finished the job; node 2 (a late replacement) found the rendezvous closed.
    assert came_after_finish({0: 0, 2: 1}, {0: {11, 12}}, logs.get) == {2}


def test_a_node_that_trained_or_failed_otherwise_still_counts() -> None:
    logs = {0: "", 1: CLOSED, 2: FAILED_IMPORT}
    # It had started workers: its failure is the job's.
    assert came_after_finish({0: 0, 1: 1}, {0: {11}, 1: {21}}, logs.get) == set()
    # It failed for another reason.
    assert came_after_finish({0: 0, 2: 1}, {0: {11}}, logs.get) == set()
    # Nobody finished: a closed rendezvous then means the job was stopped.
    assert came_after_finish({0: 1, 1: 1}, {0: {11}}, logs.get) == set()
