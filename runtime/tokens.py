"""Token datasets: memory-mapped token shards plus a JSON index, read by global sample index.

On disk (written by ``relight data prepare``, `runtime.prepare`)::

    DIR/index.json         TokenIndex: format, dtype, tokenizer identity, one entry per shard
    DIR/shard-00000.bin    the shard's tokens, a flat little-endian uint16 or uint32 array
    DIR/tokenizer.json     the tokenizer (when it is a Hugging Face one, given or trained)

Each document's tokens are followed by the tokenizer's end-of-document id, so a shard is a
stream of packed documents. A dataset is local and read through ``np.memmap``: the page cache
holds what training touches and nothing is copied up front.

Sample addressing (:class:`TokenDataset`): shard ``s`` is cut into ``(tokens_s - 1) //
seq_len`` windows of ``seq_len + 1`` tokens at stride ``seq_len`` (a window's last token is
the next one's first; a shard's tail shorter than a window is unused). Windows are numbered
globally, shard after shard. A fixed permutation of all windows, independent of the seed,
puts the first ``n_eval`` in the held-out split and the rest in the training split. Training
sample ``i`` is, in epoch ``e = i // n_train``, training window ``P_e(i % n_train)``, where
``P_e`` is a permutation keyed by ``(seed, e)``. Both permutations are Feistel networks with
cycle walking: a bijection on ``[0, n)`` computed per index, with no table, so sample ``i`` is
a pure function of ``(seed, i)`` for any dataset size and ``samples(start, count)`` costs
``count`` small reads. A run resumed at data position ``P`` after any change of the number
of data-parallel ranks reads exactly the samples an uninterrupted run would.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from relight.runtime.config import ConfigError

if TYPE_CHECKING:
    import torch
from relight.runtime.tokenizer import TokenizerError, TokenizerInfo

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "ChecksumError",
    "DatasetError",
    "Permutation",
    "ShardInfo",
    "TokenDataset",
    "TokenIndex",
    "VocabMismatchError",
    "check_vocab",
    "dtype_for",
    "shard_crc32c",
]

FORMAT = "relight-tokens"
VERSION = 1
INDEX_FILE = "index.json"
_DTYPES = ("uint16", "uint32")
_SPLIT_KEY = 0x5B117
"""Key of the held-out split's permutation: the split is a property of the dataset and
``eval_fraction``, the same whatever ``data.seed`` is."""


class DatasetError(ConfigError):
    """A token dataset is missing, malformed or damaged; the message names the file."""


class ChecksumError(DatasetError):
    """A shard's bytes do not match the crc32c its index records."""


class VocabMismatchError(DatasetError):
    """The model's vocabulary cannot hold the dataset's token ids."""


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds ids ``0 .. vocab_size - 1``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def check_vocab(model_vocab: int, data_vocab: int, *, source: str, model: str = "") -> None:
    """Raise :class:`VocabMismatchError` unless the model can embed every data token id (a
    larger model vocabulary, e.g. padded to a multiple of 64, is fine)."""
    if model_vocab < data_vocab:
        what = f"model {model!r}" if model else "model.vocab_size"
        raise VocabMismatchError(
            f"{what} has {model_vocab} token ids but the dataset {source} was tokenized with "
            f"{data_vocab}: set --model.vocab_size={data_vocab} (or larger), or prepare the "
            "data with a tokenizer of the model's vocabulary")


