"""Config loading, overrides and validation, and layout planning (pure, no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relight.runtime.config import (
    Config,
    ConfigChoiceError,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    ReplicaConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)
from relight.runtime.mesh import LayoutError, plan_layout

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def test_tiny_toml_loads_and_overrides() -> None:
    cfg = load_config(TINY, ["--train.steps=7", "--parallel.pp_schedule=gpipe",
                             "--lr=0.01", "--checkpoint.url=memory://x"])
    assert cfg.train.steps == 7
    assert cfg.parallel.pp_schedule == "gpipe"
    assert cfg.optim.lr == 0.01
    assert cfg.checkpoint.url == "memory://x"
    assert cfg.model.dim == 64


def test_resolved_config_roundtrips_through_json() -> None:
    cfg = load_config(TINY, ["--parallel.tp=2"])
    again = config_from_dict(json.loads(json.dumps(config_to_dict(cfg))))
    assert again == cfg


@pytest.mark.parametrize(("overrides", "message"), [
    (["--model.nosuch=1"], "unknown config key model.nosuch"),
    (["--steps=abc"], "train.steps must be int"),
    (["--parallel.pp_schedule=zigzag"], "pp_schedule must be 'gpipe' or '1f1b'"),
    (["--model.dim=30"], "model.dim=30 is not divisible by model.n_heads=4"),
    (["--data.global_batch_size=10"], "not a multiple of data.micro_batch_size=4"),
    (["--data.seq_len=100"], "data.seq_len=100 exceeds model.max_seq_len=64"),
    (["--parallel.tp=3"], "model.n_heads=4 is not divisible by parallel.tp=3"),
    (["--seed=1"], "ambiguous"),
    (["steps=3"], "must look like --section.key=value"),
])
def test_bad_values_are_rejected_with_their_name(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


@pytest.mark.parametrize(("override", "name", "allowed"), [
    ("--parallel.pp_schedule=zigzag", "parallel.pp_schedule", ["gpipe", "1f1b"]),
    ("--train.device=tpu", "train.device", ["auto", "cpu", "cuda"]),
    ("--train.mixed_precision=fp16", "train.mixed_precision", ["fp32", "bf16"]),
    ("--checkpoint.busy=3", "checkpoint.busy", ["wait", "skip"]),
])
def test_a_bad_choice_names_the_value_and_the_allowed_ones(override: str, name: str,
                                                           allowed: list[str]) -> None:
    with pytest.raises(ConfigChoiceError) as e:
        load_config(TINY, [override])
    bad = override.split("=", 1)[1]
    assert e.value.name == name and e.value.allowed == allowed
    assert str(e.value.value) == bad and repr(e.value.value) in str(e.value)
    assert all(repr(a) in str(e.value) for a in allowed)


def test_choices_keep_their_spelling_in_the_saved_config() -> None:
    cfg = load_config(TINY, ["--parallel.pp_schedule=gpipe", "--train.mixed_precision=bf16",
                             "--checkpoint.busy=skip", "--train.device=cpu"])
    saved = config_to_dict(cfg)
    assert cfg.parallel.pp_schedule == "gpipe" and cfg.checkpoint.busy == "skip"
    assert (saved["parallel"]["pp_schedule"], saved["train"]["mixed_precision"],
            saved["checkpoint"]["busy"], saved["train"]["device"]) == ("gpipe", "bf16",
                                                                       "skip", "cpu")
    assert all(type(v) is str for v in (saved["parallel"]["pp_schedule"],
                                        saved["checkpoint"]["busy"]))


def test_classes_are_kw_only_slotted() -> None:
    with pytest.raises(TypeError):
        ModelConfig(64)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        ModelConfig().typo = 1  # type: ignore[attr-defined]


def _cfg(**parallel: int | bool) -> Config:
    return Config(model=ModelConfig(n_layers=4, num_experts=4),
                  parallel=ParallelConfig(**parallel))


def test_dp_shard_fills_the_world() -> None:
    lay = plan_layout(8, _cfg(tp=2, pp=2))
    assert (lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp, lay.dp) == (2, 1, 2, 2, 2)
    lay = plan_layout(4, _cfg(dp_replicate=2, ep=2))
    assert (lay.dp_shard, lay.shard_ep, lay.rep_ep) == (2, 2, 1)
    lay = plan_layout(2, _cfg(dp_replicate=2, dp_shard=1, ep=2))
    assert (lay.rep_ep, lay.shard_ep) == (2, 1)


@pytest.mark.parametrize(("world", "parallel", "message"), [
    (6, {"tp": 4}, r"world size 6 is not divisible by pp\*dp_replicate\*tp = 1\*1\*4 = 4"),
    (8, {"dp_shard": 3}, r"= 3 does not equal the world size 8"),
    (8, {"pp": 8}, r"pp=8 pipeline stages but only n_layers=4 layers"),
    (8, {"ep": 8}, r"ep=8 expert-parallel ranks but only num_experts=4 experts"),
    (6, {"ep": 3}, r"num_experts=4 is not divisible by ep=3"),
    (4, {"tp": 2, "ep": 2}, r"ep=2 with tp=2 is not supported"),
    (4, {"dp_replicate": 2, "dp_shard": 2, "ep": 4}, r"ep=4 must divide dp_shard=2"),
    (8, {"pp": 4}, r"1f1b needs at least pp=4 micro-batches per data rank, and 4 "
                   r"micro-batches over dp=2 leave 2 to the fewest"),
    (6, {"ep": 2}, r"experts are FSDP-sharded on their model.dim=\d+ dim over "
                   r"dp_shard/ep = 6/2 = 3 ranks"),
    (10, {"pp": 2, "pp_schedule": "gpipe"},
     r"whole micro-batches: 4 micro-batches .* cannot give each of dp=5 data ranks one"),
])
def test_impossible_layouts_name_the_numbers(world: int, parallel: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        plan_layout(world, _cfg(**parallel))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24])
def test_any_world_takes_a_batch_dp_does_not_divide(world: int) -> None:
    """The main job's batch (16 samples in micro-batches of 8) on any number of ranks: the
    data ranks take uneven shares instead of refusing to start."""
    cfg = Config(data=DataConfig(global_batch_size=16, micro_batch_size=8))
    assert plan_layout(world, cfg).dp == world


def test_replica_groups_still_need_dp_to_divide_the_micro_batches() -> None:
    cfg = Config(data=DataConfig(global_batch_size=16, micro_batch_size=8),
                 replica=ReplicaConfig(job="j", etcd="127.0.0.1:2379"))
    with pytest.raises(LayoutError, match="replica groups deal the batch in runs of dp"):
        plan_layout(3, cfg)


def test_ep_needs_experts() -> None:
    cfg = Config(parallel=ParallelConfig(ep=2))
    with pytest.raises(LayoutError, match=r"ep=2 but the model has no experts"):
        plan_layout(2, cfg)


@given(world=st.integers(1, 64), tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 5),
       ep=st.sampled_from([1, 2, 4, 8]), rep=st.integers(1, 4),
       shard=st.sampled_from([-1, 1, 2, 4, 8]))
@settings(max_examples=300, deadline=None)
def test_any_layout_either_fits_the_world_or_is_refused(world: int, tp: int, pp: int, ep: int,
                                                        rep: int, shard: int) -> None:
    cfg = Config(model=ModelConfig(n_layers=4, n_heads=4, num_experts=8),
                 parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, dp_replicate=rep, dp_shard=shard),
                 data=DataConfig(global_batch_size=64, micro_batch_size=1))
    try:
        lay = plan_layout(world, cfg)
    except LayoutError as e:
        assert str(e)  # refused with a message
        return
    assert lay.pp * lay.dp_replicate * lay.dp_shard * lay.tp == world
    assert lay.pp <= 4 and 8 % lay.ep == 0
    assert lay.rep_ep * lay.shard_ep == lay.ep
    assert lay.dp_replicate % lay.rep_ep == 0 and lay.dp_shard % lay.shard_ep == 0
    # Any dp takes the batch (uneven shares); a pipeline needs a whole micro-batch per
    # data rank.
    assert lay.pp == 1 or lay.dp <= 64
