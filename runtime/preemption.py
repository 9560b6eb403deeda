"""Preemption notices and the decisions of the emergency-checkpoint protocol.

A preemptible machine is taken back after a short notice. This module turns the ways a
notice arrives into one local flag, and holds the pure decisions the trainer takes on it:

* sources (pluggable, all optional): a signal (torchrun's agent forwards the SIGTERM it
  gets to every local worker), a file appearing at a path (checked once per step), and a
  poller of a cloud metadata endpoint (AWS spot ``/latest/meta-data/spot/instance-action``,
  GCP ``/computeMetadata/v1/instance/preempted``) at a configured base URL;
* :class:`NoticeBoard`: the local flag; lock-free, because a signal handler runs on the
  main thread between two bytecodes and must never wait for a lock that thread holds;
* :class:`NoticeWatcher`: starts and stops the sources, and exits a process that cannot
  act on a notice (no step completed yet: nothing new to save; the step in flight hung);
* :func:`decide`: the same go / no-go on every rank, from values all ranks gathered.

The protocol itself (agree once per step, finish the step, wait for the async save in
flight, save synchronously, exit with :data:`PREEMPTED_EXIT_CODE`) runs in
``runtime.train``; docs/preemption.md describes it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import FrameType
from typing import Any, Protocol

from relight.errors import RelightError
from relight.exit_codes import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE
from relight.rank_log import RankStepLogger
from relight.runtime.config import PreemptionConfig

__all__ = [
    "HUNG_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "EmergencyDecision",
    "FileSource",
    "MetadataPoller",
    "MetadataError",
    "Notice",
    "NoticeBoard",
    "NoticeSource",
    "NoticeWatcher",
    "SignalSource",
    "decide",
    "estimate_save_s",
]

log = logging.getLogger(__name__)


AWS_PATH = "/latest/meta-data/spot/instance-action"
AWS_TOKEN_PATH = "/latest/api/token"
GCP_PATH = "/computeMetadata/v1/instance/preempted"


class MetadataError(RelightError, RuntimeError):
    """A metadata endpoint answered something that is neither "no notice" nor a notice."""


@dataclass(frozen=True, slots=True)
class Notice:
    """One preemption notice seen by this process."""

    source: str
    """``signal:SIGTERM``, ``file:/path``, ``aws:http://...``, ``gcp:http://...``."""
    detail: str
    received_unix: float
    deadline_unix: float
    """When the machine is expected to go (the hard kill)."""

    def remaining_s(self, now: float | None = None) -> float:
        return self.deadline_unix - (time.time() if now is None else now)


class NoticeBoard:
    """This process's notices. Appends and reads only: a signal handler may post while
    the main thread is anywhere, and ``list.append`` is atomic under the GIL."""

    def __init__(self) -> None:
        self._notices: list[Notice] = []

    def post(self, notice: Notice) -> None:
        self._notices.append(notice)

    @property
    def pending(self) -> bool:
        return bool(self._notices)

    @property
    def first(self) -> Notice | None:
        return self._notices[0] if self._notices else None

    @property
    def count(self) -> int:
        return len(self._notices)

    def notices(self) -> list[Notice]:
        return list(self._notices)

    def deadline_unix(self) -> float:
        """The earliest deadline of any notice (inf without one)."""
        return min((n.deadline_unix for n in self._notices), default=math.inf)


class NoticeSource(Protocol):
    """A way a notice reaches this process. ``start`` and ``stop`` run on the main thread;
    ``check`` runs there once per step and must be cheap (a stat, not a request)."""

    name: str

    def start(self, board: NoticeBoard) -> None: ...

    def check(self) -> None: ...

    def stop(self) -> None: ...