@dataclass(frozen=True, slots=True)
class ShardInfo:
    file: str
    """File name inside the dataset directory."""
    tokens: int
    """Tokens in the shard (end-of-document ids included)."""
    documents: int
    """Documents packed into the shard."""
    crc32c: int
    """crc32c of the shard file's bytes."""
    source: str = ""
    """The input it was made from (path and, for a part of a file, the byte range)."""
    text_bytes: int = 0
    """Bytes of input text the shard holds."""

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "tokens": self.tokens, "documents": self.documents,
                "crc32c": self.crc32c, "source": self.source, "text_bytes": self.text_bytes}

    @classmethod
    def from_json(cls, raw: Any) -> ShardInfo:
        try:
            info = cls(file=str(raw["file"]), tokens=int(raw["tokens"]),
                       documents=int(raw["documents"]), crc32c=int(raw["crc32c"]),
                       source=str(raw.get("source", "")),
                       text_bytes=int(raw.get("text_bytes", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"shard entry {raw!r} is malformed: {e}") from None
        if "/" in info.file or info.file.startswith(".") or info.tokens < 0:
            raise DatasetError(f"shard entry {raw!r}: file must be a plain name in the "
                               "dataset directory and tokens >= 0")
        return info


@dataclass(frozen=True, slots=True)
class TokenIndex:
    dtype: str
    """``uint16`` or ``uint32``."""
    tokenizer: TokenizerInfo
    shards: tuple[ShardInfo, ...]

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "dtype": self.dtype,
                "tokenizer": self.tokenizer.to_json(),
                "total_tokens": self.total_tokens,
                "shards": [s.to_json() for s in self.shards]}

    @classmethod
    def from_json(cls, raw: Any, *, where: str = "index") -> TokenIndex:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise DatasetError(f"{where} is not a {FORMAT} index (format "
                               f"{raw.get('format') if isinstance(raw, dict) else raw!r})")
        if raw.get("version") != VERSION:
            raise DatasetError(f"{where}: version {raw.get('version')!r}, this build reads "
                               f"version {VERSION}")
        if raw.get("dtype") not in _DTYPES:
            raise DatasetError(f"{where}: dtype {raw.get('dtype')!r} is not one of {_DTYPES}")
        try:
            tok = TokenizerInfo.from_json(raw.get("tokenizer"))
        except TokenizerError as e:
            raise DatasetError(f"{where}: {e}") from None
        shards = raw.get("shards")
        if not isinstance(shards, list) or not shards:
            raise DatasetError(f"{where}: no shards")
        index = cls(dtype=raw["dtype"], tokenizer=tok,
                    shards=tuple(ShardInfo.from_json(s) for s in shards))
        if np.iinfo(index.dtype).max < tok.vocab_size - 1:
            raise DatasetError(f"{where}: dtype {index.dtype} cannot hold "
                               f"{tok.vocab_size} token ids")
        return index

    def write(self, root: str | Path) -> None:
        """Write ``root/index.json`` atomically (a temporary file, then a rename)."""
        path = Path(root) / INDEX_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def read(cls, root: str | Path) -> TokenIndex:
        path = Path(root) / INDEX_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DatasetError(f"no token dataset at {root}: {path} does not exist (run "
                               f"`relight data prepare INPUT... --out {root}`)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DatasetError(f"cannot read {path}: {e}") from None
        return cls.from_json(raw, where=str(path))


def shard_crc32c(array: np.ndarray, value: int = 0) -> int:
    """crc32c of a shard's bytes (the checksum the index records), continuing from ``value``.

    The same crc32c as ``storage.checksum``, called here directly: importing the ``storage``
    package loads tensorstore (about 1.2 s), which every data-preparation worker would pay."""
    data = np.ascontiguousarray(array).view(np.uint8)
    if not data.size:
        return value
    try:
        import crc32c
    except ImportError:  # pragma: no cover - the fallback, as in storage.checksum
        import google_crc32c

        return int(google_crc32c.extend(value, data.tobytes()))
    return int(crc32c.crc32c(data, value))


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Permutation:
    """A keyed bijection on ``[0, n)``, evaluated per index: a 4-round Feistel network on
    the smallest even number of bits covering ``n``, with cycle walking (an image outside
    ``[0, n)`` is permuted again until it falls inside; the domain is < 4n, so that takes a
    few rounds on average)."""

    def __init__(self, n: int, key: tuple[int, ...]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self.half = max(1, math.ceil(math.log2(n) / 2)) if n > 1 else 1
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence(list(key)).generate_state(4, dtype=np.uint64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << h) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"permutation of {self.n} indexed outside [0, {self.n})")
        out = self._feistel(idx.astype(np.uint64))
        bad = out >= np.uint64(self.n)
        while bad.any():
            out[bad] = self._feistel(out[bad])
            bad = out >= np.uint64(self.n)
        return out.astype(np.int64)


class TokenDataset:
    """A prepared token dataset, addressed by global sample index (see the module doc).

    ``samples(start, count)`` and ``eval_samples(start, count)`` return int64
    ``[count, seq_len + 1]`` windows, the interface `runtime.data.DataLoader` reads."""

    def __init__(self, root: str | Path, *, seq_len: int, seed: int,
                 eval_fraction: float = 0.0, verify: bool = True) -> None:
        self.root = Path(root)
        self.seq_len = seq_len
        self.seed = seed
        self.index = TokenIndex.read(self.root)
        self.vocab_size = self.index.vocab_size
        self._arrays = [self._open(s, verify) for s in self.index.shards]
        per_shard = np.array([max(0, (s.tokens - 1) // seq_len) for s in self.index.shards],
                             dtype=np.int64)
        self._ends = np.cumsum(per_shard)
        self.n_windows = int(self._ends[-1])
        self.n_eval = (min(self.n_windows - 1, max(1, round(eval_fraction * self.n_windows)))
                       if eval_fraction > 0 else 0)
        self.n_train = self.n_windows - self.n_eval
        if self.n_train < 1:
            raise DatasetError(
                f"token dataset {self.root} holds {self.index.total_tokens} tokens: not one "
                f"training window of {seq_len + 1} tokens (lower data.seq_len or add data)")
        self._split = Permutation(self.n_windows, (_SPLIT_KEY,))
        self._epochs: dict[int, Permutation] = {}

    def _open(self, shard: ShardInfo, verify: bool) -> np.ndarray:
        path = self.root / shard.file
        itemsize = np.dtype(self.index.dtype).itemsize
        try:
            size = path.stat().st_size
        except OSError as e:
            raise DatasetError(f"shard {path} of {self.root / INDEX_FILE}: {e}") from None
        if size != shard.tokens * itemsize:
            raise DatasetError(f"shard {path} has {size} bytes; the index says {shard.tokens} "
                               f"{self.index.dtype} tokens ({shard.tokens * itemsize} bytes)")
        if shard.tokens == 0:
            return np.zeros(0, dtype=self.index.dtype)
        arr = np.memmap(path, dtype=np.dtype(self.index.dtype).newbyteorder("<"), mode="r",
                        shape=(shard.tokens,))
        if verify:
            got = shard_crc32c(arr)
            if got != shard.crc32c:
                raise ChecksumError(f"shard {path}: crc32c {got:#010x}, the index records "
                                    f"{shard.crc32c:#010x}; the file is damaged (prepare the "
                                    "dataset again)")
        return arr

    # ---- addressing ----------------------------------------------------------------------

    def _epoch(self, e: int) -> Permutation:
        perm = self._epochs.get(e)
        if perm is None:
            if len(self._epochs) > 8:
                self._epochs.clear()
            perm = self._epochs[e] = Permutation(self.n_train, (self.seed, e))
        return perm

    def train_windows(self, start: int, count: int) -> np.ndarray:
        """Global window numbers of training samples ``start .. start+count-1``."""
        i = np.arange(start, start + count, dtype=np.int64)
        epochs, j = np.divmod(i, self.n_train)
        local = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            local[sel] = self._epoch(int(e))(j[sel])
        return self._split(local + self.n_eval)

    def eval_windows(self, start: int, count: int) -> np.ndarray:
        """Global window numbers of held-out samples ``start ..`` (modulo the split's size)."""
        if self.n_eval == 0:
            raise DatasetError(f"token dataset {self.root}: no held-out split "
                               "(data.eval_fraction is 0)")
        return self._split(np.arange(start, start + count, dtype=np.int64) % self.n_eval)

    def _read(self, windows: np.ndarray) -> torch.Tensor:
        import torch  # lazily: data preparation workers import this module without torch

        out = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        shard = np.searchsorted(self._ends, windows, side="right")
        first = windows - np.concatenate([[0], self._ends])[shard]
        span = np.arange(self.seq_len + 1)
        for s in np.unique(shard).tolist():
            rows = shard == s
            out[rows] = self._arrays[s][first[rows, None] * self.seq_len + span]
        return torch.from_numpy(out)

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Training samples ``start .. start+count-1`` as int64 ``[count, seq_len + 1]``."""
        return self._read(self.train_windows(start, count))

    def eval_samples(self, start: int, count: int) -> torch.Tensor:
        """Held-out samples ``start .. start+count-1`` as int64 ``[count, seq_len + 1]``."""
        return self._read(self.eval_windows(start, count))

    def unigram_entropy(self, max_tokens: int = 50_000_000) -> float:
        """Entropy (nats) of the token distribution, over at most ``max_tokens`` tokens
        (a prefix of every shard, in proportion): what a unigram model reaches."""
        total = self.index.total_tokens
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for arr in self._arrays:
            n = len(arr) if total <= max_tokens else len(arr) * max_tokens // total
            counts += np.bincount(np.asarray(arr[:n]), minlength=self.vocab_size)[
                :self.vocab_size]
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())
