"""Run configuration: nested dataclasses, loaded from TOML, overridden from the command line.

A config is built once at start, validated in ``__post_init__`` (so a bad value fails before
any process group exists), and serialised to JSON with :func:`config_to_dict` so the resolved
config can be saved with every checkpoint.

Overrides use ``--section.key=value`` (or ``--key=value`` when ``key`` names exactly one field
across all sections). Values are parsed as TOML scalars, so ``--train.steps=20``,
``--parallel.pp_schedule=gpipe`` and ``--checkpoint.url="memory://x"`` all work.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from relight.errors import RelightError

__all__ = [
    "BusyPolicy",
    "CheckpointConfig",
    "Config",
    "ConfigChoiceError",
    "ConfigError",
    "DataConfig",
    "DeviceKind",
    "MixedPrecision",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineSchedule",
    "PreemptionConfig",
    "ReplicaConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "parse_value",
]


class ConfigError(RelightError, ValueError):
    """A config value is invalid; the message names the field and what to change."""


class ConfigChoiceError(ConfigError):
    """A field that takes one of a fixed set of values got another one."""

    def __init__(self, name: str, value: object, allowed: list[str]) -> None:
        quoted = [repr(a) for a in allowed]
        choices = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        super().__init__(f"{name} must be {choices}, got {value!r}")
        self.name = name
        """The dotted field name, e.g. ``parallel.pp_schedule``."""
        self.value = value
        """The value given."""
        self.allowed = allowed
        """The values the field takes."""


class PipelineSchedule(StrEnum):
    """``parallel.pp_schedule``: the torch.distributed.pipelining schedule."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class DeviceKind(StrEnum):
    """``train.device``: where ranks compute (``runtime.device.resolve_device``)."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class MixedPrecision(StrEnum):
    """``train.mixed_precision``: the parameter and compute dtype."""

    FP32 = "fp32"
    BF16 = "bf16"


class BusyPolicy(StrEnum):
    """``checkpoint.busy``: what a save does while the previous one still persists."""

    WAIT = "wait"
    SKIP = "skip"


_CHOICES: dict[str, type[StrEnum]] = {
    t.__name__: t for t in (PipelineSchedule, DeviceKind, MixedPrecision, BusyPolicy)
}
"""The choice types config fields use, by the annotation's name (annotations are strings)."""

E = TypeVar("E", bound=StrEnum)