class SignalSource:
    """A notice is one of ``signals`` delivered to this process. The handler only posts: a
    second signal during the emergency save changes nothing (the save goes on; the hard
    kill after the grace period is what ends it, and the commit protocol makes that safe)."""

    def __init__(self, signals: Sequence[signal.Signals], grace_s: float) -> None:
        self.signals = list(signals)
        self.grace_s = grace_s
        self.name = "signal:" + ",".join(s.name for s in self.signals)
        self._board: NoticeBoard | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def start(self, board: NoticeBoard) -> None:
        self._board = board
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption: not on the main thread; signal notices (%s) are off",
                        self.name)
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        assert self._board is not None
        now = time.time()
        name = signal.Signals(signum).name
        self._board.post(Notice(f"signal:{name}", f"received {name}", now, now + self.grace_s))

    def check(self) -> None:
        pass

    def stop(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


class FileSource:
    """A notice is a file at ``path`` (an operator, a node agent or a spot-termination
    handler creates it). Checked with one ``os.path.exists`` per step."""

    def __init__(self, path: str, grace_s: float) -> None:
        self.path = path
        self.grace_s = grace_s
        self.name = f"file:{path}"
        self._board: NoticeBoard | None = None
        self._seen = False

    def start(self, board: NoticeBoard) -> None:
        self._board = board

    def check(self) -> None:
        if self._seen or self._board is None or not os.path.exists(self.path):
            return
        self._seen = True
        now = time.time()
        self._board.post(Notice(self.name, f"{self.path} exists", now, now + self.grace_s))

    def stop(self) -> None:
        pass


def _parse_aws_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class MetadataPoller:
    """Polls a cloud metadata endpoint in a daemon thread.

    ``kind="aws"``: IMDSv2 token (``PUT /latest/api/token``; IMDSv1 when that fails), then
    ``GET /latest/meta-data/spot/instance-action``: 404 means no notice, 200 a JSON
    ``{"action": "terminate"|"stop"|"hibernate", "time": ISO-8601}`` whose time is the
    deadline. ``kind="gcp"``: ``GET /computeMetadata/v1/instance/preempted`` with
    ``Metadata-Flavor: Google``: ``TRUE`` is a notice, ``FALSE`` none; the deadline is
    ``grace_s`` after it was seen (GCP gives about 30 s). Nothing is requested unless a
    base URL is configured.
    """

    def __init__(self, kind: str, base_url: str, *, interval_s: float, timeout_s: float,
                 grace_s: float) -> None:
        if kind not in ("aws", "gcp"):
            raise ValueError(f"metadata kind must be 'aws' or 'gcp', got {kind!r}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"metadata base URL must be http(s), got {base_url!r}")
        self.kind = kind
        self.base_url = base_url.rstrip("/")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.name = f"{kind}:{self.base_url}"
        self.requests = 0
        self.errors = 0
        self._token: str | None = None
        self._token_expires = 0.0
        self._board: NoticeBoard | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one request -------------------------------------------------------------------

    def _open(self, req: urllib.request.Request) -> tuple[int, bytes]:
        self.requests += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310
                return resp.status, resp.read(65536)
        except urllib.error.HTTPError as e:
            return e.code, b""

    def _aws_token(self) -> str | None:
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        req = urllib.request.Request(
            self.base_url + AWS_TOKEN_PATH, method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
        try:
            status, body = self._open(req)
        except OSError:
            status, body = 0, b""
        if status != 200 or not body:
            self._token = None  # IMDSv1
            return None
        self._token = body.decode().strip()
        self._token_expires = time.monotonic() + 240
        return self._token

    def probe(self) -> Notice | None:
        """One poll: the notice the endpoint announces now, or None. Raises ``OSError``
        (unreachable) or :class:`MetadataError` (an answer that is neither)."""
        now = time.time()
        if self.kind == "aws":
            token = self._aws_token()
            headers = {"X-aws-ec2-metadata-token": token} if token else {}
            status, body = self._open(urllib.request.Request(self.base_url + AWS_PATH,
                                                             headers=headers))
            if status == 404:
                return None
            if status == 401:
                self._token = None
                raise MetadataError(f"{self.base_url}{AWS_PATH}: 401 (token refused)")
            if status != 200:
                raise MetadataError(f"{self.base_url}{AWS_PATH}: HTTP {status}")
            try:
                doc = json.loads(body)
                action, when = str(doc["action"]), _parse_aws_time(str(doc["time"]))
            except (ValueError, KeyError, TypeError) as e:
                raise MetadataError(
                    f"{self.base_url}{AWS_PATH}: not an instance-action document "
                    f"({body[:200]!r}): {e}") from None
            return Notice(self.name, f"instance-action {action} at {doc['time']}", now, when)
        status, body = self._open(urllib.request.Request(
            self.base_url + GCP_PATH, headers={"Metadata-Flavor": "Google"}))
        if status != 200:
            raise MetadataError(f"{self.base_url}{GCP_PATH}: HTTP {status}")
        text = body.decode(errors="replace").strip().upper()
        if text == "FALSE":
            return None
        if text == "TRUE":
            return Notice(self.name, "preempted=TRUE", now, now + self.grace_s)
        raise MetadataError(f"{self.base_url}{GCP_PATH}: expected TRUE or FALSE, got "
                            f"{body[:100]!r}")

    # -- the thread --------------------------------------------------------------------

    def start(self, board: NoticeBoard) -> None:
        self._board = board
        self._thread = threading.Thread(target=self._run, name="relight-preempt-poll",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._board is not None
        last_error = ""
        while not self._stop.is_set():
            try:
                notice = self.probe()
            except (OSError, MetadataError) as e:
                self.errors += 1
                if str(e) != last_error:  # once per distinct error, not every poll
                    log.warning("preemption poller %s: %s", self.name, e)
                    last_error = str(e)
            else:
                if notice is not None:
                    self._board.post(notice)
                    return  # one notice is all it takes; the machine is going
            self._stop.wait(self.interval_s)

    def check(self) -> None:
        pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 1)


def sources_from_config(cfg: PreemptionConfig) -> list[NoticeSource]:
    """The sources ``cfg`` asks for (none when preemption handling is off)."""
    if not cfg.enabled:
        return []
    out: list[NoticeSource] = []
    sigs = [signal.Signals[s.strip()] for s in cfg.signals.split(",") if s.strip()]
    if sigs:
        out.append(SignalSource(sigs, cfg.grace_s))
    if cfg.notice_file:
        out.append(FileSource(cfg.notice_file, cfg.grace_s))
    if cfg.metadata:
        out.append(MetadataPoller(cfg.metadata, cfg.metadata_url,
                                  interval_s=cfg.poll_interval_s,
                                  timeout_s=cfg.request_timeout_s, grace_s=cfg.grace_s))
    return out


class NoticeWatcher:
    """Owns the sources and the one situation the trainer cannot handle itself: a notice
    the main loop never gets to. Phases, set by the trainer:

    * ``startup`` (init and restore, before the loop): nothing newer than the committed
      checkpoint exists, so a notice exits the process at once with PREEMPTED_EXIT_CODE;
    * ``training``: the loop agrees on notices once per step; if the step in flight does
      not end within the step timeout after a notice, the process is hung (a peer
      stopped, a collective stuck) and exits with HUNG_EXIT_CODE instead of waiting for
      the hard kill;
    * ``emergency`` / ``done``: the trainer acts; a further notice is only logged.
    """

    def __init__(self, cfg: PreemptionConfig, *, rank: int = 0,
                 sources: list[NoticeSource] | None = None,
                 exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.cfg = cfg
        self.rank = rank
        self.board = NoticeBoard()
        self.sources = sources_from_config(cfg) if sources is None else sources
        self.phase = "startup"
        self.step = 0
        self.slowest_step_s = 0.0
        self._exit = exit_fn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged = 0
        self._log_lock = threading.Lock()
        self._step_ended = time.monotonic()

    def start(self) -> NoticeWatcher:
        for s in self.sources:
            s.start(self.board)
        if self.sources:
            self._thread = threading.Thread(target=self._run, name="relight-preempt-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def check(self) -> None:
        """Run the per-step checks of polled sources (main thread, once per step)."""
        for s in self.sources:
            s.check()

    def step_done(self, step: int, step_time_s: float) -> None:
        self.step = step
        self.slowest_step_s = max(self.slowest_step_s, step_time_s)
        self._step_ended = time.monotonic()

    def step_timeout_s(self) -> float:
        if self.cfg.step_timeout_s > 0:
            return self.cfg.step_timeout_s
        if self.slowest_step_s == 0:  # no step timed yet: only the hard kill ends it
            return self.cfg.grace_s
        return max(10.0, 3.0 * self.slowest_step_s)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            first = self.board.first
            if first is None:
                continue
            self._log_new_notices()
            if self.phase == "startup":
                self._bail(PREEMPTED_EXIT_CODE, "notice before training started: nothing "
                           "newer than the committed checkpoint to save; exiting now")
            elif self.phase == "training":
                since = time.monotonic() - max(self._step_ended, _mono_of(first))
                if since > self.step_timeout_s():
                    self._bail(HUNG_EXIT_CODE, f"the step in flight did not finish within "
                               f"{self.step_timeout_s():.1f} s of the notice (hung?); exiting")

    def _log_new_notices(self) -> None:
        # Called by the watcher thread and once more by stop(): the main thread can act on
        # a notice (agree, save, exit) between two of the watcher's wake-ups.
        with self._log_lock:
            for n in self.board.notices()[self._logged:]:
                RankStepLogger(log, self.rank, self.step).warning(
                    "preemption notice from %s: %s (%.1f s of grace left)%s", n.source,
                    n.detail, n.remaining_s(),
                    "; already acting on an earlier one" if self._logged else "")
                self._logged += 1

    def _bail(self, code: int, why: str) -> None:
        RankStepLogger(log, self.rank, self.step).error("preemption: %s (status %d)", why, code)
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        self._stop.set()
        self._exit(code)

    def stop(self, *, restore_signals: bool = True) -> None:
        """Stop the sources. ``restore_signals=False`` (after a preemption) leaves the signal
        handlers in place until the process exits: torchrun's agent SIGTERMs the remaining
        workers as soon as the first one exits, and that must not turn a clean exit 76
        into a death by signal halfway through interpreter shutdown."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self._log_new_notices()
        for s in self.sources:
            if restore_signals or not isinstance(s, SignalSource):
                s.stop()


def _mono_of(notice: Notice) -> float:
    """The notice's receipt time on the monotonic clock."""
    return time.monotonic() - (time.time() - notice.received_unix)


# ---- pure decisions ------------------------------------------------------------------


def estimate_save_s(state_bytes: int, observed: Sequence[tuple[int, float]],
                    assumed_write_mb_s: float, assumed_overhead_s: float = 1.0) -> float:
    """Seconds a synchronous save of ``state_bytes`` (this rank's share) should take.

    From this run's own saves (``(bytes, seconds to commit)`` pairs): the slowest one,
    scaled to ``state_bytes``. Async saves share the machine with training, so they take
    longer than a sync save of the same bytes: the estimate errs long, which is the safe
    side. Before any save was timed: ``assumed_overhead_s`` (planning, metadata, commit)
    plus the bytes at ``assumed_write_mb_s``."""
    scaled = [s * state_bytes / b for b, s in observed if b > 0 and s > 0]
    if scaled:
        return max(scaled)
    return assumed_overhead_s + state_bytes / (assumed_write_mb_s * 1e6)


@dataclass(frozen=True, slots=True)
class EmergencyDecision:
    save: bool
    estimate_s: float
    """The slowest rank's estimate (before the safety factor)."""
    remaining_s: float
    """The least grace left on any rank."""
    reason: str


def decide(estimates_s: Sequence[float], remaining_s: Sequence[float], *,
           safety_factor: float, margin_s: float) -> EmergencyDecision:
    """Go / no-go for the emergency save, from every rank's estimate and grace left (the
    same gathered lists on every rank give the same answer on every rank)."""
    est = max(estimates_s)
    left = min(remaining_s)
    need = est * safety_factor + margin_s
    if need <= left:
        return EmergencyDecision(True, est, left, f"estimated {est:.2f} s x {safety_factor} + "
                                 f"{margin_s} s margin fits in {left:.2f} s of grace")
    return EmergencyDecision(False, est, left, f"estimated {est:.2f} s x {safety_factor} + "
                             f"{margin_s} s margin exceeds the {left:.2f} s of grace left")
