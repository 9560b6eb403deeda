"""Token datasets: `relight data prepare` (byte-level, trained BPE, a local tokenizer.json;
resumable, parallel, split files) and the dataset read by global sample index (a pure
function of (seed, i), the same global batches under every DP size, checksums, vocab)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relight.runtime.config import ConfigError, DataConfig, ModelConfig
from relight.runtime.data import BatchPlan, DataLoader, build_corpus
from relight.runtime.prepare import PrepareError, main, plan_segments, plan_shards, prepare
from relight.runtime.tokenizer import BYTE_EOS, load_tokenizer
from relight.runtime.tokens import (
    ChecksumError,
    DatasetError,
    Permutation,
    TokenDataset,
    TokenIndex,
    VocabMismatchError,
)

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "hex and pack boxes of liquor jugs").split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 80)))) + f" doc{i}."
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    texts = _texts(120)
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                             for i, t in enumerate(texts[:80])))
    for k in range(4):
        (root / "txt").mkdir(exist_ok=True)
        (root / "txt" / f"f{k}.txt").write_text("\n".join(texts[80 + 10 * k: 90 + 10 * k]))
    return {"root": root, "jsonl": jsonl, "txt": root / "txt"}


@pytest.fixture(scope="module")
def byte_ds(corpus_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("byte") / "ds"
    prepare([str(corpus_files["jsonl"]), str(corpus_files["txt"])], tokenizer="byte", out=out,
            workers=1)
    return out


def _stream(root: Path) -> np.ndarray:
    index = TokenIndex.read(root)
    return np.concatenate([np.fromfile(root / s.file, dtype=index.dtype)
                           for s in index.shards])


# ---- preparation -----------------------------------------------------------------------


def test_byte_prepare_packs_documents_with_eos(byte_ds: Path,
                                               corpus_files: dict[str, Path]) -> None:
    index = TokenIndex.read(byte_ds)
    assert index.dtype == "uint16" and index.tokenizer.kind == "byte"
    assert index.vocab_size == 257 and index.tokenizer.eos_id == BYTE_EOS
    # Small inputs are packed into one shard: 80 JSONL lines, then 4 text files.
    assert [s.documents for s in index.shards] == [84]
    assert index.shards[0].source.endswith("(5 inputs)")
    stream = np.fromfile(byte_ds / index.shards[0].file, dtype=np.uint16)
    assert (stream == BYTE_EOS).sum() == 84 and stream[-1] == BYTE_EOS
    want = [json.loads(line)["text"] for line in corpus_files["jsonl"].read_text().splitlines()]
    want += [(corpus_files["txt"] / f"f{k}.txt").read_text() for k in range(4)]
    eos = np.flatnonzero(stream == BYTE_EOS)
    starts = np.concatenate([[0], eos[:-1] + 1])
    got = [bytes(stream[a:b].astype(np.uint8)).decode() for a, b in zip(starts, eos,
                                                                                strict=True)]
    assert got == want
    assert index.total_tokens == len(stream) == index.shards[0].text_bytes + 84


def test_parallel_and_split_preparation_write_the_same_tokens(
        corpus_files: dict[str, Path], byte_ds: Path, tmp_path: Path) -> None:
    inputs = [str(corpus_files["jsonl"]), str(corpus_files["txt"])]
    # Files cut into ~2 kB segments at line ends, and shards of ~2 kB: many shards, the same
    # token stream; 2 worker processes write exactly what 1 does.
    segs = plan_segments([corpus_files["jsonl"]], 2000)
    assert len(segs) > 3 and all(p.start < p.end for p in segs)
    assert [p.end for p in segs[:-1]] == [p.start for p in segs[1:]] and segs[-1].last
    shards = plan_shards([corpus_files["jsonl"], *sorted(corpus_files["txt"].iterdir())], 4000)
    assert all(sum(s.size for s in shard) <= 4000 + 2000 for shard in shards)
    one, two = tmp_path / "one", tmp_path / "two"
    prepare(inputs, tokenizer="byte", out=one, workers=1, shard_mb=0.002)
    prepare(inputs, tokenizer="byte", out=two, workers=2, shard_mb=0.002)
    assert len(TokenIndex.read(one).shards) > 5
    assert TokenIndex.read(one) == TokenIndex.read(two)
    assert np.array_equal(_stream(one), _stream(byte_ds))


def test_prepare_resumes_only_the_missing_shards(corpus_files: dict[str, Path],
                                                 byte_ds: Path, tmp_path: Path) -> None:
    out, whole = tmp_path / "ds", tmp_path / "whole"
    inputs = [str(corpus_files["jsonl"]), str(corpus_files["txt"])]
    prepare(inputs, tokenizer="byte", out=out, workers=1, shard_mb=0.004)
    prepare(inputs, tokenizer="byte", out=whole, workers=1, shard_mb=0.004)
    n = len(TokenIndex.read(whole).shards)
    assert n >= 5
    # An interruption: no index yet, one shard unrecorded, one whose size disagrees with its
    # record, one half-written (a temporary file, never renamed).
    (out / "index.json").unlink()
    (out / "shard-00002.json").unlink()
    (out / "shard-00003.bin").write_bytes(b"\x00\x01")
    (out / "shard-00004.json").unlink()
    (out / "shard-00004.bin").rename(out / "shard-00004.bin.tmp")
    with open(out / "shard-00004.bin.tmp", "r+b") as fh:
        fh.truncate(5)
    stats = prepare(inputs, tokenizer="byte", out=out, workers=1, shard_mb=0.004)
    assert stats.reused_shards == n - 3 and stats.shards == n
    assert TokenIndex.read(out) == TokenIndex.read(whole)
    assert np.array_equal(_stream(out), _stream(byte_ds))
    # The same command on a finished dataset encodes nothing.
    assert prepare(inputs, tokenizer="byte", out=out, workers=1,
                   shard_mb=0.004).reused_shards == n
    with pytest.raises(PrepareError, match="other inputs or another tokenizer"):
        prepare(inputs, tokenizer="train:300", out=out, shard_mb=0.004)


def test_trained_bpe_and_its_tokenizer_json(corpus_files: dict[str, Path],
                                            tmp_path: Path) -> None:
    out = tmp_path / "bpe"
    stats = prepare([str(corpus_files["jsonl"])], tokenizer="train:320", out=out, workers=1)
    index = TokenIndex.read(out)
    assert index.tokenizer.kind == "hf" and index.vocab_size == 320
    assert index.tokenizer.name == "train:320"
    tok = load_tokenizer(str(out / "tokenizer.json"))
    assert (tok.info.sha256, tok.info.vocab_size, tok.info.eos_id) == (
        index.tokenizer.sha256, 320, index.tokenizer.eos_id)
    assert stats.tokens < 0.5 * TokenIndex.read(out).shards[0].text_bytes  # merges learned
    ds = TokenDataset(out, seq_len=24, seed=3)
    window = ds.samples(5, 1)[0].tolist()
    text = tok.decode(w for w in window if w != index.tokenizer.eos_id)
    source = "".join(json.loads(line)["text"]
                     for line in corpus_files["jsonl"].read_text().splitlines())
    assert text in source
    # The written tokenizer.json, given back as --tokenizer, encodes the same tokens.
    again = tmp_path / "again"
    prepare([str(corpus_files["jsonl"])], tokenizer=str(out / "tokenizer.json"), out=again,
            workers=1)
    assert np.array_equal(_stream(again), _stream(out))
    assert TokenIndex.read(again).tokenizer.sha256 == index.tokenizer.sha256


def test_cli_prepare_and_info(corpus_files: dict[str, Path], tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["prepare", str(corpus_files["txt"]), "--tokenizer", "byte", "--out", str(out),
                 "--no-progress"]) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert main(["info", str(out), "--verify"]) == 0
    assert "every shard matches" in capsys.readouterr().out
    assert main(["prepare", str(tmp_path / "nope.txt"), "--tokenizer", "byte", "--out",
                 str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["prepare", str(corpus_files["txt"]), "--tokenizer", "gpt2", "--out",
                 str(tmp_path / "y")]) == 2
    assert "nothing is downloaded" in capsys.readouterr().err


def test_bad_jsonl_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(PrepareError, match=r"line 2 .*'text'"):
        prepare([str(bad)], tokenizer="byte", out=tmp_path / "o", workers=1)


# ---- addressing --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5000), key=st.integers(0, 2**32))
def test_permutation_is_a_bijection(n: int, key: int) -> None:
    out = Permutation(n, (key,))(np.arange(n))
    assert np.array_equal(np.sort(out), np.arange(n))


def test_sample_is_a_pure_function_of_seed_and_index(byte_ds: Path) -> None:
    a = TokenDataset(byte_ds, seq_len=16, seed=7, eval_fraction=0.1)
    b = TokenDataset(byte_ds, seq_len=16, seed=7, eval_fraction=0.1)
    assert a.samples(100, 8).dtype == torch.int64 and a.samples(100, 8).shape == (8, 17)
    assert torch.equal(a.samples(100, 8), b.samples(100, 8))
    assert torch.equal(a.samples(103, 2), a.samples(100, 8)[3:5])
    assert not torch.equal(a.samples(0, 8), TokenDataset(byte_ds, seq_len=16, seed=8,
                                                         eval_fraction=0.1).samples(0, 8))
    # Windows are read where the index says: window w starts at token w * seq_len.
    stream = _stream(byte_ds)
    w = int(a.train_windows(42, 1)[0])
    ends = np.cumsum([(s.tokens - 1) // 16 for s in a.index.shards])
    shard = int(np.searchsorted(ends, w, side="right"))
    base = sum(s.tokens for s in a.index.shards[:shard])
    local = w - (int(ends[shard - 1]) if shard else 0)
    want = stream[base + local * 16: base + local * 16 + 17].astype(np.int64)
    assert np.array_equal(a.samples(42, 1)[0].numpy(), want)


def test_every_epoch_reads_each_training_window_once_and_never_a_held_out_one(
        byte_ds: Path) -> None:
    ds = TokenDataset(byte_ds, seq_len=32, seed=1, eval_fraction=0.05)
    assert ds.n_eval >= 1 and ds.n_train + ds.n_eval == ds.n_windows
    held = set(ds.eval_windows(0, ds.n_eval).tolist())
    assert len(held) == ds.n_eval
    e0 = ds.train_windows(0, ds.n_train)
    e1 = ds.train_windows(ds.n_train, ds.n_train)
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == sorted(set(range(ds.n_windows)) - held)
    assert not np.array_equal(e0, e1)  # each epoch has its own order
    # The split does not depend on the seed of the order.
    other = TokenDataset(byte_ds, seq_len=32, seed=99, eval_fraction=0.05)
    assert set(other.eval_windows(0, other.n_eval).tolist()) == held


def _global_batch(ds: TokenDataset, dp: int, position: int) -> torch.Tensor:
    parts = []
    for r in range(dp):
        loader = DataLoader(ds, BatchPlan(global_batch=16, micro_batch=2, dp=dp, dp_rank=r),
                            position)
        parts += [torch.cat([x, y[:, -1:]], dim=1) for x, y, _ in loader.next_step()]
    return torch.cat(parts)


def test_resume_under_another_dp_size_reads_the_same_samples(byte_ds: Path) -> None:
    ds = TokenDataset(byte_ds, seq_len=16, seed=5, eval_fraction=0.02)
    # An uninterrupted dp=2 run for 6 steps, against dp=2 for 3 steps then dp=4 (and 1, 3, 5
    # and 8: uneven shares read the same samples too).
    straight = [_global_batch(ds, 2, 16 * s) for s in range(6)]
    for dp in (1, 3, 4, 5, 8):
        assert all(torch.equal(_global_batch(ds, dp, 16 * s), straight[s]) for s in range(3, 6))
    # Across an epoch boundary too.
    end = ds.n_train - 5
    assert torch.equal(_global_batch(ds, 4, end), ds.samples(end, 16))


def test_checksums_and_sizes_are_verified(byte_ds: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(byte_ds, copy)
    shard = copy / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"shard-00000\.bin: crc32c"):
        TokenDataset(copy, seq_len=16, seed=0)
    TokenDataset(copy, seq_len=16, seed=0, verify=False)  # an operator may skip the check
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DatasetError, match="the index says"):
        TokenDataset(copy, seq_len=16, seed=0, verify=False)
    with pytest.raises(DatasetError, match="relight data prepare"):
        TokenDataset(tmp_path / "missing", seq_len=16, seed=0)
    with pytest.raises(DatasetError, match="not one training window"):
        TokenDataset(byte_ds, seq_len=10**7, seed=0)


def test_vocab_mismatch_is_a_config_error(byte_ds: Path) -> None:
    cfg = DataConfig(source=f"tokens:{byte_ds}", seq_len=16)
    with pytest.raises(VocabMismatchError, match="--model.vocab_size=257") as e:
        build_corpus(cfg, model_vocab=64)
    assert isinstance(e.value, ConfigError)
    assert build_corpus(cfg, model_vocab=320).vocab_size == 257  # a padded vocab is fine


def test_train_cli_exits_2_on_a_vocab_mismatch(byte_ds: Path) -> None:
    from relight.exit_codes import CONFIG_EXIT_CODE
    from relight.runtime.train import main as train_main

    config = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
    assert train_main(["--config", config, f"--data.source=tokens:{byte_ds}",
                       "--train.steps=1"]) == CONFIG_EXIT_CODE


def test_data_and_model_config_validation() -> None:
    with pytest.raises(ConfigError, match="tokens:DIR"):
        DataConfig(source="tokens:")
    with pytest.raises(ConfigError, match="tokens:DIR"):
        DataConfig(source="/some/dir")
    assert DataConfig(source="tokens:/d").tokens_dir == "/d"
    with pytest.raises(ConfigError, match="package.module:function"):
        ModelConfig(factory="not a path")
    with pytest.raises(ConfigError, match="eval_fraction"):
        DataConfig(eval_fraction=1.0)


def test_synthetic_corpus_has_a_held_out_split() -> None:
    ds = build_corpus(DataConfig(seq_len=16), model_vocab=64)
    train = ds.samples(0, 64)
    held = ds.eval_samples(0, 64)
    assert held.shape == train.shape and not torch.equal(held, train)
    assert torch.equal(ds.eval_samples(3, 2), held[3:5])


def test_parquet_and_arrow_inputs_through_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    texts = _texts(12, seed=4)
    ds = datasets.Dataset.from_dict({"body": texts, "n": list(range(12))})
    ds.to_parquet(str(tmp_path / "t.parquet"))
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    prepare([str(tmp_path / "t.parquet")], tokenizer="byte", out=tmp_path / "pq",
            text_field="body", workers=1)
    prepare([str(jsonl)], tokenizer="byte", out=tmp_path / "js", text_field="body", workers=1)
    assert np.array_equal(_stream(tmp_path / "pq"), _stream(tmp_path / "js"))
    assert TokenIndex.read(tmp_path / "pq").shards[0].documents == 12
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = sorted((tmp_path / "saved").glob("*.arrow"))
    prepare([str(a) for a in arrow], tokenizer="byte", out=tmp_path / "ar", text_field="body",
            workers=1)
    assert np.array_equal(_stream(tmp_path / "ar"), _stream(tmp_path / "js"))
    with pytest.raises(PrepareError, match="no column 'text'"):
        prepare([str(tmp_path / "t.parquet")], tokenizer="byte", out=tmp_path / "bad",
                workers=1)


def test_the_main_jobs_corpus_and_config(tmp_path: Path) -> None:
    from relight.runtime.config import load_config
    from relight.runtime.prepare import write_pydoc_topics

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "text.toml")
    assert cfg.data.tokens_dir == "runs/data/pydoc-topics-byte" and cfg.model.vocab_size == 257
    docs, size = write_pydoc_topics(tmp_path / "t.jsonl")
    assert docs > 50 and size > 300_000  # every CPython ships the topics
    stats = prepare([str(tmp_path / "t.jsonl")], tokenizer="byte", out=tmp_path / "ds",
                    workers=1)
    assert stats.tokens == size + docs
    ds = build_corpus(dataclasses.replace(cfg.data, source=f"tokens:{tmp_path / 'ds'}"),
                      model_vocab=cfg.model.vocab_size)
    assert 2.5 < ds.unigram_entropy() < 4.0  # English text as bytes
