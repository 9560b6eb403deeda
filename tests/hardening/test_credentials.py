"""Credentials never leak: a training job runs against S3 with sentinel keys (and a
sentinel etcd password in its environment); every output it leaves (stdout, stderr,
metrics, every object it wrote, the config saved with its checkpoints, the `relight
ckpt` listings) and every error, repr and log line of a failing client is searched
for the sentinels. An etcd with auth on gets the same treatment for its password."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from relight import storage
from relight.chaos.s3_server import S3Server
from relight.elastic.etcd_client import EtcdAuthError, EtcdClient, EtcdSettings
from relight.elastic.etcd_server import EtcdServer, etcd_binary

from ._util import tally

ROOT = Path(__file__).resolve().parents[2]


def _assert_clean(where: str, text: str, secrets: list[str]) -> None:
    for secret in secrets:
        assert secret not in text, f"a credential leaked into {where}"
    tally("outputs_searched")


def _files(root: Path, skip: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and skip not in p.parents]


@pytest.mark.long
@pytest.mark.s3
def test_s3_keys_and_etcd_password_never_appear(tmp_path, monkeypatch, capsys, caplog) -> None:
    key_id = "AKIASENTINEL" + uuid.uuid4().hex[:12].upper()
    secret = "sentinel-secret-" + uuid.uuid4().hex
    etcd_pw = "sentinel-etcd-pw-" + uuid.uuid4().hex
    secrets = [key_id, secret, etcd_pw]
    server = S3Server(tmp_path / "s3" / "data", access_key=key_id, secret_key=secret)
    server.start()
    try:
        env = {**os.environ, **server.env(), "RELIGHT_ETCD_PASSWORD": etcd_pw,
               "PYTHONPATH": str(ROOT), "RELIGHT_LOG_LEVEL": "DEBUG"}
        work = tmp_path / "job"
        work.mkdir()
        url = server.url("run")
        out = subprocess.run(
            [sys.executable, "-m", "relight.cli", "train", "--train.device=cpu",
             "--train.steps=4", "--checkpoint.every=2", f"--checkpoint.url={url}",
             f"--train.metrics_path={work / 'metrics.jsonl'}"],
            capture_output=True, text=True, timeout=600, cwd=work, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "committed" in out.stderr + out.stdout  # it did checkpoint to S3
        _assert_clean("the job's stdout", out.stdout, secrets)
        _assert_clean("the job's stderr", out.stderr, secrets)
        written = _files(tmp_path, skip=tmp_path / "s3")
        assert any(p.name == "metrics.jsonl" for p in written)
        for path in written:
            _assert_clean(str(path), path.read_bytes().decode("latin-1"), secrets)

        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        root = storage.open_store(url)
        objects = root.list()
        assert any(k.endswith("manifest.json") for k in objects)
        for key in objects:  # manifests (with the saved config), records, indexes, chunks
            _assert_clean(f"object {key}", root.get(key).decode("latin-1"), secrets)
        _assert_clean("a store's repr and spec", repr(root) + repr(root.kvstore_spec())
                      + repr(storage.S3Settings.from_env()), secrets)

        from relight.ckpt.cli import main as ckpt_main

        assert ckpt_main(["ls", url]) == 0
        assert ckpt_main(["inspect", url]) == 0
        listing = capsys.readouterr()
        assert "step" in listing.out
        _assert_clean("relight ckpt ls/inspect", listing.out + listing.err, secrets)

        # A client with a wrong secret: the refusal, its repr and the log name no key.
        wrong = "sentinel-wrong-" + uuid.uuid4().hex
        secrets.append(wrong)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
        with caplog.at_level(logging.DEBUG):
            bad = storage.open_store(url)
            with pytest.raises(storage.StoragePermissionError) as info:
                bad.get(objects[0])
            assert ckpt_main(["verify", url]) != 0
        refused = capsys.readouterr()
        _assert_clean("a refused request's error", str(info.value) + repr(info.value)
                      + repr(bad), secrets)
        _assert_clean("a refused CLI call", refused.out + refused.err, secrets)
        _assert_clean("the log", caplog.text, secrets)
        tally("runs_completed")
    finally:
        server.stop()


@pytest.mark.etcd
def test_etcd_password_never_appears(tmp_path, caplog) -> None:
    password = "sentinel-etcd-" + uuid.uuid4().hex
    wrong = "sentinel-etcd-wrong-" + uuid.uuid4().hex
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        ctl = [etcd_binary("etcdctl"), f"--endpoints={server.url}"]
        subprocess.run([*ctl, "user", "add", f"root:{password}", "--interactive=false"],
                       check=True, capture_output=True, timeout=30)
        subprocess.run([*ctl, "auth", "enable"], check=True, capture_output=True, timeout=30)
        with caplog.at_level(logging.DEBUG):
            good = EtcdSettings(endpoints=(server.endpoint,), username="root",
                                password=password, timeout=5)
            client = EtcdClient(good)
            client.put("/relight/job/k", b"v")
            assert client.get("/relight/job/k").value == b"v"
            bad = EtcdClient(EtcdSettings(endpoints=(server.endpoint,), username="root",
                                          password=wrong, timeout=5))
            with pytest.raises(EtcdAuthError) as info:
                bad.get("/relight/job/k")
        for where, text in (("settings repr", repr(good) + repr(client) + repr(bad)),
                            ("auth error", str(info.value) + repr(info.value)),
                            ("the log", caplog.text)):
            _assert_clean(where, text, [password, wrong])
    finally:
        server.stop()
