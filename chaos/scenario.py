"""Chaos scenarios: a TOML file that says what cluster to run, what to train, and what to break.

A scenario is parsed once into frozen dataclasses and validated before anything starts, so a
typo fails in milliseconds with the key that is wrong, not after five minutes of training.

Layout of a scenario file::

    name = "ci-smoke"
    seed = 0                  # drives every random choice (victims, MTBF draws)
    target_step = 30
    deadline_s = 240          # global wall-clock bound of the chaos run

    [cluster]                 # nodes on loopback, one torchrun agent each
    nodes = 2
    ranks_per_node = 2
    min_nodes = 1
    max_nodes = 2

    [training]                # runtime.train by default; any command meeting the contract
    config = "../configs/tiny.toml"   # paths: relative to this file's folder
    overrides = { "model.n_layers" = 2 }

    [storage]                 # "local" (a dir under the run dir) or "s3" (SeaweedFS)
    kind = "local"

    [checkpoint]
    interval = 5

    [[faults]]                # on a timeline: at_step / at_time_s / during
    kind = "kill_worker"
    at_step = 8

    [mtbf]                    # or drawn from a seeded exponential schedule
    mean_s = 15.0
    count = 10
    kinds = ["kill_worker", "kill_node"]

`load_scenario(path)` returns a `Scenario`; `parse_scenario(dict)` does the same for a dict.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from relight.chaos.faults import CHECKPOINT_ATTACKS, NODE_LOSSES, FaultKind, Phase
from relight.errors import RelightError

__all__ = [
    "CheckpointSpec",
    "ClusterSpec",
    "FaultSpec",
    "MTBFSpec",
    "Scenario",
    "ScenarioError",
    "StorageSpec",
    "TrainingSpec",
    "VerifySpec",
    "load_scenario",
    "parse_scenario",
]


DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")
"""runtime.train's config for a scenario without a [training] table: the checkout's tiny
model (an absolute path, so the one rule for relative paths does not apply to it)."""


class ScenarioError(RelightError, ValueError):
    """A scenario file is invalid. `key` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str, source: str = "") -> None:
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key or 'scenario'}: {message}")
        self.key = key
        self.message = message
        self.source = source


E = TypeVar("E", bound=StrEnum)