def parse_choice(kind: type[E], value: object, name: str) -> E:
    """`value` as a member of `kind`; raises `ConfigChoiceError` naming `name`, the value
    and the allowed ones when it is none of them."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigChoiceError(name, value, [m.value for m in kind]) from None


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "llama"
    """Registered model to train (`runtime.models`): ``llama`` (the runtime's dense
    transformer) or ``moe`` (the same with ``num_experts`` routed experts); ignored when
    ``factory`` is set."""
    factory: str = ""
    """A user's own model, ``package.module:function``: the function takes this
    ModelConfig and returns a ``torch.nn.Module`` mapping token ids ``[batch, seq]`` to
    logits ``[batch, seq, vocab]`` (or an output with ``.logits``, as Hugging Face causal
    LMs return). Trained under DP/FSDP/HSDP; TP when the module defines
    ``relight_tp_plan()``. Empty: use ``name``."""
    vocab_size: int = 64
    """Number of token ids; must be at least the dataset's vocabulary."""
    dim: int = 64
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of transformer blocks; pipeline stages split these."""
    n_heads: int = 4
    """Attention heads; must divide ``dim`` and be divisible by ``parallel.tp``."""
    mlp_hidden: int = 128
    """Hidden width of the dense MLP and of each expert (SwiGLU)."""
    max_seq_len: int = 64
    """Longest sequence the rotary embedding is precomputed for."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    num_experts: int = 0
    """Experts per MoE layer; 0 means a dense model."""
    moe_every: int = 2
    """With experts, every ``moe_every``-th block (1-based: blocks moe_every-1, 2*moe_every-1..)
    uses an MoE MLP; 1 makes every block MoE."""
    top_k: int = 2
    """Experts each token is routed to."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balance loss (Switch-style: E * sum_e f_e * P_e)."""
    init_std: float = 0.02
    """Std of the normal init for weights (output projections scaled by 1/sqrt(2*n_layers))."""

    def __post_init__(self) -> None:
        _require(bool(self.name.strip()), "model.name must not be empty (e.g. llama, moe)")
        if self.factory:
            mod, _, fn = self.factory.partition(":")
            _require(bool(mod) and bool(fn) and all(p.isidentifier() for p in mod.split("."))
                     and fn.isidentifier(),
                     f"model.factory={self.factory!r} must look like package.module:function")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "mlp_hidden", "max_seq_len"):
            value = getattr(self, name)
            _require(value > 0, f"model.{name} must be > 0, got {value}")
        _require(
            self.dim % self.n_heads == 0,
            f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}",
        )
        _require((self.dim // self.n_heads) % 2 == 0, "model.dim/n_heads must be even (rotary)")
        _require(self.num_experts >= 0, f"model.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            _require(
                1 <= self.top_k <= self.num_experts,
                f"model.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]",
            )
            _require(self.moe_every >= 1, f"model.moe_every must be >= 1, got {self.moe_every}")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    dp_replicate: int = 1
    """Replicated data-parallel degree (gradient all-reduce across replicas)."""
    dp_shard: int = -1
    """Sharded data-parallel (FSDP) degree; -1 fills what the world size leaves."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages, one per rank)."""
    ep: int = 1
    """Expert-parallel degree; borrowed from the data-parallel ranks (must divide dp_shard,
    or dp_replicate when dp_shard is 1)."""
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """Pipeline schedule: ``gpipe`` or ``1f1b``."""
    sequence_parallel: bool = False
    """Shard norms and residual activations over the sequence dim inside the TP group."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "ep"):
            _require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1")
        _require(
            self.dp_shard == -1 or self.dp_shard >= 1,
            f"parallel.dp_shard must be -1 (auto) or >= 1, got {self.dp_shard}",
        )
        self.pp_schedule = parse_choice(PipelineSchedule, self.pp_schedule,
                                        "parallel.pp_schedule")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decays to ``lr * min_lr_ratio`` at ``train.steps``."""
    warmup_steps: int = 5
    """Linear warmup steps."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global gradient L2 norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio must be in [0, 1]")
        _require(self.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
        _require(self.grad_clip >= 0, "optim.grad_clip must be >= 0")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = "synthetic"
    """``synthetic`` (the Markov-chain corpus of `runtime.data`) or ``tokens:DIR``, a token
    dataset written by ``relight data prepare`` (docs/data.md)."""
    seed: int = 1234
    """Seed of the sample order (and, for ``synthetic``, of the Markov chain)."""
    seq_len: int = 32
    """Tokens per training sample (inputs; targets are shifted by one)."""
    global_batch_size: int = 16
    """Samples per optimizer step, constant whatever the DP size."""
    micro_batch_size: int = 4
    """Samples per forward/backward (and per pipeline micro-batch)."""
    branching: int = 4
    """Successors each token can have in the Markov chain (lower = more learnable)."""
    eval_every: int = 0
    """Compute the loss on held-out samples every N steps (and at the last step); 0: never."""
    eval_samples: int = 64
    """Held-out samples per evaluation (the first ones of the held-out split)."""
    eval_fraction: float = 0.02
    """Share of a token dataset's windows held out for evaluation (fixed per dataset,
    whatever ``seed`` is)."""
    verify_checksums: bool = True
    """Check every shard's crc32c when a token dataset is opened."""

    @property
    def tokens_dir(self) -> str:
        """The dataset directory of a ``tokens:DIR`` source ('' for synthetic)."""
        return self.source[len("tokens:"):] if self.source.startswith("tokens:") else ""

    def __post_init__(self) -> None:
        _require(self.source == "synthetic" or (self.source.startswith("tokens:")
                                                and bool(self.source[7:].strip())),
                 f"data.source must be 'synthetic' or 'tokens:DIR', got {self.source!r}")
        _require(self.eval_every >= 0, "data.eval_every must be >= 0")
        _require(self.eval_samples >= 1, "data.eval_samples must be >= 1")
        _require(0 <= self.eval_fraction < 1, "data.eval_fraction must be in [0, 1)")
        _require(self.seq_len > 1, "data.seq_len must be > 1")
        _require(self.micro_batch_size >= 1, "data.micro_batch_size must be >= 1")
        _require(
            self.global_batch_size % self.micro_batch_size == 0,
            f"data.global_batch_size={self.global_batch_size} is not a multiple of "
            f"data.micro_batch_size={self.micro_batch_size}",
        )
        _require(self.branching >= 1, "data.branching must be >= 1")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 50
    """Optimizer steps to run (the target step; the LR schedule spans it)."""
    stop_at: int = 0
    """Stop cleanly after this step (checkpointing it) although ``steps`` is further;
    0 runs to ``steps``. For preemption drills and resume tests."""
    seed: int = 0
    """Seed of the model init and of the per-step RNG."""
    device: DeviceKind = DeviceKind.AUTO
    """``auto`` (cuda if available, else cpu), ``cpu`` or ``cuda`` (``cuda:$LOCAL_RANK``,
    NCCL; ``cpu`` uses gloo). See ``runtime.device`` and docs/gpu.md."""
    mixed_precision: MixedPrecision = MixedPrecision.FP32
    """``fp32`` or ``bf16`` (bf16 params/compute, fp32 reductions and master weights)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    log_every: int = 1
    """Progress-line interval on rank 0 (metrics JSONL gets every step)."""
    metrics_path: str = ""
    """JSONL metrics file written by rank 0; empty disables it."""
    watchdog_timeout_s: float = 300.0
    """Exit non-zero when no step completes within this many seconds; 0 disables."""
    collective_timeout_s: float = 120.0
    """Timeout of every collective: the world group's and every mesh group's
    (``runtime.device.bound_mesh_timeouts``; DeviceMesh alone would give its groups
    torch's defaults, 10 min on NCCL and 30 on gloo)."""
    peak_tflops: float = 0.0
    """Peak device TFLOP/s for MFU; 0 looks it up for known GPUs (MFU is null otherwise)."""
    prometheus_port: int = 0
    """Serve Prometheus metrics from rank 0 on ``prometheus_host``:PORT; 0 disables."""
    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds; loopback by default. ``0.0.0.0`` exposes it
    to the network (a Kubernetes scrape): do that only on a trusted network."""
    tensorboard_dir: str = ""
    """Directory for TensorBoard scalars written by rank 0 every step; empty disables."""

    def __post_init__(self) -> None:
        _require(self.steps >= 0, "train.steps must be >= 0")
        _require(self.stop_at >= 0, "train.stop_at must be >= 0")
        self.device = parse_choice(DeviceKind, self.device, "train.device")
        self.mixed_precision = parse_choice(MixedPrecision, self.mixed_precision,
                                            "train.mixed_precision")
        _require(self.log_every >= 1, "train.log_every must be >= 1")
        _require(self.watchdog_timeout_s >= 0, "train.watchdog_timeout_s must be >= 0")
        _require(self.collective_timeout_s > 0, "train.collective_timeout_s must be > 0")
        _require(bool(self.prometheus_host.strip()), "train.prometheus_host must not be empty")
        _require(0 <= self.prometheus_port <= 65535,
                 f"train.prometheus_port must be a port number, got {self.prometheus_port}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    url: str = ""
    """Checkpoint root URL (``/path``, ``file://``, ``s3://``, ``memory://``); empty disables."""
    every: int = 10
    """Save every N steps (and at the last step)."""
    keep_last: int = 3
    """Committed checkpoints to keep."""
    async_save: bool = True
    """Persist in the background; training blocks only for staging."""
    resume: bool = True
    """Restore from the newest committed checkpoint under ``url`` at start."""
    restore_step: int = 0
    """Restore this committed step instead of the newest (e.g. to roll back past a loss
    spike); 0 means the newest one that loads."""
    pipelined_staging: bool = False
    """Async saves return before the copy into the staging buffers is done (CheckFreq-style):
    the copy overlaps the next step's forward and backward, and the optimizer step waits
    for it (`ckpt.guard_optimizer`), so a snapshot is never torn. Off: the copy blocks
    the save call (docs/ckpt.md, "pipelined staging")."""
    busy: BusyPolicy = BusyPolicy.WAIT
    """When a save is due while the previous one is still persisting (storage slower than
    the interval): "wait" for it (training stalls, every checkpoint is taken) or "skip"
    this one (training goes on, the next save point tries again). The last step's save and
    the emergency save on a preemption notice always wait."""
    local_tier_dir: str = ""
    """Keep a node-local copy of the newest committed checkpoint's data objects under
    ``<dir>/<job>/<host>`` (use a tmpfs such as ``/dev/shm/relight``: it survives a worker
    restart, not a reboot) and restore from it when it matches (docs/tiers.md); empty
    disables the tier."""
    local_tier_budget_mb: int = 4096
    """Node memory the local tier may use, split evenly over the node's ranks. Keeping a
    copy through the next save takes twice the node's shard bytes."""
    local_tier_node: str = ""
    """The node's name in the tier's directory and among peers; empty: $RELIGHT_LOCAL_TIER_NODE
    if set (one per simulated node when several share a host), else the host name."""
    peer_replicas: int = 1
    """With the local tier on: copy each node's data objects to this many other nodes'
    tiers too (over HTTP, `ckpt.peer`), so a lost node's shards are read from a peer;
    0 disables. Fewer other nodes than this: all of them. A node holds at most
    ``peer_replicas x local_tier_budget_mb`` of other nodes' replicas (pushes beyond it
    are refused and those shards come from the persistent store)."""
    peer_host: str = ""
    """The address this node's replica server binds and other nodes reach it at; empty:
    all interfaces, advertised as the address the host name resolves to, or, when that
    is a loopback address and the job's master is on another host, the address of the
    interface that routes to the master."""

    def __post_init__(self) -> None:
        _require(self.every >= 1, "checkpoint.every must be >= 1")
        _require(self.local_tier_budget_mb >= 0, "checkpoint.local_tier_budget_mb must be >= 0")
        _require(self.peer_replicas >= 0, "checkpoint.peer_replicas must be >= 0")
        _require(self.keep_last >= 1, "checkpoint.keep_last must be >= 1")
        _require(self.restore_step >= 0, "checkpoint.restore_step must be >= 0")
        self.busy = parse_choice(BusyPolicy, self.busy, "checkpoint.busy")


@dataclass(kw_only=True, slots=True)
class PreemptionConfig:
    """Preemption notices and the emergency checkpoint (see docs/preemption.md)."""

    enabled: bool = True
    """Turn notices into an emergency checkpoint and exit status 76; false restores the
    default signal behaviour (SIGTERM kills the process at once)."""
    signals: str = "SIGTERM"
    """Comma-separated signals that count as a notice (torchrun forwards SIGTERM from the
    agent to every local worker); empty: none."""
    notice_file: str = ""
    """A notice is a file appearing at this path (checked once per step); empty: off."""
    metadata: str = ""
    """Cloud metadata poller: ``aws`` (spot ``instance-action``), ``gcp`` (``preempted``)
    or empty (off, the default: nothing is ever requested)."""
    metadata_url: str = ""
    """Base URL of the metadata service, e.g. ``http://169.254.169.254`` (AWS) or
    ``http://metadata.google.internal`` (GCP); required when ``metadata`` is set."""
    poll_interval_s: float = 5.0
    """Seconds between metadata requests."""
    request_timeout_s: float = 1.0
    """Timeout of one metadata request."""
    grace_s: float = 30.0
    """Seconds between a notice and the hard kill, when the notice does not say (AWS's
    instance-action gives its own time; torchrun's default shutdown timeout is 30 s)."""
    save_margin_s: float = 1.0
    """Seconds kept free at the end of the grace period (exit, log flush)."""
    safety_factor: float = 1.5
    """The emergency save is attempted only if safety_factor * estimated time + margin fits
    in the remaining grace."""
    assumed_write_mb_s: float = 100.0
    """Write rate (MB/s per rank) assumed before this run has timed a save of its own."""
    step_timeout_s: float = 0.0
    """After a notice, the step in flight must end within this many seconds, or the process
    is taken as hung and exits (status 143); 0: 3x the slowest step seen, at least 10 s."""

    def __post_init__(self) -> None:
        _require(self.metadata in ("", "aws", "gcp"),
                 f"preemption.metadata must be '', 'aws' or 'gcp', got {self.metadata!r}")
        _require(not self.metadata or bool(self.metadata_url),
                 "preemption.metadata_url must be set when preemption.metadata is "
                 f"{self.metadata!r} (e.g. http://169.254.169.254)")
        _require(not self.metadata_url or self.metadata_url.startswith(("http://", "https://")),
                 f"preemption.metadata_url must be an http(s) URL, got {self.metadata_url!r}")
        for name in ("poll_interval_s", "request_timeout_s", "grace_s", "safety_factor",
                     "assumed_write_mb_s"):
            _require(getattr(self, name) > 0, f"preemption.{name} must be > 0")
        for name in ("save_margin_s", "step_timeout_s"):
            _require(getattr(self, name) >= 0, f"preemption.{name} must be >= 0")
        for name in filter(None, (s.strip() for s in self.signals.split(","))):
            _require(isinstance(getattr(signal, name, None), signal.Signals),
                     f"preemption.signals: unknown signal {name!r} (e.g. SIGTERM,SIGUSR1)")


@dataclass(kw_only=True, slots=True)
class ReplicaConfig:
    """Replica groups that heal in place (see docs/healing.md): each group is a torchrun
    job of its own (its own `relight run`, its own rendezvous id); the groups agree on a
    quorum per step in etcd and sum their gradients across groups. Off unless ``job``
    is set."""

    job: str = ""
    """Job id shared by every group (etcd keys under ``{prefix}/{job}/replicas/``);
    empty: replica groups off."""
    group: str = ""
    """This group's id, unique in the job; empty: ``$RELIGHT_REPLICA_GROUP``, else the
    group's torchrun rendezvous id (``$TORCHELASTIC_RUN_ID``)."""
    etcd: str = "127.0.0.1:2379"
    """Comma-separated etcd endpoints (every member of the cluster)."""
    prefix: str = "/relight"
    """etcd key prefix."""
    min_groups: int = 1
    """Groups that must be ready before the first step (the job's start)."""
    host: str = ""
    """Address the other groups reach this rank's store and cross-group sockets on;
    empty: this machine's host name."""
    lease_ttl_s: float = 10.0
    """A group silent for this long is out of the quorum."""
    collective_timeout_s: float = 10.0
    """Bound on every cross-group collective: a dead peer fails the step within it."""
    failover_grace_s: float = 1.0
    """After a failed step, how long survivors wait for the vote of a silent member that
    may be alive before re-forming without it (a member whose process is gone is not
    waited for)."""
    quorum_timeout_s: float = 300.0
    """Longest wait for a quorum or a commit decision (a fault, not a slow step)."""
    digest_every: int = 0
    """Every this many steps each rank's crc32c of its parameter shards goes into the
    metrics record (``state_crc``), so replicas can be compared step by step (the chaos
    verifier does); 0: off (it reads every parameter byte)."""

    def __post_init__(self) -> None:
        _require("/" not in self.job and "/" not in self.group,
                 f"replica.job and replica.group must not contain '/', got "
                 f"{self.job!r}, {self.group!r}")
        _require(self.min_groups >= 1, "replica.min_groups must be >= 1")
        _require(self.digest_every >= 0, "replica.digest_every must be >= 0")
        for name in ("lease_ttl_s", "collective_timeout_s", "failover_grace_s",
                     "quorum_timeout_s"):
            _require(getattr(self, name) > 0, f"replica.{name} must be > 0")

    @property
    def enabled(self) -> bool:
        return bool(self.job)


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)

    def __post_init__(self) -> None:
        _require(
            self.data.seq_len <= self.model.max_seq_len,
            f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )
        _require(
            self.model.n_heads % self.parallel.tp == 0,
            f"model.n_heads={self.model.n_heads} is not divisible by parallel.tp="
            f"{self.parallel.tp}; pick tp dividing the head count",
        )
        _require(not (self.replica.enabled and self.parallel.dp_replicate > 1),
                 "replica.job replaces parallel.dp_replicate: the replica groups are the "
                 "replicated dimension; set parallel.dp_replicate=1")
        if self.checkpoint.url:
            # A bad URL is a config error (exit 2), not a fault to restart the group over.
            from relight.storage import InvalidStorageURLError, parse_url

            try:
                parse_url(self.checkpoint.url)
            except InvalidStorageURLError as e:
                raise ConfigError(f"checkpoint.url: {e}") from None


def _section_types() -> dict[str, type]:
    return {
        "model": ModelConfig,
        "parallel": ParallelConfig,
        "optim": OptimConfig,
        "data": DataConfig,
        "train": TrainConfig,
        "checkpoint": CheckpointConfig,
        "preemption": PreemptionConfig,
        "replica": ReplicaConfig,
    }


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The resolved config as plain JSON-able dicts (one per section); a choice is its
    string."""
    def plain(value: Any) -> Any:
        return value.value if isinstance(value, StrEnum) else value

    return {
        f.name: {g.name: plain(getattr(getattr(cfg, f.name), g.name)) for g in
                 dataclasses.fields(getattr(cfg, f.name))}
        for f in dataclasses.fields(cfg)
    }


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from nested dicts; unknown sections/keys raise ConfigError."""
    types = _section_types()
    sections: dict[str, Any] = {}
    for name, values in raw.items():
        if name not in types:
            raise ConfigError(f"unknown config section [{name}]; known: {sorted(types)}")
        if not isinstance(values, dict):
            raise ConfigError(f"config section [{name}] must be a table")
        known = {f.name: f for f in dataclasses.fields(types[name])}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"unknown config key {name}.{key}; known: {sorted(known)}")
            _check_type(f"{name}.{key}", known[key], value)
        sections[name] = types[name](**values)
    return Config(**sections)


def _check_type(path: str, f: dataclasses.Field, value: Any) -> None:
    if str(f.type) in _CHOICES:
        return  # the section's __post_init__ names the allowed values (parse_choice)
    want = {"int": int, "float": (int, float), "str": str, "bool": bool}[str(f.type)]
    ok = isinstance(value, want) and not (str(f.type) in ("int", "float") and isinstance(
        value, bool))
    if not ok:
        raise ConfigError(f"{path} must be {f.type}, got {value!r}")


def parse_value(text: str) -> Any:
    """An override's value: a TOML scalar, else the text itself (a bare string)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string such as --parallel.pp_schedule=gpipe


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--section.key=value`` / ``--key=value`` strings to nested config dicts."""
    out = json.loads(json.dumps(raw))
    types = _section_types()
    for item in overrides:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        path, text = item[2:].split("=", 1)
        if "." in path:
            section, key = path.split(".", 1)
        else:
            owners = [s for s, t in types.items() if path in {f.name for f in
                                                               dataclasses.fields(t)}]
            if len(owners) != 1:
                raise ConfigError(
                    f"override --{path} is ambiguous or unknown (sections having it: {owners}); "
                    f"use --section.{path}=..."
                )
            section, key = owners[0], path
        out.setdefault(section, {})[key] = parse_value(text)
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or defaults when ``path`` is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path}: {e}") from None
    return config_from_dict(apply_overrides(raw, overrides or []))
