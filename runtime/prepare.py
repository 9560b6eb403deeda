"""``relight data prepare``: text, JSONL or Parquet/Arrow files into a token dataset.

    relight data prepare INPUT... --tokenizer byte|train:VOCAB|PATH/tokenizer.json --out DIR
    relight data info DIR [--verify]
    relight data pydoc-topics OUT.jsonl     (a real corpus that needs no network)

Inputs are files or directories (searched recursively for ``.txt .md .rst .py .jsonl .json
.parquet .arrow``). A text file is one document; a JSONL line is one document (its
``--text-field``); a Parquet or Arrow file (read through the ``datasets`` package, if
installed) gives one document per row. Large text and JSONL files are cut at line ends into
segments of about ``--shard-mb`` MB, and consecutive small files are packed together: each
shard holds about ``--shard-mb`` MB of input, and the shards are encoded by a pool of worker
processes (``--workers``). The format is in `runtime.tokens`.

Resumable: the plan (inputs with sizes and modification times, tokenizer, dtype) is written
to ``DIR/prepare.json`` first; each shard is written to a temporary file, renamed, then
recorded in its own ``shard-NNNNN.json``; ``index.json`` is written last. Run the same
command again after an interruption and only the missing shards are encoded. Nothing is
downloaded: tokenizers are byte-level, local files, or trained here on the input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relight.runtime.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
    parse_train_spec,
    train_bpe,
)
from relight.runtime.tokens import (
    INDEX_FILE,
    DatasetError,
    ShardInfo,
    TokenDataset,
    TokenIndex,
    dtype_for,
    shard_crc32c,
)

__all__ = ["PrepareError", "PrepareStats", "main", "prepare", "write_pydoc_topics"]

log = logging.getLogger(__name__)

PLAN_FILE = "prepare.json"
TOKENIZER_FILE = "tokenizer.json"
_EXTS = {".txt": "text", ".md": "text", ".rst": "text", ".py": "text", ".jsonl": "jsonl",
         ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_CHUNK = 1 << 20
"""Text is encoded in pieces of about this many bytes (cut at line ends)."""


class PrepareError(DatasetError):
    """An input or the output directory cannot be used; the message names which."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A file, or a run of its lines; shards are made of consecutive segments."""

    path: str
    kind: str
    """``text``, ``jsonl``, ``parquet`` or ``arrow``."""
    start: int
    end: int
    """Byte range of the file (the whole file for Parquet/Arrow)."""
    last: bool
    """The segment ends its file (a text file's end-of-document id goes after it)."""

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def source(self) -> str:
        return self.path if self.start == 0 and self.last else (
            f"{self.path}[{self.start}:{self.end}]")


@dataclass(slots=True)
class PrepareStats:
    shards: int = 0
    reused_shards: int = 0
    tokens: int = 0
    text_bytes: int = 0
    """Input bytes encoded by this call (resumed shards not counted)."""
    encoded_tokens: int = 0
    seconds: float = 0.0
    """Wall time of the encoding (tokenizer training not included)."""
    train_tokenizer_s: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.text_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.encoded_tokens / self.seconds if self.seconds > 0 else 0.0


def _kind(path: Path) -> str:
    return _EXTS.get(path.suffix.lower(), "text")


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files named by ``inputs`` (directories searched recursively for known extensions)."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _EXTS)
            if not found:
                raise PrepareError(f"input directory {p} holds no {sorted(_EXTS)} files")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise PrepareError(f"input {item!r} does not exist")
    return out


