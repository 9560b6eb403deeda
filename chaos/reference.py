"""The reference run: the chaos run's job without faults, which the verifier holds the
chaos run to, and its cache.

The reference runs the same command at the chaos run's starting world size on one agent
(`reference_scenario`). A cache (`--reference-cache DIR`) keeps it under a key of the
training setup and the content of the files it runs (`reference_key`), not the seed:
a series of seeds pays for it once, and an edited script gets a new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import replace
from pathlib import Path

from relight.chaos.commands import TrainingFileError, resolve_path
from relight.chaos.fingerprint import files_digest, local_imports
from relight.chaos.logs import StepRecord, parse_metrics
from relight.chaos.scenario import Scenario
from relight.storage import Store, open_store

__all__ = ["copy_store", "load_cached", "reference_key", "reference_scenario", "save_cached",
           "training_files"]


def reference_scenario(scenario: Scenario) -> Scenario:
    """The reference: the same world size as the chaos run starts with, on one agent (the
    layout depends on the world size only, and one agent needs no multi-node rendezvous
    to be trusted), no faults. Replica groups keep their groups."""
    c = scenario.cluster
    if c.replica_groups:
        # The same groups, no faults: steps in a full quorum are then bitwise comparable.
        return replace(scenario, faults=(), mtbf=replace(scenario.mtbf, count=0))
    one = replace(c, nodes=1, ranks_per_node=c.world_size, min_nodes=1, max_nodes=1)
    return replace(scenario, cluster=one, faults=(), mtbf=replace(scenario.mtbf, count=0))


def reference_key(scenario: Scenario, workdir: Path | None = None) -> str:
    """Runs with equal keys produce the same reference (the seed only moves the faults):
    the training setup, and the content of the files it runs (`training_files`), so an
    edited script never meets the reference of its previous version."""
    files = training_files(scenario, workdir or Path.cwd())
    ident = {"training": scenario.to_dict()["training"], "target": scenario.target_step,
             "interval": scenario.checkpoint.interval, "world": scenario.cluster.world_size,
             "ranks_per_node": scenario.cluster.ranks_per_node,
             "nodes": scenario.cluster.nodes, "storage": scenario.storage.kind,
             "files": files_digest(files, scenario.base_dir)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def training_files(scenario: Scenario, workdir: Path) -> list[Path]:
    """The files the training command runs: its Python script and the modules the script
    imports from its own folder (`fingerprint.local_imports`), runtime.train's config,
    and any other argument of the command that names a file (relative to `workdir`, as
    the script would open it). Installed packages, Relight included, are not covered."""
    tr = scenario.training
    files: list[Path] = []
    if tr.config:
        with contextlib.suppress(TrainingFileError):
            files.append(Path(resolve_path(tr.config, scenario)))
    args = list(tr.command)
    if args and args[0].endswith(".py"):
        with contextlib.suppress(TrainingFileError):
            files.extend(local_imports(Path(resolve_path(args[0], scenario))))
        args = args[1:]
    for arg in args:
        path = workdir / arg
        if "{" not in arg and path.is_file():
            files.append(path.resolve())
    return files


def copy_store(src: Store, dst: Store) -> int:
    """Copy every object of `src` to `dst` (the reference checkpoints into a local cache,
    from whichever store the reference run wrote them to). Returns the objects copied."""
    keys = src.list()
    for key in keys:
        dst.put(key, src.get(key))
    return len(keys)


def load_cached(cache: Path) -> tuple[list[StepRecord], str | None] | None:
    """A cached reference's records and its checkpoint root (None when the cache holds no
    checkpoints), or None when `cache` holds no reference."""
    if not (cache / "reference.json").is_file():
        return None
    cached = json.loads((cache / "reference.json").read_text())
    records = parse_metrics(cached["metrics"]).records
    return records, (str(cache / "ckpt") if (cache / "ckpt").is_dir() else None)


def save_cached(cache: Path, ref_url: str, observed_metrics: Path) -> None:
    """Keep a finished reference under `cache`: its checkpoints (copied from whichever
    store it wrote them to) and its metrics as the harness observed them."""
    cache.mkdir(parents=True, exist_ok=True)
    copy_store(open_store(ref_url), open_store(str(cache / "ckpt")))
    lines = observed_metrics.read_text()
    (cache / "reference.json").write_text(json.dumps({"metrics": lines.splitlines()}))