def _fail(key: str, message: str) -> None:
    raise ScenarioError(key, message)


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        _fail(key, message)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """The nodes the runner starts on loopback; each node is one `relight run` agent."""

    nodes: int = 2
    """Nodes at start."""
    ranks_per_node: int = 1
    """Worker processes per node (`--nproc-per-node`)."""
    min_nodes: int = 1
    """The job keeps running while at least this many nodes are alive."""
    max_nodes: int = 0
    """Largest size the job may grow to (scale up); 0 means `nodes`."""
    max_restarts: int = 20
    """`--max-restarts` of each agent: worker-group restarts before a node gives up."""
    monitor_interval_s: float = 0.5
    """How often each agent checks its workers (`--monitor-interval`)."""
    rdzv_timeout_s: float = 60.0
    """Rendezvous join timeout handed to the backend (`--rdzv-conf join_timeout=`)."""
    last_call_s: float = 30.0
    """Rendezvous last-call window of the first round, after min nodes joined. The runner
    starts every node at once and a full group starts the moment its last node joins, so
    this only bounds the wait for a node that never comes up. Generous on purpose: on a
    loaded machine an agent can take several seconds to reach etcd, and a short window
    starts the job smaller than the scenario says."""
    lease_ttl_s: float = 0.0
    """relight-etcd: seconds after which a silent (dead) node's lease expires and the
    survivors stop waiting for it (`--rdzv-conf lease_ttl=`); 0 keeps the backend's default."""
    rejoin_timeout_s: float = 0.0
    """relight-etcd: how long a new round waits for live members of the previous round
    (`--rdzv-conf rejoin_timeout=`); 0 keeps the backend's default."""
    launcher: str = "relight"
    """`relight` (each node runs `relight run`, i.e. `elastic.launch.main`) or `torchrun`
    (plain `python -m torch.distributed.run`, same options)."""
    rendezvous: str = "relight-etcd"
    """`relight-etcd` (nodes run `relight run` against the harness's etcd) or `c10d`
    (plain torchrun with its c10d rendezvous: the baseline Relight is compared with)."""
    c10d_store: str = "agent"
    """c10d: where its rendezvous store lives. `agent`, torchrun's default: the first
    agent on the endpoint's host serves it, and a fault that kills that node ends the
    job (every agent loses the store). `standalone`: a process of the harness serves it,
    as a head node that faults never hit would, and agents only connect (`is_host=false`)."""
    node_memory: str = "shared"
    """`shared`: the simulated nodes share the host's memory (one local checkpoint tier).
    `per_node`: each node gets its own tier (`RELIGHT_LOCAL_TIER_NODE=node-<i>`), and a
    node removed or killed loses it, as a machine that goes away loses its memory (the
    runner deletes its tier directory once the node's processes are gone)."""
    replica_groups: bool = False
    """Each node is a replica group of its own (`replica.job` on): its own `relight run`
    and rendezvous id, `ranks_per_node` ranks inside; the groups train together through
    a quorum in etcd, survivors keep training through a lost group, and a group that
    (re)joins heals from a live one. The first quorum waits for all `nodes` groups
    (`replica.min_groups`); then the job trains on while `min_nodes` groups live."""
    etcd_members: int = 1
    """etcd members the harness runs (1, or an odd number: 3 survive the loss of any
    one). With more than one, `etcd_restart` kills and restarts the leader."""

    def __post_init__(self) -> None:
        _check(self.nodes >= 1, "cluster.nodes", f"must be >= 1, got {self.nodes}")
        _check(self.ranks_per_node >= 1, "cluster.ranks_per_node", "must be >= 1")
        _check(
            1 <= self.min_nodes <= self.nodes,
            "cluster.min_nodes",
            f"must be in [1, nodes={self.nodes}], got {self.min_nodes}",
        )
        if self.max_nodes == 0:
            object.__setattr__(self, "max_nodes", self.nodes)
        _check(
            self.max_nodes >= self.nodes,
            "cluster.max_nodes",
            f"must be >= nodes={self.nodes}, got {self.max_nodes}",
        )
        _check(self.max_restarts >= 0, "cluster.max_restarts", "must be >= 0")
        _check(self.monitor_interval_s > 0, "cluster.monitor_interval_s", "must be > 0")
        _check(self.rdzv_timeout_s > 0, "cluster.rdzv_timeout_s", "must be > 0")
        _check(self.last_call_s >= 0, "cluster.last_call_s", "must be >= 0")
        _check(self.lease_ttl_s == 0 or self.lease_ttl_s >= 1, "cluster.lease_ttl_s",
               f"must be 0 (default) or >= 1 s (etcd's granularity), got {self.lease_ttl_s}")
        _check(self.rejoin_timeout_s >= 0, "cluster.rejoin_timeout_s", "must be >= 0")
        _check(self.launcher in ("relight", "torchrun"), "cluster.launcher",
               f"must be relight or torchrun, got {self.launcher!r}")
        _check(self.rendezvous in ("relight-etcd", "c10d"), "cluster.rendezvous",
               f"must be relight-etcd or c10d, got {self.rendezvous!r}")
        _check(self.c10d_store in ("agent", "standalone"), "cluster.c10d_store",
               f"must be agent or standalone, got {self.c10d_store!r}")
        _check(self.c10d_store == "agent" or self.rendezvous == "c10d", "cluster.c10d_store",
               "standalone is for cluster.rendezvous = 'c10d'")
        _check(self.node_memory in ("shared", "per_node"), "cluster.node_memory",
               f"must be shared or per_node, got {self.node_memory!r}")
        _check(self.etcd_members >= 1 and self.etcd_members % 2 == 1, "cluster.etcd_members",
               f"must be 1 or an odd number of members, got {self.etcd_members}")
        _check(not self.replica_groups or (self.launcher, self.rendezvous)
               == ("relight", "relight-etcd"), "cluster.replica_groups",
               "replica groups run under `relight run` with the relight-etcd rendezvous")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSpec:
    """What every node runs. With `command` empty, `python -m relight.runtime.train` is used and the
    harness passes the config, target step, checkpoint URL, interval and metrics path as
    `--key=value` overrides. A user's own `command` gets the same values as environment
    variables (`RELIGHT_CKPT_URL`, `RELIGHT_METRICS_PATH`, `RELIGHT_TARGET_STEP`,
    `RELIGHT_CKPT_INTERVAL`) and as `{ckpt_url}`, `{metrics}`, `{target_step}`,
    `{interval}`, `{config}`, `{python}`, `{scenario_dir}` placeholders in its arguments
    (docs/chaos.md, "The contract for your own training script").

    Relative paths the harness opens (`config`, a `command` that starts with a `.py`
    script) are resolved against the scenario file's folder, and only there (a scenario
    built in code, with no file: the current directory). The training processes run in
    the directory the harness was started in, so the script's own relative paths mean
    what they mean there."""

    config: str = ""
    """Training config TOML (relative to the scenario file's folder)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """`section.key = value` overrides, appended to the command as `--section.key=value`
    (strings JSON-quoted): runtime.train reads them, a user's script must accept them."""
    command: tuple[str, ...] = ()
    """A user's own training command (argv); empty means runtime.train. A first element
    ending in `.py` is a script (relative to the scenario file's folder) run with the
    harness's Python."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the training processes."""

    def __post_init__(self) -> None:
        _check(isinstance(self.overrides, dict), "training.overrides", "must be a table")
        for k, v in self.overrides.items():
            _check(
                isinstance(v, str | int | float | bool),
                f"training.overrides.{k}",
                f"must be a string, number or boolean, got {type(v).__name__}",
            )
        _check(
            all(isinstance(a, str) for a in self.command),
            "training.command",
            "must be a list of strings",
        )
        _check(
            bool(self.command) or bool(self.config),
            "training.config",
            "is required when training.command is not given (runtime.train needs a config)",
        )
        for k, v in self.env.items():
            _check(isinstance(v, str), f"training.env.{k}", "must be a string")


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageSpec:
    """Where checkpoints go: a local dir under the run dir, or the real S3 server."""

    kind: str = "local"
    """`local` or `s3` (a SeaweedFS server the runner starts on loopback)."""

    def __post_init__(self) -> None:
        _check(self.kind in ("local", "s3"), "storage.kind", f"must be local or s3, got "
               f"{self.kind!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSpec:
    interval: int = 5
    """Save every N steps (`checkpoint.every`)."""
    keep_last: int = 0
    """Committed checkpoints to keep; 0 leaves the training config's value."""

    def __post_init__(self) -> None:
        _check(self.interval >= 1, "checkpoint.interval", f"must be >= 1, got {self.interval}")
        _check(self.keep_last >= 0, "checkpoint.keep_last", "must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifySpec:
    """Tolerances of the invariants; each is written into the report next to its result."""

    reference: bool = True
    """Run the uninterrupted reference run (invariants 2 and 5 need it)."""
    loss_rtol: float = 1e-3
    """Relative tolerance of per-step loss after a layout change (same layout: exact)."""
    weights_rtol: float = 1e-3
    """Relative tolerance of final weights/optimizer state after a layout change."""
    weights_atol: float = 1e-5
    """Absolute tolerance of final weights/optimizer state after a layout change."""
    compare_weights: bool = True
    """Compare the final checkpoint with the reference's (invariant 2)."""
    max_restore_persistent_bytes: int = -1
    """With checkpoint tiers on: the most checkpoint data bytes any restore may read from
    the persistent store, summed over its ranks (the runtime's `restore_tier_bytes`,
    from the storage layer's counters); 0 proves every restore came from memory. -1: not
    checked."""

    def __post_init__(self) -> None:
        for name in ("loss_rtol", "weights_rtol", "weights_atol"):
            _check(getattr(self, name) >= 0, f"verify.{name}", "must be >= 0")
        _check(self.max_restore_persistent_bytes >= -1, "verify.max_restore_persistent_bytes",
               "must be -1 (not checked) or >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """One fault on the timeline. Exactly one trigger: `at_step`, `at_time_s` or `during`."""

    kind: FaultKind
    at_step: int | None = None
    """Fire once the run has logged this step."""
    at_time_s: float | None = None
    """Fire this many seconds after the first logged step."""
    during: Phase | None = None
    """Fire during a phase: `persist`, `before_commit`, `restore` or `training` (a
    string is taken as the `Phase` it spells)."""
    after_step: int = 0
    """With `during`: only once the run has passed this step."""
    after_recovery: bool = False
    """With `at_step`: also wait until every earlier fault has been recovered from (the
    hit group trains again: restarted, or, with replica groups, healed and back in the
    quorum), so the fault meets the state the scenario means whatever the machine's
    speed."""
    steps_after_recovery: int = 0
    """With `after_recovery`: also wait until the run has logged this many steps since the
    last recovery ended, so the healed group trains beside the others for that long
    before the fault (whatever step the recovery ended at)."""
    node: int | None = None
    """Victim node index (in start order); None draws one from the seed."""
    local_rank: int | None = None
    """Victim worker's local rank; None draws one from the seed."""
    resume_after_s: float | None = None
    """stop_worker: send SIGCONT after this many seconds (None: never, a hang)."""
    replace_after_s: float | None = None
    """kill_node/preempt: start a replacement node after this many seconds (None: never)."""
    down_s: float = 2.0
    """etcd_restart: seconds etcd stays down."""
    duration_s: float = 10.0
    """storage_transient/storage_latency: seconds the storage fault lasts."""
    fail_fraction: float = 0.3
    """storage_transient: fraction of storage operations that fail."""
    fail_times: int = 1
    """storage_transient: consecutive failures of one operation (> retry budget to outlast
    retries)."""
    latency_s: float = 0.5
    """storage_latency: seconds added to each storage operation."""
    ops: tuple[str, ...] = ()
    """storage_*: operations affected (empty: all)."""
    key_contains: str = ""
    """storage_*: only keys containing this (empty: all)."""
    kill_after: bool = False
    """corrupt/truncate_checkpoint: SIGKILL a worker right after the damage, so the next
    restore meets the damaged checkpoint as the newest one and must fall back."""
    window_s: float = 2.0
    """during = persist/before_commit: while the fault waits, the harness delays each rank's
    index write (persist) or the coordinator's manifest write (before_commit) by this
    much through the fault-injecting store, so the phase lasts long enough to hit."""

    def __post_init__(self) -> None:
        if self.during is not None:
            object.__setattr__(self, "during", _phase(self.during, "during"))

    def validate(self, key: str) -> None:
        triggers = [
            n for n in ("at_step", "at_time_s", "during") if getattr(self, n) is not None
        ]
        _check(
            len(triggers) == 1,
            key,
            f"needs exactly one trigger of at_step, at_time_s, during; got {triggers or 'none'}",
        )
        if self.at_step is not None:
            _check(self.at_step >= 0, f"{key}.at_step", "must be >= 0")
        _check(not self.after_recovery or self.at_step is not None, f"{key}.after_recovery",
               "goes with at_step")
        _check(self.steps_after_recovery >= 0, f"{key}.steps_after_recovery", "must be >= 0")
        _check(not self.steps_after_recovery or self.after_recovery,
               f"{key}.steps_after_recovery", "goes with after_recovery = true")
        if self.at_time_s is not None:
            _check(self.at_time_s >= 0, f"{key}.at_time_s", "must be >= 0")
        _check(self.down_s >= 0, f"{key}.down_s", "must be >= 0")
        _check(self.duration_s > 0, f"{key}.duration_s", "must be > 0")
        _check(0 <= self.fail_fraction <= 1, f"{key}.fail_fraction", "must be in [0, 1]")
        _check(self.fail_times >= 1, f"{key}.fail_times", "must be >= 1")
        _check(self.latency_s >= 0, f"{key}.latency_s", "must be >= 0")
        _check(self.window_s >= 0, f"{key}.window_s", "must be >= 0")
        for name in ("resume_after_s", "replace_after_s"):
            v = getattr(self, name)
            _check(v is None or v >= 0, f"{key}.{name}", "must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["kind"] = self.kind.value
        out["during"] = self.during.value if self.during is not None else None
        out["ops"] = list(self.ops)
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class MTBFSpec:
    """Faults drawn from a seeded exponential schedule (mean time between failures)."""

    mean_s: float = 20.0
    """Mean seconds between faults."""
    count: int = 0
    """How many faults to draw."""
    kinds: tuple[FaultKind, ...] = ()
    """Kinds drawn uniformly (each at least once when count allows)."""
    start_s: float = 5.0
    """First fault no earlier than this many seconds after the first step."""
    replace_after_s: float = 10.0
    """Node losses drawn here (kill_node, preempt) get a replacement node after this long,
    as a fleet's autoscaler would; scale_down does not (scale_up adds one back)."""
    resume_after_s: float | None = None
    """stop_worker drawn here: SIGCONT after this long (None: a hang until restarted)."""

    def __post_init__(self) -> None:
        _check(self.mean_s > 0, "mtbf.mean_s", "must be > 0")
        _check(self.count >= 0, "mtbf.count", "must be >= 0")
        _check(self.start_s >= 0, "mtbf.start_s", "must be >= 0")
        _check(bool(self.kinds) or self.count == 0, "mtbf.kinds", "must name at least one kind")
        _check(self.replace_after_s >= 0, "mtbf.replace_after_s", "must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    description: str = ""
    seed: int = 0
    """Seed of every random choice; `--seed` overrides it."""
    target_step: int = 20
    """The step the run must reach (`train.steps`)."""
    deadline_s: float = 300.0
    """Global wall-clock bound on the chaos run; everything is torn down after it."""
    reference_deadline_s: float = 0.0
    """Bound on the reference run; 0 means `deadline_s`."""
    run_for_s: float = 0.0
    """Stop the chaos run this long after its first step, whatever step it reached (a
    benchmark's window: `relight bench goodput`); 0 runs it to `target_step`."""
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    training: TrainingSpec = field(default_factory=lambda: TrainingSpec(config=DEFAULT_CONFIG))
    storage: StorageSpec = field(default_factory=StorageSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    verify: VerifySpec = field(default_factory=VerifySpec)
    faults: tuple[FaultSpec, ...] = ()
    mtbf: MTBFSpec = field(default_factory=MTBFSpec)
    source: str = ""
    """The file it was loaded from (for messages and relative paths)."""

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", "must be a non-empty string")
        _check(self.target_step >= 1, "target_step", "must be >= 1")
        _check(self.deadline_s > 0, "deadline_s", "must be > 0")
        _check(self.run_for_s >= 0, "run_for_s", "must be >= 0 (0: run to target_step)")
        for i, f in enumerate(self.faults):
            f.validate(f"faults[{i}]")
            if f.kind in NODE_LOSSES and f.node is not None:
                _check(
                    0 <= f.node < self.cluster.max_nodes,
                    f"faults[{i}].node",
                    f"must be in [0, max_nodes={self.cluster.max_nodes})",
                )
            if f.local_rank is not None:
                _check(
                    0 <= f.local_rank < self.cluster.ranks_per_node,
                    f"faults[{i}].local_rank",
                    f"must be in [0, ranks_per_node={self.cluster.ranks_per_node})",
                )
            if f.at_step is not None:
                _check(
                    f.at_step < self.target_step,
                    f"faults[{i}].at_step",
                    f"must be < target_step={self.target_step} or it never fires",
                )
            if f.kind in CHECKPOINT_ATTACKS and f.during is None and f.kind in (
                FaultKind.KILL_DURING_PERSIST,
                FaultKind.KILL_COORDINATOR_BEFORE_COMMIT,
            ):
                phase = (Phase.PERSIST if f.kind is FaultKind.KILL_DURING_PERSIST
                         else Phase.BEFORE_COMMIT)
                _fail(f"faults[{i}].during", f"{f.kind.value} needs during = {phase.value!r}")
        if self.cluster.rendezvous == "c10d":
            kinds = {f.kind for f in self.faults} | set(self.mtbf.kinds)
            _check(FaultKind.ETCD_RESTART not in kinds, "faults",
                   "etcd_restart needs cluster.rendezvous = 'relight-etcd' (c10d has no etcd)")
        losses = sum(
            1 for f in self.faults if f.kind in NODE_LOSSES and f.replace_after_s is None
        )
        gains = sum(1 for f in self.faults if f.kind is FaultKind.SCALE_UP)
        _check(
            self.cluster.nodes - losses + gains >= self.cluster.min_nodes,
            "faults",
            f"remove {losses} node(s) for good from {self.cluster.nodes} (adding {gains}), "
            f"leaving fewer than min_nodes={self.cluster.min_nodes}; the job could not continue",
        )

    @property
    def base_dir(self) -> Path:
        return Path(self.source).resolve().parent if self.source else Path.cwd()

    def with_seed(self, seed: int) -> Scenario:
        return dataclasses.replace(self, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        def plain(obj: Any) -> Any:
            if isinstance(obj, FaultKind):
                return obj.value
            if dataclasses.is_dataclass(obj):
                return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            if isinstance(obj, tuple | list):
                return [plain(x) for x in obj]
            if isinstance(obj, dict):
                return {k: plain(v) for k, v in obj.items()}
            return obj

        return plain(self)


# Parsing ----------------------------------------------------------------------------------

_TYPES: dict[type, dict[str, Any]] = {}


def _typed(cls: type, raw: Any, key: str) -> dict[str, Any]:
    """Check `raw` is a table whose keys are fields of `cls` with values of the right type."""
    if not isinstance(raw, dict):
        _fail(key, f"must be a table, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    out: dict[str, Any] = {}
    for name, value in raw.items():
        full = f"{key}.{name}" if key else name
        if name not in fields:
            _fail(full, f"unknown key; known keys: {sorted(fields)}")
        out[name] = _coerce(str(fields[name].type), value, full)
    return out


def _coerce(type_name: str, value: Any, key: str) -> Any:
    t = type_name.replace(" ", "")
    if t.endswith("|None"):
        return None if value is None else _coerce(t[: -len("|None")], value, key)
    if t == "int":
        _check(isinstance(value, int) and not isinstance(value, bool), key,
               f"must be an integer, got {value!r}")
        return value
    if t == "float":
        _check(isinstance(value, int | float) and not isinstance(value, bool), key,
               f"must be a number, got {value!r}")
        return float(value)
    if t == "bool":
        _check(isinstance(value, bool), key, f"must be true or false, got {value!r}")
        return value
    if t == "str":
        _check(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    if t == "FaultKind":
        return _kind(value, key)
    if t == "Phase":
        return _phase(value, key)
    if t.startswith("tuple[FaultKind"):
        _check(isinstance(value, list), key, "must be a list of fault kinds")
        return tuple(_kind(v, f"{key}[{i}]") for i, v in enumerate(value))
    if t.startswith("tuple[str"):
        _check(isinstance(value, list) and all(isinstance(v, str) for v in value), key,
               "must be a list of strings")
        return tuple(value)
    if t.startswith("dict["):
        _check(isinstance(value, dict), key, "must be a table")
        return dict(value)
    return value


def _member(kind: type[E], value: Any, key: str, what: str) -> E:
    try:
        return kind(value)
    except ValueError:
        raise ScenarioError(
            key, f"unknown {what} {value!r}; known: {[m.value for m in kind]}"
        ) from None


def _kind(value: Any, key: str) -> FaultKind:
    return _member(FaultKind, value, key, "fault kind")


def _phase(value: Any, key: str) -> Phase:
    return _member(Phase, value, key, "phase")


def parse_scenario(raw: dict[str, Any], source: str = "") -> Scenario:
    """Build and validate a `Scenario` from parsed TOML. Raises `ScenarioError`."""
    try:
        top = dict(raw)
        sections = {
            "cluster": ClusterSpec,
            "training": TrainingSpec,
            "storage": StorageSpec,
            "checkpoint": CheckpointSpec,
            "verify": VerifySpec,
            "mtbf": MTBFSpec,
        }
        kwargs: dict[str, Any] = {}
        for name, cls in sections.items():
            if name in top:
                kwargs[name] = cls(**_typed(cls, top.pop(name), name))
        if "faults" in top:
            faults = top.pop("faults")
            _check(isinstance(faults, list), "faults", "must be an array of tables [[faults]]")
            specs = []
            for i, f in enumerate(faults):
                fields = _typed(FaultSpec, f, f"faults[{i}]")
                _check("kind" in fields, f"faults[{i}].kind", "is required")
                specs.append(FaultSpec(**fields))
            kwargs["faults"] = tuple(specs)
        scalars = {
            k: v for k, v in _typed(Scenario, top, "").items()
            if k not in sections and k != "faults"
        }
        return Scenario(**scalars, **kwargs, source=source)
    except ScenarioError as exc:
        if source and not exc.source:
            raise ScenarioError(exc.key, exc.message, source) from None
        raise
    except TypeError as exc:  # a missing required field of a dataclass
        raise ScenarioError("", f"{exc}", source) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario TOML file."""
    p = Path(path)
    if not p.is_file():
        raise ScenarioError("", f"no scenario file at {p}: pass a path such as "
                            "scenarios/ci-smoke.toml", str(p))
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError("", f"not valid TOML: {exc}", str(p)) from None
    return parse_scenario(raw, source=str(p))
