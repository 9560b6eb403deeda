"""One storage test suite, run against every backend: file, memory and a real S3 server."""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import uuid

import numpy as np
import pytest
import tensorstore as ts

from relight import storage
from relight.storage import (
    InvalidKeyError,
    ObjectNotFoundError,
    ObjectTruncatedError,
    StoragePermissionError,
    Store,
)


class StoreSuite:
    """Subclasses provide `store` (a fresh, empty store per test)."""

    @pytest.fixture
    def store(self) -> Store:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_put_get_roundtrip(self, store: Store) -> None:
        payload = os.urandom(1 << 16)
        store.put("dir/obj.bin", payload)
        assert store.get("dir/obj.bin") == payload
        assert store.size("dir/obj.bin") == len(payload)
        assert store.exists("dir/obj.bin")
        assert not store.exists("dir/other.bin")

    def test_a_put_buffer_may_be_reused_once_put_returns(self, store: Store) -> None:
        # Whether the store copies the buffer (memory, S3) or writes it out in place
        # (files), what was put stays put when the caller refills its buffer.
        buf = np.frombuffer(bytearray(os.urandom(1 << 16)), dtype=np.uint8)
        first = buf.tobytes()
        for view in (store, store.deferred()):
            view.put("reused/a", memoryview(buf))
            view.put("reused/b", memoryview(buf)[: 1 << 10])
            buf[:] = 0x5A
            view.sync()
            assert store.get("reused/a") == first
            assert store.get("reused/b") == first[: 1 << 10]
            buf[:] = np.frombuffer(first, dtype=np.uint8)

    def test_put_replaces_whole_object(self, store: Store) -> None:
        store.put("k", b"a" * 1000)
        store.put("k", b"b" * 10)
        assert store.get("k") == b"b" * 10

    def test_ranged_reads(self, store: Store) -> None:
        data = bytes(range(256)) * 4
        store.put("r", data)
        assert store.get("r", 10, 20) == data[10:20]
        assert store.get("r", 1000) == data[1000:]
        assert store.get("r", 0, len(data)) == data

    def test_range_past_end_is_truncation(self, store: Store) -> None:
        store.put("short", b"0123456789")
        with pytest.raises(ObjectTruncatedError) as info:
            store.get("short", 5, 50)
        assert "short" in str(info.value)

    def test_missing_object_is_typed(self, store: Store) -> None:
        for op in (lambda: store.get("nope"), lambda: store.size("nope")):
            with pytest.raises(ObjectNotFoundError) as info:
                op()
            assert isinstance(info.value, FileNotFoundError)
            assert "nope" in str(info.value)

    def test_delete_and_delete_prefix(self, store: Store) -> None:
        for key in ("a/1", "a/2", "a/b/3", "c"):
            store.put(key, b"x")
        store.delete("c")
        store.delete("c")  # missing is fine
        assert not store.exists("c")
        assert store.delete_prefix("a") == 3
        assert store.list() == []

    def test_list_is_recursive_relative_and_sorted(self, store: Store) -> None:
        keys = ["z", "a/b/c", "a/x", "m/n"]
        for key in keys:
            store.put(key, b"1")
        assert store.list() == sorted(keys)
        assert store.list("a") == ["a/b/c", "a/x"]
        assert store.list("a/b/") == ["a/b/c"]
        assert store.list("nothing-here") == []

    def test_child_is_a_view_below_the_root(self, store: Store) -> None:
        child = store.child("sub/dir")
        child.put("obj", b"v")
        assert store.get("sub/dir/obj") == b"v"
        assert child.list() == ["obj"]
        assert child.url == store.url.rstrip("/") + "/sub/dir"

    @pytest.mark.parametrize("key", ["../escape", "a/../../b", "/abs", "a//b", "", "a/./b"])
    def test_keys_cannot_leave_the_root(self, store: Store, key: str) -> None:
        with pytest.raises(InvalidKeyError):
            store.put(key, b"x")
        with pytest.raises(InvalidKeyError):
            store.get(key)

    def test_concurrent_writers_to_different_keys(self, store: Store) -> None:
        payloads = {f"c/{i:03d}": os.urandom(1024 + i) for i in range(64)}
        with cf.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda kv: store.put(*kv), payloads.items()))
        assert store.list("c") == sorted(payloads)
        with cf.ThreadPoolExecutor(16) as pool:
            got = dict(zip(payloads, pool.map(store.get, payloads), strict=True))
        assert got == payloads

    def test_put_if_absent_has_exactly_one_winner(self, store: Store) -> None:
        assert store.put_if_absent("x/marker", b"first")
        assert not store.put_if_absent("x/marker", b"second")
        assert store.get("x/marker") == b"first"
        # Sixteen racing writers: one wins, the object is the winner's, whole.
        with cf.ThreadPoolExecutor(16) as pool:
            won = list(pool.map(lambda i: store.put_if_absent("race", b"w%03d" % i), range(16)))
        assert sum(won) == 1
        assert store.get("race") == b"w%03d" % won.index(True)
        assert store.list("x") == ["x/marker"]  # no temp objects left behind

    def test_listing_thousands_of_keys(self, store: Store) -> None:
        # Past S3's 1,000 keys per listing page: the listing must follow the pages.
        keys = [f"many/{i // 100:02d}/{i:05d}" for i in range(1200)]
        with cf.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: store.put(k, b""), keys))
        listed = store.list("many")
        assert listed == sorted(keys)

    def test_tensorstore_arrays_land_beside_objects(self, store: Store) -> None:
        store.put("meta.json", b"{}")
        spec = {
            "driver": "zarr3",
            "kvstore": store.kvstore_spec("arrays/t"),
            "metadata": {
                "shape": [6, 4],
                "data_type": "float32",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [3, 4]}},
            },
        }
        arr = ts.open(spec, create=True, context=store.ts_context()).result()
        values = np.arange(24, dtype=np.float32).reshape(6, 4)
        arr[...] = values
        listed = store.list()
        assert "meta.json" in listed
        assert "arrays/t/zarr.json" in listed
        assert sum(k.startswith("arrays/t/c/") for k in listed) == 2
        reopened = ts.open(
            {"driver": "zarr3", "kvstore": store.kvstore_spec("arrays/t")},
            context=store.ts_context(),
        ).result()
        np.testing.assert_array_equal(reopened.read().result(), values)

    def test_stats_count_bytes(self, store: Store) -> None:
        before = store.stats.snapshot()
        store.put("s", b"12345")
        store.get("s", 1, 3)
        after = store.stats.snapshot()
        assert after["bytes_written"] - before["bytes_written"] == 5
        assert after["bytes_read"] - before["bytes_read"] == 2


