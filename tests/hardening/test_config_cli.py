"""Bad config and command-line input, as a user gives it: each is refused with a typed
error (ConfigError, LayoutError, a storage error) naming the key, file or URL at fault,
and the CLI exits with its documented status instead of a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relight.runtime.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    load_config,
)
from relight.runtime.mesh import LayoutError, plan_layout

from ._util import tally

ROOT = Path(__file__).resolve().parents[2]

BAD_CONFIGS: dict[str, tuple[dict, str]] = {
    "unknown-section": ({"trainn": {"steps": 1}}, "[trainn]"),
    "unknown-key": ({"train": {"stepz": 3}}, "train.stepz"),
    "section-not-a-table": ({"train": 3}, "[train]"),
    "string-for-int": ({"train": {"steps": "ten"}}, "train.steps"),
    "bool-for-int": ({"train": {"steps": True}}, "train.steps"),
    "float-for-int": ({"model": {"dim": 64.5}}, "model.dim"),
    "list-for-str": ({"checkpoint": {"url": ["a"]}}, "checkpoint.url"),
    "negative-steps": ({"train": {"steps": -1}}, "train.steps"),
    "zero-width": ({"model": {"dim": 0}}, "model.dim"),
    "heads-not-divisible-by-tp": ({"parallel": {"tp": 3}}, "parallel.tp"),
    "unknown-pp-schedule": ({"parallel": {"pp_schedule": "zigzag"}}, "parallel.pp_schedule"),
    "batch-not-multiple": ({"data": {"global_batch_size": 10}}, "data.global_batch_size"),
    "seq-longer-than-model": ({"data": {"seq_len": 4096}}, "model.max_seq_len"),
    "top-k-over-experts": ({"model": {"num_experts": 2, "top_k": 3}}, "model.top_k"),
    "checkpoint-url-scheme": ({"checkpoint": {"url": "gs://bucket/run"}}, "checkpoint.url"),
    "checkpoint-url-credentials": ({"checkpoint": {"url": "s3://AKIAX:hunter2@b/run"}},
                                   "checkpoint.url"),
    "metadata-without-url": ({"preemption": {"metadata": "aws"}}, "preemption.metadata_url"),
    "unknown-signal": ({"preemption": {"signals": "SIGNOPE"}}, "SIGNOPE"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_names_the_key(name: str) -> None:
    raw, names = BAD_CONFIGS[name]
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert isinstance(info.value, ValueError)
    assert names in str(info.value), str(info.value)
    assert "hunter2" not in str(info.value)
    tally("bad_inputs")


BAD_OVERRIDES = {
    "not-an-int": ("--train.steps=abc", "train.steps"),
    "unknown-bare-key": ("--nosuchkey=1", "--nosuchkey"),
    "unknown-dotted-key": ("--train.nosuch=1", "train.nosuch"),
    "no-dashes": ("train.steps=3", "train.steps=3"),
    "no-value": ("--train.steps", "--train.steps"),
}


@pytest.mark.parametrize("name", sorted(BAD_OVERRIDES))
def test_bad_override_names_it(name: str) -> None:
    item, names = BAD_OVERRIDES[name]
    with pytest.raises(ConfigError, match=None) as info:
        config_from_dict(apply_overrides({}, [item]))
    assert names in str(info.value), str(info.value)
    tally("bad_inputs")


BAD_LAYOUTS = {
    "world-not-divisible": (3, {"parallel": {"tp": 2}}, "world size 3"),
    "dp-shard-mismatch": (4, {"parallel": {"dp_shard": 3}}, "dp_shard"),
    "more-stages-than-layers": (8, {"parallel": {"pp": 8}}, "pp=8"),
    "ep-without-experts": (2, {"parallel": {"ep": 2}}, "num_experts"),
    "ep-not-dividing-experts": (3, {"parallel": {"ep": 3}, "model": {"num_experts": 4}},
                                "ep=3"),
}


@pytest.mark.parametrize("name", sorted(BAD_LAYOUTS))
def test_impossible_layout_names_the_degree(name: str) -> None:
    world, raw, names = BAD_LAYOUTS[name]
    with pytest.raises(LayoutError) as info:
        plan_layout(world, config_from_dict(raw))
    assert names in str(info.value), str(info.value)
    tally("bad_inputs")


@pytest.mark.parametrize("text", ["[train\nsteps = 2\n", "steps = = 2\n", "\xff\xfe"])
def test_unreadable_config_file_is_a_config_error(tmp_path, text: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(path)
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config(tmp_path / "missing.toml")
    tally("bad_inputs", 2)


def test_relight_train_exits_2_naming_the_key(tmp_path) -> None:
    """As a user runs it: the console entry point, a config file, a typo in a key."""
    cfg = tmp_path / "run.toml"
    cfg.write_text("[train]\nsteps = 2\nstepz = 3\n")
    out = subprocess.run([sys.executable, "-m", "relight.cli", "train", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "unknown config key train.stepz" in out.stderr
    assert "Traceback" not in out.stderr
    tally("bad_inputs")
    tally("runs_completed")


@pytest.mark.parametrize("argv, names", [
    (["--config", "{tmp}/missing.toml"], "missing.toml"),
    (["--checkpoint.url=gs://bucket/run"], "checkpoint.url"),
    (["--parallel.tp=3"], "parallel.tp"),
])
def test_relight_train_bad_input_in_process(tmp_path, caplog, argv, names) -> None:
    from relight.cli import main

    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["train", *argv, "--train.device=cpu"]) == 2
    assert names in caplog.text
    tally("bad_inputs")


def _no_aws(monkeypatch, tmp_path) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws either
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_missing_s3_credentials(monkeypatch, tmp_path, capsys) -> None:
    from relight import storage
    from relight.ckpt.cli import main

    _no_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    store = storage.open_store("s3://bucket/run")
    with pytest.raises(storage.StoragePermissionError) as info:
        store.get("COMMIT")
    assert "AWS_ACCESS_KEY_ID" in str(info.value) and "s3://bucket/run" in str(info.value)
    assert store.stats.retries == 0  # permanent: not retried
    assert main(["ls", "s3://bucket/run"]) == 4
    err = capsys.readouterr().err
    assert "AWS_ACCESS_KEY_ID" in err and "s3://bucket/run" in err
    tally("bad_inputs", 2)


def test_unreachable_endpoint(monkeypatch, tmp_path, capsys) -> None:
    from relight import storage
    from relight.ckpt.cli import main

    _no_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: refused
    store = storage.open_store("s3://bucket/run", retry=storage.RetryPolicy(
        max_attempts=2, base_delay_s=0.0, max_delay_s=0.0))
    with pytest.raises(storage.TransientStorageError) as info:
        store.exists("COMMIT")
    assert "s3://bucket/run/COMMIT" in str(info.value)
    assert "127.0.0.1:9" in str(info.value) and "gave up after 2 attempts" in str(info.value)
    assert main(["verify", "s3://bucket/run"]) == 4
    assert "s3://bucket/run" in capsys.readouterr().err
    tally("bad_inputs", 2)


def test_config_defaults_still_valid() -> None:
    """The refusals above are not a validator that refuses everything."""
    assert isinstance(config_from_dict({}), Config)
    assert config_from_dict({"checkpoint": {"url": "s3://bucket/run"}}).checkpoint.url
    assert plan_layout(4, config_from_dict({"parallel": {"tp": 2}})).tp == 2
