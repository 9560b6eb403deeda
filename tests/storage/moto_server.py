"""moto's S3 server as a second S3 implementation for the S3 tests.

moto pins a botocore newer than s3fs's aiobotocore allows, so it lives in a virtual
environment of its own: `RELIGHT_MOTO_SERVER` names its `moto_server` executable, and
the S3 fixtures (tests/conftest.py) then serve S3 from it instead of SeaweedFS. Same
surface as `chaos.s3_server.S3Server`: `start()`, `env()`, `url()`, `stop()`.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MotoServer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MotoServer:
    """`moto_server` on 127.0.0.1 (in-memory; stops with its process), one bucket."""

    executable: str
    log_dir: Path
    bucket: str = "relight"
    access_key: str = "relight-test"
    secret_key: str = "relight-test-secret"
    region: str = "us-east-1"
    port: int = field(default_factory=_free_port)
    checks_credentials: bool = False
    """moto accepts any key pair unless its IAM emulation is set up (not done here)."""
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": self.region, "AWS_ENDPOINT_URL": self.endpoint_url}

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def start(self, timeout: float = 60.0) -> MotoServer:
        self.log_dir = Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / "moto.log", "ab")  # noqa: SIM115 - the server's lifetime
        self._proc = subprocess.Popen([self.executable, "-H", "127.0.0.1", "-p",
                                       str(self.port)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}; see "
                                   f"{self.log_dir / 'moto.log'}")
            try:
                # moto's own API: create the bucket (a PUT on the bucket's path)
                req = urllib.request.Request(f"{self.endpoint_url}/{self.bucket}", method="PUT")
                urllib.request.urlopen(req, timeout=2).read()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server not ready on {self.endpoint_url} after "
                                       f"{timeout} s") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None