def plan_segments(files: list[Path], part_bytes: int) -> list[Segment]:
    """Cut each file into segments of about ``part_bytes`` at line ends."""
    parts: list[Segment] = []
    for f in files:
        kind, size = _kind(f), f.stat().st_size
        if kind in ("parquet", "arrow") or size <= part_bytes:
            parts.append(Segment(str(f), kind, 0, size, True))
            continue
        cuts = [0]
        with open(f, "rb") as fh:
            while cuts[-1] + part_bytes < size:
                fh.seek(cuts[-1] + part_bytes)
                fh.readline()
                if fh.tell() >= size:
                    break
                cuts.append(fh.tell())
        cuts.append(size)
        parts += [Segment(str(f), kind, a, b, b == size) for a, b in zip(cuts, cuts[1:],
                                                                           strict=False)]
    return parts


def plan_shards(files: list[Path], shard_bytes: int) -> list[tuple[Segment, ...]]:
    """Segments of at most about ``shard_bytes``, packed in order into shards of about
    ``shard_bytes`` each (a shard closes once it holds that much)."""
    shards: list[tuple[Segment, ...]] = []
    cur: list[Segment] = []
    size = 0
    for seg in plan_segments(files, shard_bytes):
        if cur and size + seg.size > shard_bytes:
            shards.append(tuple(cur))
            cur, size = [], 0
        cur.append(seg)
        size += seg.size
    if cur:
        shards.append(tuple(cur))
    return shards


def _source(segments: tuple[Segment, ...]) -> str:
    if len(segments) == 1:
        return segments[0].source
    return f"{segments[0].source} .. {segments[-1].source} ({len(segments)} inputs)"


def _lines_in(part: Segment) -> Iterator[bytes]:
    with open(part.path, "rb") as fh:
        fh.seek(part.start)
        pos = part.start
        while pos < part.end:
            line = fh.readline()
            if not line:
                return
            pos += len(line)
            yield line


