"""The model registry and factory models: names with their parallelize functions, a user's
own ``nn.Module``, and a Hugging Face causal LM trained under FSDP on real tokens,
checkpointed, resumed bitwise on the same layout and resumed on another world size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from relight.runtime.config import ConfigError, load_config
from relight.runtime.models import get_model_spec, model_names
from relight.runtime.prepare import prepare
from relight.runtime.tokens import VocabMismatchError
from tests.runtime.pool import RankPool

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny.toml")
FACTORY = "tests.runtime.user_models"


@pytest.fixture(scope="module")
def pydoc_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real English text: Python's own documentation topics, byte-level tokens."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("pydoc")
    src = root / "topics.jsonl"
    src.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)[:30]))
    prepare([str(src)], tokenizer="byte", out=root / "ds", workers=1)
    return root / "ds"


def _cfg(*overrides: str):  # noqa: ANN202
    return load_config(CONFIG, list(overrides))


def test_registry_names_models_with_their_parallelize_functions() -> None:
    assert {"llama", "moe"} <= set(model_names())
    assert get_model_spec("moe").parallelize is get_model_spec("llama").parallelize
    with pytest.raises(ConfigError, match="not a registered model"):
        get_model_spec("gpt-17")


def test_registered_models_train(pydoc_tokens: Path) -> None:
    from relight.runtime.model import Transformer
    from relight.runtime.train import Trainer, run_training

    with pytest.raises(ConfigError, match="num_experts"):
        Trainer(_cfg("--model.name=moe"))
    res = run_training(_cfg("--model.name=moe", "--model.num_experts=4", "--train.steps=2"))
    assert len(res.losses) == 2
    t = Trainer(_cfg("--model.name=llama", "--train.steps=1"))
    try:
        assert isinstance(t.model, Transformer)
    finally:
        t.close()


def test_factory_errors_name_the_factory(pydoc_tokens: Path) -> None:
    from relight.runtime.train import Trainer

    with pytest.raises(ConfigError, match="cannot import 'tests.runtime.nowhere'"):
        Trainer(_cfg("--model.factory=tests.runtime.nowhere:f"))
    with pytest.raises(ConfigError, match="no function 'nope'"):
        Trainer(_cfg(f"--model.factory={FACTORY}:nope"))
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        Trainer(_cfg(f"--model.factory={FACTORY}:not_a_module"))
    # The factory model's own vocabulary is what the dataset is checked against.
    with pytest.raises(VocabMismatchError, match=f"{FACTORY}:mixer"):
        Trainer(_cfg(f"--model.factory={FACTORY}:mixer", f"--data.source=tokens:{pydoc_tokens}"))


def test_a_plain_user_module_trains_on_real_tokens_with_eval(pydoc_tokens: Path,
                                                             tmp_path: Path) -> None:
    from relight.runtime.train import run_training

    metrics = tmp_path / "m.jsonl"
    res = run_training(_cfg(f"--model.factory={FACTORY}:mixer", "--model.vocab_size=257",
                            f"--data.source=tokens:{pydoc_tokens}", "--train.steps=12",
                            "--data.eval_every=6", "--data.eval_samples=16",
                            f"--train.metrics_path={metrics}"))
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert [r["step"] for r in recs if "eval_loss" in r] == [6, 12]
    assert res.losses[-1] < res.losses[0] - 1.0, res.losses
    assert evals[-1] < evals[0] and evals[-1] < 5.0, evals


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.long
@pytest.mark.multirank
def test_hf_causal_lm_fsdp_checkpoint_resume_and_reshard(rank_pool: RankPool,
                                                         pydoc_tokens: Path,
                                                         tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    ck = tmp_path / "ck"
    common = [f"--model.factory={FACTORY}:hf_llama", "--model.vocab_size=257",
              "--model.n_layers=2", f"--data.source=tokens:{pydoc_tokens}", "--train.steps=6",
              "--checkpoint.every=3", "--checkpoint.async_save=false", "--parallel.dp_shard=-1"]
    case = "tests.runtime.cases:train"
    ref = rank_pool.run(case, 2, config=CONFIG, overrides=common, dump=True)
    first = rank_pool.run(case, 2, config=CONFIG,
                          overrides=[*common, f"--checkpoint.url={ck}", "--train.stop_at=3"])
    assert first[0]["final_step"] == 3
    shutil.copytree(ck, tmp_path / "ck3")
    # Same layout: the resumed run ends bitwise equal to the uninterrupted one.
    same = rank_pool.run(case, 2, config=CONFIG, overrides=[*common, f"--checkpoint.url={ck}"],
                         dump=True)
    assert same[0]["restored_step"] == 3 and same[0]["losses"] == ref[0]["losses"][3:]
    for r in range(2):
        assert _state_equal(same[r]["state"], ref[r]["state"])
    # Another world size (4 ranks, FSDP over 4): the step-3 checkpoint reshards and the run
    # continues within floating-point tolerance of the reference.
    other = rank_pool.run(case, 4, config=CONFIG,
                          overrides=[*common, f"--checkpoint.url={tmp_path / 'ck3'}"], dump=True)
    assert other[0]["restored_step"] == 3 and other[0]["final_step"] == 6
    assert other[0]["losses"] == pytest.approx(ref[0]["losses"][3:], rel=1e-4)
    for name, want in ref[0]["state"].items():
        if name.startswith("model/"):
            torch.testing.assert_close(other[0]["state"][name], want, rtol=1e-4, atol=1e-5)


def eval_case(overrides: list[str]) -> dict:
    """Rank-pool case: the held-out loss of the initial model, and 3 training losses."""
    from relight.runtime.train import Trainer

    trainer = Trainer(_cfg(*overrides))
    try:
        before = trainer.evaluate()
        losses = [trainer.train_step()["loss"] for _ in range(3)]
        return {"eval": before, "losses": losses, "layout": trainer.layout.describe()}
    finally:
        trainer.close()


@pytest.mark.multirank
def test_eval_loss_and_factory_tp_agree_across_layouts(rank_pool: RankPool,
                                                       pydoc_tokens: Path) -> None:
    data = [f"--data.source=tokens:{pydoc_tokens}", "--data.eval_samples=10",
            "--data.eval_fraction=0.05"]
    case = "tests.runtime.test_models:eval_case"
    # The runtime's transformer: one process, FSDP over 2, HSDP 2 x 2 (10 samples do not
    # split evenly over its 4 data ranks).
    llama = [*data, "--model.vocab_size=257"]
    ref = rank_pool.run(case, 1, overrides=llama)[0]
    for world, extra in ((2, []), (4, ["--parallel.dp_replicate=2"])):
        got = rank_pool.run(case, world, overrides=[*llama, *extra])[0]
        assert got["eval"] == pytest.approx(ref["eval"], rel=1e-5), got["layout"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4), got["layout"]
    # A factory model with its own TP plan: tp2 matches one process.
    tp = [*data, "--model.vocab_size=257", f"--model.factory={FACTORY}:mixer_tp"]
    ref = rank_pool.run(case, 1, overrides=tp)[0]
    got = rank_pool.run(case, 2, overrides=[*tp, "--parallel.tp=2"])[0]
    assert got["layout"] != ref["layout"]
    assert got["eval"] == pytest.approx(ref["eval"], rel=1e-5)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    with pytest.raises(Exception, match="relight_tp_plan"):
        rank_pool.run(case, 2, overrides=[*tp[:-1], f"--model.factory={FACTORY}:mixer",
                                          "--parallel.tp=2"])
