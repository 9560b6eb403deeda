"""A missing S3 bucket is a typed error naming the bucket at the first operation, never
an empty checkpoint root (real SeaweedFS; a bucket name that does not exist)."""

from __future__ import annotations

import uuid

import pytest
import torch

from relight import ckpt, storage
from relight.storage.retry import RetryPolicy, call_with_retry, classify

pytestmark = pytest.mark.s3


def _typo_url(prefix: str = "run-1") -> tuple[str, str]:
    # Unique per test: SeaweedFS creates a bucket on the first PUT into it.
    bucket = f"typo-bucket-{uuid.uuid4().hex[:12]}"
    return bucket, f"s3://{bucket}/{prefix}"


def _assert_names_bucket(err: BaseException, bucket: str) -> None:
    assert isinstance(err, storage.BucketNotFoundError), repr(err)
    assert not isinstance(err, storage.ObjectNotFoundError)
    assert err.bucket == bucket and f"S3 bucket {bucket!r} does not exist" in str(err), err


def test_store_operations_on_a_missing_bucket(s3_env) -> None:
    bucket, url = _typo_url()
    store = storage.open_store(url, retry=RetryPolicy(max_attempts=4))
    for op in (lambda: store.list("steps/"), lambda: store.exists("COMMIT"),
               lambda: store.get("COMMIT"), lambda: store.size("COMMIT")):
        with pytest.raises(storage.BucketNotFoundError) as e:
            op()
        _assert_names_bucket(e.value, bucket)
    assert store.stats.retries == 0  # permanent: never retried


def test_manager_on_a_missing_bucket_fails_at_the_first_operation(s3_env) -> None:
    bucket, url = _typo_url()
    mgr = ckpt.CheckpointManager(url)
    with pytest.raises(storage.BucketNotFoundError) as e:
        mgr.latest_step()
    _assert_names_bucket(e.value, bucket)
    with pytest.raises(storage.BucketNotFoundError):
        mgr.restore({"w": torch.zeros(4)})
    with pytest.raises(storage.BucketNotFoundError) as e:
        ckpt.save({"w": torch.zeros(4)}, f"{url}/direct")
    _assert_names_bucket(e.value, bucket)
    h = mgr.save(1, {"w": torch.zeros(4)}, async_save=True)
    with pytest.raises(ckpt.CheckpointSaveError, match=f"S3 bucket '{bucket}' does not exist"):
        h.wait()


def test_classify_a_failed_write_is_not_a_missing_object(s3_env, tmp_path) -> None:
    bucket, url = _typo_url()
    # s3fs's own exception for NoSuchBucket (a FileNotFoundError), from the real server
    try:
        storage.open_store(url).fs.find(f"{bucket}/run-1", detail=True)
    except FileNotFoundError as exc:
        _assert_names_bucket(classify(exc, f"{url}/steps/x.pending", "put"), bucket)
    else:
        pytest.fail("listing a missing bucket did not raise")
    # a put whose parent directory is gone: not "no such object"
    with pytest.raises(storage.StorageError) as e:
        call_with_retry(lambda: open(tmp_path / "gone" / "x", "xb"), "file:///x/gone/x",
                        RetryPolicy(), op="put")
    assert not isinstance(e.value, storage.ObjectNotFoundError)
    assert "put to file:///x/gone/x failed" in str(e.value)