def iter_pieces(part: Segment, text_field: str) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` pieces of a part, in order."""
    if part.kind == "text":
        buf: list[bytes] = []
        n = 0
        for line in _lines_in(part):
            buf.append(line)
            n += len(line)
            if n >= _CHUNK:
                yield b"".join(buf).decode("utf-8", "replace"), False
                buf, n = [], 0
        yield b"".join(buf).decode("utf-8", "replace"), part.last
    elif part.kind == "jsonl":
        lineno = 0
        for line in _lines_in(part):
            lineno += 1
            if not line.strip():
                continue
            try:
                value = json.loads(line)[text_field]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise PrepareError(f"{part.source}: line {lineno} is not a JSON object with a "
                                   f"string field {text_field!r} ({type(e).__name__}: {e})"
                                   ) from None
            if not isinstance(value, str):
                raise PrepareError(f"{part.source}: line {lineno}: field {text_field!r} is "
                                   f"{type(value).__name__}, not a string")
            yield value, True
    else:
        yield from ((t, True) for t in _table_texts(part, text_field))


def _table_texts(part: Segment, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"{part.path}: reading .{part.kind} files needs the `datasets` "
                           "package (pip install datasets)") from None
    if part.kind == "parquet":
        ds = datasets.Dataset.from_parquet(part.path, keep_in_memory=True)
    else:
        ds = datasets.Dataset.from_file(part.path, in_memory=True)
    if text_field not in ds.column_names:
        raise PrepareError(f"{part.path}: no column {text_field!r} (columns: "
                           f"{ds.column_names}); pass --text-field")
    for batch in ds.iter(batch_size=1024):
        for value in batch[text_field]:
            if value is not None:
                yield str(value)


_TOKENIZERS: dict[str, ByteTokenizer | HFTokenizer] = {}
"""A worker process's tokenizers by spec (loaded once, used for each shard it encodes)."""


def _tokenizer_from(spec: str) -> ByteTokenizer | HFTokenizer:
    tok = _TOKENIZERS.get(spec)
    if tok is None:
        tok = _TOKENIZERS[spec] = ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
    return tok


def encode_shard(segments: tuple[Segment, ...], tokenizer: str, dtype: str, out_dir: str,
                 file: str, text_field: str) -> ShardInfo:
    """Encode one shard's segments into ``out_dir/file`` (a temporary file, then a rename)
    and record it in ``out_dir/<file stem>.json``. Runs in a worker process."""
    tok = _tokenizer_from(tokenizer)
    eos = tok.info.eos_id
    out = Path(out_dir)
    tmp = out / (file + ".tmp")
    crc, tokens, docs, text_bytes = 0, 0, 0, 0
    batch: list[tuple[str, bool]] = []
    batch_bytes = 0

    def flush(fh: Any) -> None:
        nonlocal crc, tokens, docs
        ids = tok.encode_batch([t for t, _ in batch])
        pieces = []
        for arr, (_, ends) in zip(ids, batch, strict=True):
            pieces.append(arr)
            if ends:
                docs += 1
                if eos is not None:
                    pieces.append(np.array([eos]))
        if pieces:
            flat = np.concatenate(pieces).astype(np.dtype(dtype).newbyteorder("<"))
            fh.write(flat.tobytes())
            crc = shard_crc32c(flat, crc)
            tokens += len(flat)
        batch.clear()

    with open(tmp, "wb") as fh:
        for seg in segments:
            for text, ends in iter_pieces(seg, text_field):
                batch.append((text, ends))
                n = len(text.encode("utf-8", "replace")) if not text.isascii() else len(text)
                text_bytes += n
                batch_bytes += n
                if batch_bytes >= _CHUNK or len(batch) >= 4096:
                    flush(fh)
                    batch_bytes = 0
        flush(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / file)
    info = ShardInfo(file=file, tokens=tokens, documents=docs, crc32c=crc, source=_source(segments),
                     text_bytes=text_bytes)
    marker = out / (Path(file).stem + ".json")
    marker.with_suffix(".json.tmp").write_text(json.dumps(info.to_json()) + "\n")
    os.replace(marker.with_suffix(".json.tmp"), marker)
    return info


def _done_shard(out: Path, file: str, itemsize: int) -> ShardInfo | None:
    """The recorded shard ``file`` when its marker exists and its size matches."""
    marker = out / (Path(file).stem + ".json")
    try:
        info = ShardInfo.from_json(json.loads(marker.read_text()))
        ok = info.file == file and (out / file).stat().st_size == info.tokens * itemsize
    except (OSError, ValueError, DatasetError):
        return None
    return info if ok else None


def _plan_record(shards: list[tuple[Segment, ...]], tokenizer: str,
                 text_field: str) -> dict[str, Any]:
    files = sorted({seg.path for segs in shards for seg in segs})
    return {
        "tokenizer": tokenizer, "text_field": text_field,
        "files": [{"path": f, "size": os.stat(f).st_size,
                   "mtime_ns": os.stat(f).st_mtime_ns} for f in files],
        "shards": [[asdict(seg) for seg in segs] for segs in shards],
    }


def _check_plan(out: Path, plan: dict[str, Any], force: bool) -> None:
    path = out / PLAN_FILE
    if force and out.exists():
        for f in out.iterdir():
            if f.name.startswith("shard-") or f.name in (INDEX_FILE, PLAN_FILE, TOKENIZER_FILE):
                f.unlink()
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PrepareError(f"{path} is unreadable ({e}); pass --force to start over"
                               ) from None
        if old != plan:
            raise PrepareError(f"{out} was prepared from other inputs or another tokenizer "
                               f"(see {path}); use a new --out, or --force to replace it")
        return
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise PrepareError(f"output directory {out} is not empty and holds no {PLAN_FILE}; "
                           "use an empty or new directory")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(plan, indent=1) + "\n")
    os.replace(tmp, path)


def _resolve_tokenizer(spec: str, parts: list[Segment], out: Path, text_field: str,
                       sample_bytes: int, stats: PrepareStats) -> str:
    """The tokenizer spec the workers load: ``byte``, or ``out/tokenizer.json`` (copied
    from the given file, or trained on the inputs)."""
    if spec == "byte":
        return "byte"
    dest = out / TOKENIZER_FILE
    vocab = parse_train_spec(spec)
    if vocab is None:
        src = load_tokenizer(spec)
        if not dest.exists():
            shutil.copyfile(src.path, dest.with_suffix(".json.tmp"))
            os.replace(dest.with_suffix(".json.tmp"), dest)
        return str(dest)
    if dest.exists():  # trained by an earlier, interrupted run of the same plan
        return str(dest)

    def sample() -> Iterator[str]:
        seen = 0
        for part in parts:
            for text, _ in iter_pieces(part, text_field):
                yield text
                seen += len(text)
                if seen >= sample_bytes:
                    return

    t0 = time.perf_counter()
    train_bpe(sample(), vocab, dest)
    stats.train_tokenizer_s = time.perf_counter() - t0
    log.info("trained a %d-id BPE on %.1f MB of the input in %.1f s", vocab,
             min(sample_bytes, sum(p.size for p in parts)) / 1e6,
             stats.train_tokenizer_s)
    return str(dest)


def prepare(inputs: list[str], *, tokenizer: str, out: str | Path, text_field: str = "text",
            workers: int = 0, shard_mb: float = 256.0, force: bool = False,
            bpe_sample_mb: float = 512.0, progress: bool = False) -> PrepareStats:
    """Prepare (or finish preparing) the token dataset ``out`` from ``inputs``."""
    out = Path(out)
    stats = PrepareStats()
    shards = plan_shards(expand_inputs(inputs), max(1, int(shard_mb * 1e6)))
    _check_plan(out, _plan_record(shards, tokenizer, text_field), force)
    tok_spec = _resolve_tokenizer(tokenizer, [seg for segs in shards for seg in segs], out,
                                  text_field,
                                  int(bpe_sample_mb * 1e6), stats)
    info = dataclasses.replace(_tokenizer_from(tok_spec).info, name=tokenizer)
    dtype = dtype_for(info.vocab_size)
    itemsize = np.dtype(dtype).itemsize
    files = [f"shard-{k:05d}.bin" for k in range(len(shards))]
    done: dict[int, ShardInfo] = {}
    for k, f in enumerate(files):
        shard = _done_shard(out, f, itemsize)
        if shard is not None:
            done[k] = shard
    stats.reused_shards = len(done)
    todo = [k for k in range(len(shards)) if k not in done]
    workers = workers or min(os.cpu_count() or 1, max(1, len(todo)))
    size = [sum(seg.size for seg in segs) for segs in shards]
    total_bytes = sum(size[k] for k in todo)
    t0 = time.perf_counter()
    with _progress(progress, total_bytes) as advance:
        if workers <= 1 or len(todo) <= 1:
            for k in todo:
                done[k] = encode_shard(shards[k], tok_spec, dtype, str(out), files[k],
                                       text_field)
                advance(size[k])
        else:
            import multiprocessing as mp

            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
                futs = {pool.submit(encode_shard, shards[k], tok_spec, dtype, str(out),
                                    files[k], text_field): k for k in todo}
                for fut in as_completed(futs):
                    k = futs[fut]
                    done[k] = fut.result()
                    advance(size[k])
    stats.seconds = time.perf_counter() - t0
    stats.text_bytes = sum(done[k].text_bytes for k in todo)
    stats.encoded_tokens = sum(done[k].tokens for k in todo)
    index = TokenIndex(dtype=dtype, tokenizer=info,
                       shards=tuple(done[k] for k in range(len(shards))))
    index.write(out)
    stats.shards, stats.tokens = len(shards), index.total_tokens
    return stats


class _progress:
    """A rich progress bar over input bytes (or nothing), as a context giving ``advance``."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self._bar = enabled, total, None

    def __enter__(self) -> Any:
        if not self.enabled or self.total == 0:
            return lambda n: None
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress("[progress.description]{task.description}", BarColumn(),
                             DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                             transient=False)
        self._bar.start()
        task = self._bar.add_task("tokenizing", total=self.total)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()


def write_pydoc_topics(out: str | Path) -> tuple[int, int]:
    """Write ``pydoc_data.topics`` (the English text of the documentation topics every
    CPython ships for ``help()``) to ``out`` as JSONL, sorted by topic: (documents, bytes)."""
    from pydoc_data.topics import topics

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for name in sorted(topics):
            fh.write(json.dumps({"topic": name, "text": topics[name]}) + "\n")
    os.replace(tmp, out)
    return len(topics), sum(len(t.encode("utf-8")) for t in topics.values())


def _info(root: str, verify: bool) -> int:
    index = TokenIndex.read(root)
    if verify:
        TokenDataset(root, seq_len=1, seed=0, verify=True)
    tok = index.tokenizer
    docs = sum(s.documents for s in index.shards)
    text = sum(s.text_bytes for s in index.shards)
    print(f"{root}: {index.total_tokens} tokens ({index.dtype}) in {len(index.shards)} "
          f"shards, {docs} documents, {text / 1e6:.2f} MB of text")
    print(f"tokenizer: {tok.name} ({tok.kind}), vocab {tok.vocab_size}, eos {tok.eos_id}"
          + (f", sha256 {tok.sha256[:16]}..." if tok.sha256 else ""))
    if verify:
        print("checksums: every shard matches its crc32c")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relight data",
                                     description="Prepare and inspect token datasets.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize text/JSONL/Parquet/Arrow into token shards")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories")
    p.add_argument("--tokenizer", required=True,
                   help="byte | train:VOCAB | PATH/tokenizer.json (local; nothing downloads)")
    p.add_argument("--out", required=True, help="dataset directory to write")
    p.add_argument("--text-field", default="text", help="JSONL/Parquet field of the text")
    p.add_argument("--workers", type=int, default=0, help="encoding processes (0: per CPU)")
    p.add_argument("--shard-mb", type=float, default=256.0, help="input MB per shard")
    p.add_argument("--bpe-sample-mb", type=float, default=512.0,
                   help="input MB a train:VOCAB tokenizer learns from")
    p.add_argument("--force", action="store_true", help="replace a dataset made otherwise")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    t = sub.add_parser("pydoc-topics", help="write the text of Python's documentation topics "
                       "(pydoc_data.topics, in every CPython) as JSONL: a corpus needing no "
                       "network")
    t.add_argument("out", help="JSONL file to write (one topic per line, field 'text')")
    i = sub.add_parser("info", help="summarise a token dataset")
    i.add_argument("dir")
    i.add_argument("--verify", action="store_true", help="check every shard's crc32c")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RELIGHT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "info":
            return _info(args.dir, args.verify)
        if args.cmd == "pydoc-topics":
            n, size = write_pydoc_topics(args.out)
            print(f"{args.out}: {n} documents, {size / 1e3:.0f} KB of text")
            return 0
        stats = prepare(args.inputs, tokenizer=args.tokenizer, out=args.out,
                        text_field=args.text_field, workers=args.workers,
                        shard_mb=args.shard_mb, force=args.force,
                        bpe_sample_mb=args.bpe_sample_mb,
                        progress=not args.no_progress and sys.stderr.isatty())
    except (DatasetError, TokenizerError) as e:
        print(f"relight data: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {stats.tokens} tokens in {stats.shards} shards "
          f"({stats.reused_shards} already done); encoded {stats.text_bytes / 1e6:.2f} MB "
          f"in {stats.seconds:.2f} s: {stats.mb_per_s:.2f} MB/s, {stats.tokens_per_s:,.0f} "
          "tokens/s" + (f"; tokenizer trained in {stats.train_tokenizer_s:.1f} s"
                        if stats.train_tokenizer_s else ""))
    return 0