class TestLocalStore(StoreSuite):
    @pytest.fixture
    def store(self, tmp_path) -> Store:
        return storage.open_store(tmp_path / "root")

    def test_file_url_and_plain_path_agree(self, tmp_path) -> None:
        a = storage.open_store(str(tmp_path / "x"))
        b = storage.open_store(f"file://{tmp_path}/x")
        a.put("k", b"v")
        assert b.get("k") == b"v"
        assert a.url == b.url

    def test_put_leaves_no_temp_files(self, store: Store, tmp_path) -> None:
        store.put("d/k", b"v" * 100)
        on_disk = [f for _, _, files in os.walk(tmp_path / "root") for f in files]
        assert on_disk == ["k"]

    def test_permission_error_is_typed(self, store: Store, tmp_path) -> None:
        store.put("locked/seed", b"x")
        locked = tmp_path / "root" / "locked"
        # Tests run as root, where mode bits deny nothing; the immutable attribute does.
        if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
            os.chmod(locked, 0o500)
            if os.geteuid() == 0:
                pytest.skip("filesystem supports neither chattr +i nor mode bits for root")
        try:
            with pytest.raises(StoragePermissionError) as info:
                store.put("locked/new", b"y")
            assert isinstance(info.value, PermissionError)
            assert "locked/new" in str(info.value)
        finally:
            subprocess.run(["chattr", "-i", str(locked)], capture_output=True)
            os.chmod(locked, 0o755)


