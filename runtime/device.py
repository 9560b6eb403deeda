"""The device a rank computes on, the process-group backend that goes with it, and how
that process group is brought up and torn down.

One place decides "cpu + gloo" or "cuda:LOCAL_RANK + nccl"; the trainer asks its
:class:`Device` (``synchronize()``, ``autocast()``) instead of branching on
``torch.cuda``. On CPU every call is a no-op or the CPU answer, so the same
training code runs (and is tested) on both.

NCCL failure handling is torch.distributed's own, configured here:

* every collective has a timeout (``init_process_group(timeout=...)``); NCCL's watchdog
  thread checks each collective against it and, on a timeout or a communicator error,
  acts per ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (:data:`NCCL_ENV_DEFAULTS` keeps torch's
  own default, 3: tear the process down, so the agent restarts the group; in-place
  healing sets 2, abort the communicators and let the process rebuild its group);
* ``TORCH_NCCL_ENABLE_MONITORING`` aborts a process whose watchdog itself is stuck for
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``;
* :func:`abort_process_group` aborts a group's communicators without waiting for the
  collectives in flight (a plain ``destroy_process_group`` would wait on them), which is
  what rebuilding a group after a peer died needs.

docs/gpu.md says what a user sets on a GPU cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relight.runtime.config import ConfigError, DeviceKind

__all__ = [
    "NCCL_ENV_DEFAULTS",
    "Device",
    "DeviceError",
    "abort_process_group",
    "apply_nccl_env",
    "bound_mesh_timeouts",
    "init_process_group",
    "resolve_device",
]

log = logging.getLogger(__name__)


class DeviceError(ConfigError):
    """The requested device cannot be used on this machine (says which and why); a
    configuration error (``relight train`` exits with status 2, and is not restarted)."""


NCCL_ENV_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # The watchdog's own heartbeat monitor: a watchdog stuck in a CUDA call (a wedged
    # driver) is itself detected and the process aborted instead of hanging forever.
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    # A flight-recorder ring of the last collectives, dumped on a timeout, so a hang
    # says which collective and which ranks it waited for.
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
"""Set before an NCCL group is created when the environment does not set them already
(a user's or launcher's value always wins). ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` is
torch's own default, stated so that it does not change under a torch upgrade."""


def apply_nccl_env(env: MutableMapping[str, str] | None = None,
                   overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Fill in :data:`NCCL_ENV_DEFAULTS` (then `overrides`) where `env` (default
    ``os.environ``) has no value yet; returns what it set. NCCL reads these when a
    process group is constructed, so call it before ``init_process_group``."""
    env = os.environ if env is None else env
    wanted = dict(NCCL_ENV_DEFAULTS)
    wanted.update(overrides or {})
    set_now = {k: v for k, v in wanted.items() if k not in env}
    env.update(set_now)
    return set_now


@dataclass(frozen=True, slots=True)
class Device:
    """This rank's compute device: ``cpu`` or one accelerator (``cuda:N``)."""

    type: str
    """``cpu`` or ``cuda``."""
    index: int | None = None
    """The accelerator's index on this host (None on CPU)."""

    @property
    def torch(self) -> torch.device:
        return torch.device(self.type) if self.index is None else torch.device(self.type,
                                                                                self.index)

    @property
    def is_accelerator(self) -> bool:
        return self.type != "cpu"

    @property
    def backend(self) -> str:
        """The process-group backend for this device: ``nccl`` on CUDA, ``gloo`` on CPU."""
        return "nccl" if self.type == "cuda" else "gloo"

    def activate(self) -> None:
        """Make this the current device of the process (before any CUDA allocation)."""
        if self.is_accelerator:
            torch.get_device_module(self.type).set_device(self.torch)

    def synchronize(self) -> None:
        """Wait for every kernel queued on this device (a no-op on CPU)."""
        if self.is_accelerator:
            torch.get_device_module(self.type).synchronize(self.torch)

    @contextlib.contextmanager
    def autocast(self, dtype: torch.dtype | None) -> Iterator[None]:
        """``torch.autocast`` on this device for `dtype`; no context for None."""
        if dtype is None:
            yield
            return
        with torch.autocast(self.type, dtype=dtype):
            yield


def _cuda_unavailable_reason() -> str:
    built = torch.version.cuda
    if not built:
        return f"torch {torch.__version__} is a CPU-only build"
    return (f"torch {torch.__version__} (CUDA {built}) sees no usable GPU "
            f"(torch.cuda.device_count()={torch.cuda.device_count()}; check the driver and "
            "CUDA_VISIBLE_DEVICES)")


def resolve_device(kind: DeviceKind | str, local_rank: int | None = None) -> Device:
    """``auto`` (cuda if available, else cpu), ``cpu`` or ``cuda``; on CUDA the device is
    ``cuda:LOCAL_RANK`` (`local_rank`, default ``$LOCAL_RANK`` or 0)."""
    try:
        kind = DeviceKind(kind)
    except ValueError:
        allowed = ", ".join(k.value for k in DeviceKind)
        raise DeviceError(f"train.device must be one of {allowed}, got {kind!r}") from None
    if kind is DeviceKind.AUTO:
        kind = DeviceKind.CUDA if torch.cuda.is_available() else DeviceKind.CPU
    if kind is DeviceKind.CPU:
        return Device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"train.device=cuda but {_cuda_unavailable_reason()}; use "
                          "train.device=cpu or auto")
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    count = torch.cuda.device_count()
    if not 0 <= rank < count:
        raise DeviceError(f"local rank {rank} has no GPU: this host shows {count} "
                          "(start one process per GPU: torchrun --nproc-per-node)")
    return Device("cuda", rank)


def init_process_group(device: Device, timeout_s: float, *, store: Any = None,
                       rank: int | None = None, world_size: int | None = None) -> None:
    """Create the default process group for `device`, every collective bounded by
    `timeout_s`. Without `store`, rank and world come from the environment (torchrun).
    On NCCL the group is bound to the device (``device_id``): communicators are created
    eagerly at init, so a broken GPU or network fails here, not in the first step, and
    sub-groups (the mesh dimensions) are split from them instead of bootstrapped anew."""
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if device.backend == "nccl":
        set_now = apply_nccl_env()
        if set_now:
            log.debug("NCCL environment defaults: %s", set_now)
        kwargs["device_id"] = device.torch
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    dist.init_process_group(device.backend, **kwargs)


def bound_mesh_timeouts(meshes: Iterable[Any], timeout_s: float) -> int:
    """Give every process group of `meshes` (DeviceMeshes) the timeout `timeout_s`; returns
    how many groups were set. DeviceMesh creates the groups of its dimensions with
    torch's default timeout (10 minutes on NCCL, 30 on gloo), not the world group's, so
    an FSDP all-gather or a TP reduce waiting on a dead peer would outlast
    ``train.collective_timeout_s`` by far without this."""
    timeout = timedelta(seconds=timeout_s)
    seen: set[int] = set()
    for mesh in meshes:
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            if id(group) in seen:
                continue
            seen.add(id(group))
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    return len(seen)


def abort_process_group(group: Any = None) -> None:
    """Abort `group` (default: the world) without waiting for its collectives in flight,
    then forget it. On NCCL this aborts the communicators (``ncclCommAbort``): a
    collective blocked on a dead peer returns with an error instead of hanging, and a
    new group can then be built; on gloo it closes the group's connections."""
    if not dist.is_initialized():
        return
    pg = group if group is not None else dist.group.WORLD
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort(pg)
        return
    pg.abort()  # older torch: abort the backend, then drop the group's bookkeeping
    dist.destroy_process_group(None if group is None else group)
