"""S3 connection settings from the standard places, with secrets kept out of reprs."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["S3Settings", "warm_s3_sdk"]

logger = logging.getLogger(__name__)

SDK_LOGGERS = ("botocore", "aiobotocore", "s3fs", "urllib3", "aiohttp")
"""At DEBUG these print every request's headers, the access key id included."""


def quiet_sdk_loggers() -> None:
    """Keep the S3 SDK's loggers at INFO or above even when the process logs at DEBUG
    (RELIGHT_LOG_LEVEL=DEBUG): credentials must not reach a log."""
    for name in SDK_LOGGERS:
        sdk = logging.getLogger(name)
        if sdk.getEffectiveLevel() < logging.INFO:
            sdk.setLevel(logging.INFO)


@dataclass(frozen=True, slots=True)
class S3Settings:
    """Where S3 is and how to sign requests. Credentials are read from the standard
    environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`)
    or the AWS profile files, never stored on this object, so they cannot leak into
    a repr, a log line, a manifest or an error."""

    endpoint_url: str | None = None
    """S3-compatible server, e.g. http://127.0.0.1:8333; `AWS_ENDPOINT_URL` by default."""
    region: str | None = None
    """`AWS_REGION` / `AWS_DEFAULT_REGION` by default; us-east-1 when unset."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_pool_connections: int = 32
    """Parallel connections per process (fsspec and tensorstore both)."""
    anonymous: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, **overrides: Any) -> S3Settings:
        endpoint = overrides.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL")
        region = overrides.pop("region", None) or os.environ.get("AWS_REGION") \
            or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return cls(endpoint_url=endpoint, region=region, **overrides)

    def filesystem(self) -> Any:
        import s3fs

        quiet_sdk_loggers()

        client_kwargs: dict[str, Any] = {"region_name": self.region}
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        fs = s3fs.S3FileSystem(
            anon=self.anonymous,
            client_kwargs=client_kwargs,
            config_kwargs={
                "connect_timeout": self.connect_timeout_s,
                "read_timeout": self.read_timeout_s,
                "max_pool_connections": self.max_pool_connections,
                # storage.retry owns retrying; botocore's own retries would multiply it.
                "retries": {"max_attempts": 1, "mode": "standard"},
            },
            skip_instance_cache=True,
            # Other ranks and processes write under the same prefixes: a cached listing
            # would hide a fresh COMMIT or show a deleted one. Always ask the server.
            use_listings_cache=False,
            **self.extra,
        )
        fs.retries = 1
        return fs

    def kvstore_spec(self, bucket: str, root: str) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "driver": "s3",
            "bucket": bucket,
            "path": (root.rstrip("/") + "/") if root else "",
            "aws_region": self.region,
            "aws_credentials": {"type": self._credential_source()},
        }
        if self.endpoint_url:
            spec["endpoint"] = self.endpoint_url
        return spec

    def _credential_source(self) -> str:
        # "default" would also probe the instance-metadata address: only ask for the
        # sources that are actually configured here.
        if self.anonymous:
            return "anonymous"
        return "environment" if os.environ.get("AWS_ACCESS_KEY_ID") else "profile"

    def ts_context(self) -> Any:
        import tensorstore as ts

        return ts.Context({"s3_request_concurrency": {"limit": self.max_pool_connections}})


def warm_s3_sdk() -> bool:
    """Build and close one S3 client, sending nothing, so that processes forked from this
    one afterwards (`elastic.warm`'s workers) find botocore's one-time set-up done; their
    first S3 operation is then cheaper (docs/elastic.md). Fixed dummy credentials: the
    credential chain (files, instance metadata) is not consulted here. Best effort:
    False when the SDK is missing or the client could not be built."""
    try:
        import asyncio

        from aiobotocore.session import AioSession
    except ImportError:
        return False
    s = S3Settings.from_env()

    async def build() -> None:
        async with AioSession().create_client(
                "s3", region_name=s.region, endpoint_url=s.endpoint_url,
                aws_access_key_id="relight-warm", aws_secret_access_key="relight-warm"):
            pass

    try:
        asyncio.run(build())
    except Exception as e:  # noqa: BLE001 - an optimisation; workers build their own
        logger.debug("warming the S3 SDK failed: %s", e)
        return False
    return True