class TestMemoryStore(StoreSuite):
    @pytest.fixture
    def store(self) -> Store:
        return storage.open_store(f"memory://suite/{uuid.uuid4().hex}")


@pytest.mark.s3
class TestS3Store(StoreSuite):
    @pytest.fixture
    def store(self, s3_url: str) -> Store:
        return storage.open_store(s3_url)

    def test_wrong_credentials_fail_at_once_typed(self, s3_env, monkeypatch) -> None:
        if not getattr(s3_env, "checks_credentials", True):
            pytest.skip(f"{type(s3_env).__name__} accepts any credentials")
        secret = "not-the-secret-" + uuid.uuid4().hex
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        bad = storage.open_store(s3_env.url("denied"), retry=storage.RetryPolicy(max_attempts=5))
        with pytest.raises(StoragePermissionError) as info:
            bad.put("k", b"v")
        assert bad.stats.retries == 0
        assert secret not in str(info.value) and secret not in repr(bad)
        assert "s3://" in str(info.value)

    def test_missing_bucket_is_not_found(self, s3_env) -> None:
        store = storage.open_store(f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/x")
        with pytest.raises(storage.BucketNotFoundError) as info:
            store.get("k")
        assert isinstance(info.value, FileNotFoundError)
        assert not isinstance(info.value, ObjectNotFoundError)

    def test_kvstore_spec_carries_no_secret(self, store: Store, s3_env) -> None:
        assert s3_env.secret_key not in repr(store.kvstore_spec())
        assert s3_env.secret_key not in repr(store)


@pytest.mark.s3
def test_s3_listing_sees_writes_and_deletes_from_another_client(s3_url) -> None:
    """Two stores (as two processes would have) over one prefix: no stale listings."""
    writer, reader = storage.open_store(s3_url), storage.open_store(s3_url)
    writer.put("ckpt/step-1/data/x", b"1")
    assert reader.list("ckpt") == ["ckpt/step-1/data/x"]
    assert not reader.exists("ckpt/step-1/COMMIT")
    writer.put("ckpt/step-1/COMMIT", b"{}")
    assert reader.exists("ckpt/step-1/COMMIT")
    assert reader.list("ckpt/step-1") == ["ckpt/step-1/COMMIT", "ckpt/step-1/data/x"]
    writer.delete_prefix("ckpt/step-1")
    assert reader.list("ckpt") == []
    assert not reader.exists("ckpt/step-1/COMMIT")


def test_local_put_survives_a_delete_removing_its_directory(tmp_path, monkeypatch) -> None:
    """`LocalStore._delete` removes directories it empties; a concurrent put into the same
    directory could lose it between creating it and opening its temp file. Simulated here:
    the first directory creation is undone at once, as the racing delete would."""
    import relight.storage.fsspec_store as fs_store

    real, raced = fs_store._make_dirs, []

    def racing_make_dirs(directory: str) -> list[str]:
        created = real(directory)
        if not raced:
            raced.append(directory)
            os.rmdir(directory)  # the concurrent delete's tidy-up
        return created

    monkeypatch.setattr(fs_store, "_make_dirs", racing_make_dirs)
    store = storage.open_store(tmp_path / "root")
    store.put("step-1/data/obj", b"payload")
    assert raced == [str(tmp_path / "root" / "step-1" / "data")]
    assert store.get("step-1/data/obj") == b"payload"
    assert store.list("step-1/") == ["step-1/data/obj"]  # no temp file left
