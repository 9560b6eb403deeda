"""The commands a launch runs: the training command every rank runs (the contract's
placeholders, arguments and environment, docs/chaos.md) and the agent each node runs
(`relight run` or plain torchrun) around it.

A relative path a scenario names resolves against the scenario file's folder, one rule
(`resolve_path`), checked before any server starts (`check_training_files`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from relight.chaos.scenario import Scenario
from relight.errors import RelightError

__all__ = ["TrainingFileError", "agent_command", "check_training_files", "resolve_path",
           "threads_per_rank", "training_command"]


class TrainingFileError(RelightError, FileNotFoundError):
    """A file the scenario's [training] names (its script, its config) is not there."""


def resolve_path(path: str, scenario: Scenario) -> str:
    """A file the scenario names (`training.command`'s script, `training.config`): an
    absolute path as it is, a relative one against the scenario file's folder (a
    scenario built in code, with no file: the current directory). One rule, so a
    scenario means the same files from whatever directory it is run; a path that is not
    there is an error naming where it was looked for, never a file of the same name
    found elsewhere."""
    candidate = (scenario.base_dir / path).resolve()
    if not candidate.exists():
        where = (f"the scenario file's folder {scenario.base_dir}" if scenario.source
                 else f"the current directory {scenario.base_dir} (no scenario file)")
        raise TrainingFileError(f"training file {path!r} not found: {candidate} does not "
                                f"exist (relative paths in a scenario are resolved against "
                                f"{where})")
    return str(candidate)


def check_training_files(scenario: Scenario) -> None:
    """Raise `TrainingFileError` now, before any server starts, if the script or the
    config the scenario names is not where the one rule says."""
    tr = scenario.training
    if tr.config:
        resolve_path(tr.config, scenario)
    if tr.command and tr.command[0].endswith(".py"):
        resolve_path(tr.command[0], scenario)


def threads_per_rank(scenario: Scenario) -> int:
    """Intra-op threads for each training process: the simulated nodes all run on this
    machine, so its cores are shared by every rank the cluster can hold at once.
    torchrun sets one thread only for agents of several workers; a node of one worker
    would take every core, and four such nodes on two cores ran their steps 10x slower
    (torch's thread pools spinning against each other) than with one thread each."""
    c = scenario.cluster
    ranks = max(c.nodes, c.max_nodes) * c.ranks_per_node
    return max(1, (os.cpu_count() or 1) // ranks)


def training_command(scenario: Scenario, ckpt_url: str, metrics: Path) -> tuple[list[str],
                                                                                dict[str, str]]:
    """argv and extra environment of the training processes."""
    tr = scenario.training
    values = {
        "python": sys.executable,
        "ckpt_url": ckpt_url,
        "metrics": str(metrics),
        "target_step": str(scenario.target_step),
        "interval": str(scenario.checkpoint.interval),
        "config": resolve_path(tr.config, scenario) if tr.config else "",
        "scenario_dir": str(scenario.base_dir),
    }
    env = {
        "RELIGHT_CKPT_URL": ckpt_url,
        "RELIGHT_METRICS_PATH": str(metrics),
        "RELIGHT_TARGET_STEP": values["target_step"],
        "RELIGHT_CKPT_INTERVAL": values["interval"],
        **({} if "OMP_NUM_THREADS" in os.environ
           else {"OMP_NUM_THREADS": str(threads_per_rank(scenario))}),
        # runtime.train gets it as an argument; for a user's script it is a hint only
        # (what it keeps is its own retention policy).
        **({"RELIGHT_CKPT_KEEP_LAST": str(scenario.checkpoint.keep_last)}
           if scenario.checkpoint.keep_last else {}),
        **tr.env,
    }
    overrides = [f"--{k}={_toml_value(v)}" for k, v in tr.overrides.items()]
    if tr.command:
        argv = [a.format(**values) for a in tr.command]
        if argv and argv[0].endswith(".py"):
            argv = [sys.executable, resolve_path(argv[0], scenario), *argv[1:]]
        return argv + overrides, env
    argv = [
        sys.executable, "-m", "relight.runtime.train", "--config", values["config"],
        f"--train.steps={scenario.target_step}",
        f"--checkpoint.url={ckpt_url}",
        f"--checkpoint.every={scenario.checkpoint.interval}",
        f"--train.metrics_path={metrics}",
    ]
    if scenario.checkpoint.keep_last:
        argv.append(f"--checkpoint.keep_last={scenario.checkpoint.keep_last}")
    return argv + overrides, env


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def agent_command(scenario: Scenario, endpoint: str, job_id: str, nnodes: str,
                  train_argv: list[str], node_dir: Path) -> list[str]:
    """One node's agent: `relight run` (the launcher's `main(argv)` in a fresh python) or
    plain torchrun, on the harness's etcd (`relight-etcd`) or torchrun's `c10d`."""
    c = scenario.cluster
    if c.launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run"]
    else:
        head = [sys.executable, "-c",
                "import sys; from relight.cli import main; sys.exit(main(['run', *sys.argv[1:]]))",
                f"--run-dir={node_dir}"]
    conf = f"join_timeout={c.rdzv_timeout_s:g},last_call_timeout={c.last_call_s:g}"
    if c.rendezvous == "relight-etcd":
        conf += "".join(f",{k}={v:g}" for k, v in (("lease_ttl", c.lease_ttl_s),
                                                   ("rejoin_timeout", c.rejoin_timeout_s)) if v)
    elif c.c10d_store == "standalone":
        conf += ",is_host=false"
    return [
        *head,
        f"--rdzv-backend={c.rendezvous}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={c.ranks_per_node}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job_id}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={c.max_restarts}",
        f"--monitor-interval={c.monitor_interval_s:g}",
        *(["--no-python"] if c.launcher == "torchrun" else ["--"]),
        *train_argv,
    ]
