"""Tokenizers for ``relight data prepare``: byte-level, a local Hugging Face ``tokenizer.json``,
or a byte-level BPE trained on the input itself. Nothing here downloads anything.

A tokenizer is named by a spec string:

``byte``
    UTF-8 bytes as ids 0..255 and an end-of-document id 256 (vocabulary 257); needs no files.
``PATH/tokenizer.json`` (or ``hf:PATH``)
    A Hugging Face ``tokenizers`` file, read locally (a directory holding ``tokenizer.json``
    works too). The end-of-document id is the first special token among ``EOS_NAMES``.
``train:VOCAB``
    A byte-level BPE of ``VOCAB`` ids trained on the prepared input (``train_bpe``), written
    next to the token shards as ``tokenizer.json`` so the dataset carries its tokenizer.

Every tokenizer has a :class:`TokenizerInfo`: its kind, vocabulary size, end-of-document id
and, for file-based ones, the sha256 of the ``tokenizer.json`` bytes, which the dataset index
records so a dataset is never read with a tokenizer other than the one that wrote it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from relight.errors import RelightError

__all__ = [
    "BYTE_EOS",
    "EOS_NAMES",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerError",
    "TokenizerInfo",
    "load_tokenizer",
    "parse_train_spec",
    "train_bpe",
]

BYTE_EOS = 256
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
"""Special tokens taken as the end-of-document marker, first match wins."""


class TokenizerError(RelightError, ValueError):
    """A tokenizer spec or file is unusable; the message names it and what to do."""


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    kind: str
    """``byte`` or ``hf`` (a ``tokenizer.json``, given or trained)."""
    vocab_size: int
    """Number of token ids (the model's ``vocab_size`` must be at least this)."""
    eos_id: int | None
    """Id appended after every document; None when the tokenizer has none."""
    sha256: str = ""
    """sha256 of the ``tokenizer.json`` bytes (empty for ``byte``)."""
    name: str = ""
    """Where it came from: ``byte``, the file's name, or ``train:VOCAB``."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> TokenizerInfo:
        if not isinstance(raw, dict):
            raise TokenizerError(f"tokenizer info must be an object, got {raw!r}")
        try:
            info = cls(kind=str(raw["kind"]), vocab_size=int(raw["vocab_size"]),
                       eos_id=None if raw.get("eos_id") is None else int(raw["eos_id"]),
                       sha256=str(raw.get("sha256", "")), name=str(raw.get("name", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise TokenizerError(f"tokenizer info {raw!r} is malformed: {e}") from None
        if info.kind not in ("byte", "hf") or info.vocab_size < 1:
            raise TokenizerError(f"tokenizer info {raw!r}: unknown kind or empty vocabulary")
        return info


class Tokenizer(Protocol):
    info: TokenizerInfo

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no end-of-document id appended)."""
        ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes; id 256 ends a document."""

    info = TokenizerInfo(kind="byte", vocab_size=257, eos_id=BYTE_EOS, name="byte")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", "replace"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")


def _require_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("this tokenizer needs the `tokenizers` package: "
                             "pip install tokenizers (or use --tokenizer byte)") from None
    return tokenizers


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: str | Path, *, name: str = "") -> None:
        tokenizers = _require_tokenizers()
        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # OSError, UnicodeDecodeError, or the Rust side's Exception
            raise TokenizerError(f"cannot read tokenizer file {self.path}: {e}") from None
        eos = None
        for special in EOS_NAMES:
            eos = self._tok.token_to_id(special)
            if eos is not None:
                break
        self.info = TokenizerInfo(kind="hf", vocab_size=self._tok.get_vocab_size(
            with_added_tokens=True), eos_id=eos, sha256=hashlib.sha256(raw).hexdigest(),
            name=name or self.path.name)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | Path) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` included) on ``texts``
    and write it to ``out_path`` (atomically: a temporary file, then a rename)."""
    tokenizers = _require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise TokenizerError(f"train:{vocab_size}: a byte-level BPE needs at least 258 ids "
                             "(256 bytes, the end-of-document token and one merge)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_NAMES[0]], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(tok.to_str(), encoding="utf-8")
    os.replace(tmp, out_path)
    return HFTokenizer(out_path, name=f"train:{vocab_size}")


def parse_train_spec(spec: str) -> int | None:
    """``train:VOCAB`` -> VOCAB; anything else -> None."""
    if not spec.startswith("train:"):
        return None
    try:
        vocab = int(spec.split(":", 1)[1])
    except ValueError:
        raise TokenizerError(f"--tokenizer {spec!r}: expected train:VOCAB, e.g. "
                             "train:4096") from None
    return vocab


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer named by ``spec`` (``byte`` or a ``tokenizer.json``; ``train:VOCAB`` is
    trained by ``relight data prepare``, not loaded)."""
    if spec == "byte":
        return ByteTokenizer()
    if parse_train_spec(spec) is not None:
        raise TokenizerError(f"{spec!r} is trained by `relight data prepare`; load the "
                             "tokenizer.json it wrote instead")
    path = Path(spec[3:] if spec.startswith("hf:") else spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"--tokenizer {spec!r}: no such file {path} (expected byte, "
                             "train:VOCAB, or a local tokenizer.json; nothing is downloaded)")
    return HFTokenizer(path)
