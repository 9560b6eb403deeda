"""The direct shard codec (`ckpt.shardio`): byte-identical to tensorstore, and its
reader's checks (truncated, bit-flipped, missing chunks) raise the typed errors."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

from relight import ckpt, storage
from relight.ckpt.format import MANIFEST_KEY, chunk_key, zarr_metadata
from relight.ckpt.shardio import ShardGeometry, encode_shard, read_shard_region
from relight.ckpt.tsio import open_array

CASES = [
    ("float32", np.float32, [8, 12], [4, 6], [2, 3]),
    ("bfloat16", ml_dtypes.bfloat16, [8, 12], [4, 12], [4, 3]),
    ("float16", np.float16, [6, 10], [3, 10], [3, 5]),
    ("int64", np.int64, [16], [8], [2]),
    ("bool", np.bool_, [4, 4, 6], [2, 4, 6], [1, 2, 3]),
    ("uint8", np.uint8, [256], [256], [64]),
]


@pytest.mark.parametrize("dtype,npd,shape,chunks,inner", CASES,
                         ids=[c[0] for c in CASES])
def test_same_bytes_as_tensorstore(tmp_path, dtype, npd, shape, chunks, inner) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 50).astype(npd)
    x[(slice(0, inner[0]),) * 1] = 0  # an all-zero tile must be stored all the same
    store = storage.open_store(tmp_path / "ts")
    arr = open_array(store, "a", zarr_metadata(shape, dtype, chunks, inner, None),
                     read=False).result()
    arr.write(x).result()
    geo = ShardGeometry(tuple(chunks), tuple(inner), x.dtype.itemsize)
    grid = [s // c for s, c in zip(shape, chunks, strict=True)]
    for cell in np.ndindex(*grid):
        region = tuple(slice(c * k, (c + 1) * k) for c, k in zip(cell, chunks, strict=True))
        key = chunk_key("a", cell)
        ours = encode_shard(x[region], geo)
        assert ours == store.get(key), (dtype, cell)
        assert len(ours) == geo.object_bytes
        # the same bytes into a reused (larger, dirty) buffer, as the writer encodes
        reused = np.full(geo.object_bytes + 7, 0xAB, dtype=np.uint8)
        crcs: list[int | None] = []
        view = encode_shard(x[region], geo, crcs, into=reused)
        assert bytes(view) == ours and len(crcs) == geo.n_chunks, (dtype, cell)
        # and our reader reads tensorstore's object, a partial region of it
        sub = tuple(slice(1, k) for k in chunks)
        out = np.zeros([k - 1 for k in chunks], dtype=npd)
        read_shard_region(store, key, geo, sub, out, url=store.url, tensor="t")
        np.testing.assert_array_equal(out, x[region][sub])


def test_partial_read_fetches_only_overlapped_chunks(tmp_path) -> None:
    store = storage.open_store(tmp_path / "s")
    geo = ShardGeometry((64, 64), (32, 32), 4)
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    store.put("k", encode_shard(x, geo))
    out = np.empty((10, 20), np.float32)
    fetched = read_shard_region(store, "k", geo, (slice(40, 50), slice(3, 23)), out,
                                url=store.url, tensor="t")
    np.testing.assert_array_equal(out, x[40:50, 3:23])
    assert fetched == geo.index_bytes + geo.chunk_bytes + 4  # one of four inner chunks


def _tiled_shard(tmp_path) -> tuple[storage.Store, ShardGeometry, np.ndarray,
                                    list[int | None]]:
    """A 64 x 64 float32 shard of 2 x 2 inner chunks stored at "k", and its chunks'
    crc32c."""
    store = storage.open_store(tmp_path / "s")
    geo = ShardGeometry((64, 64), (32, 32), 4)
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    crcs: list[int | None] = []
    store.put("k", encode_shard(x, geo, crcs))
    return store, geo, x, crcs


def test_chunks_a_small_gap_apart_come_in_one_ranged_get(tmp_path) -> None:
    """A column half of a 2 x 2 tiled shard (a tp reshard) needs tiles 0 and 2: two
    ranged gets, or, where a request costs more than a tile's bytes (`gap_bytes`, as on
    S3), one get over tiles 0-2 whose middle tile is fetched and dropped."""
    store, geo, x, crcs = _tiled_shard(tmp_path)
    half = (slice(0, 64), slice(0, 32))
    tile = geo.chunk_bytes + 4
    for gap, gets, fetched_bytes in ((0, 2, 2 * tile), (tile - 1, 2, 2 * tile),
                                     (tile, 1, 3 * tile), (4 << 20, 1, 3 * tile)):
        out = np.zeros((64, 32), np.float32)
        reads = store.stats.reads
        fetched = read_shard_region(store, "k", geo, half, out, url=store.url, tensor="t",
                                    expect=crcs, gap_bytes=gap)
        np.testing.assert_array_equal(out, x[half])
        assert (store.stats.reads - reads, fetched) == (gets, fetched_bytes), gap
    # Through the index (no checksums to bind the chunks' places) the same.
    out = np.zeros((64, 32), np.float32)
    reads = store.stats.reads
    fetched = read_shard_region(store, "k", geo, half, out, url=store.url, tensor="t",
                                gap_bytes=tile)
    np.testing.assert_array_equal(out, x[half])
    assert (store.stats.reads - reads, fetched) == (2, geo.index_bytes + 3 * tile)


def _permuted(x: np.ndarray, geo: ShardGeometry, order: list[int]) -> bytes:
    """A valid shard object of `x` whose inner chunks are stored in `order` (storage
    positions), with an index that says so: what a writer of another chunk order writes."""
    from relight.storage.checksum import crc32c

    canon = encode_shard(x, geo)
    step = geo.chunk_bytes + 4
    data = b"".join(canon[lin * step: (lin + 1) * step] for lin in order)
    index = np.empty((geo.n_chunks, 2), "<u8")
    for at, lin in enumerate(order):
        index[lin] = (at * step, step)
    entries = index.tobytes()
    return data + entries + crc32c(entries).to_bytes(4, "little")


def test_partial_read_of_bound_chunks_skips_the_index(tmp_path) -> None:
    """With the manifest's chunk crc32c (`expect`) a partial read fetches only the chunks
    it needs, from where they are stored, not the index first; a chunk elsewhere (another
    writer's order) is found through the index; a damaged chunk is still refused, naming
    it; damage to the index alone does not stop a read that does not use it."""
    from relight.ckpt.errors import ChecksumMismatchError

    store, geo, x, crcs = _tiled_shard(tmp_path)
    region = (slice(40, 50), slice(3, 23))
    out = np.empty((10, 20), np.float32)
    fetched = read_shard_region(store, "k", geo, region, out, url=store.url, tensor="t",
                                expect=crcs)
    np.testing.assert_array_equal(out, x[region])
    assert fetched == geo.chunk_bytes + 4  # one of four inner chunks, no index

    store.put("p", _permuted(x, geo, [3, 2, 1, 0]))
    for reg in (region, (slice(0, 64), slice(32, 64)), (slice(0, 64), slice(0, 64))):
        out = np.empty([r.stop - r.start for r in reg], np.float32)
        fetched = read_shard_region(store, "p", geo, reg, out, url=store.url, tensor="t",
                                    expect=crcs)
        np.testing.assert_array_equal(out, x[reg])
        if reg == region:
            # The first try at the chunk's canonical place counts too: that chunk, the
            # index, then the chunk where the index says.
            assert fetched == 2 * (geo.chunk_bytes + 4) + geo.index_bytes

    raw = bytearray(store.get("k"))
    raw[-10] ^= 0x10  # the index
    store.put("i", bytes(raw))
    out = np.empty((10, 20), np.float32)
    read_shard_region(store, "i", geo, region, out, url=store.url, tensor="t", expect=crcs)
    np.testing.assert_array_equal(out, x[region])
    with pytest.raises(ChecksumMismatchError, match="the shard index"):
        read_shard_region(store, "i", geo, (slice(0, 64), slice(0, 64)),
                          np.empty((64, 64), np.float32), url=store.url, tensor="t",
                          expect=crcs)

    step = geo.chunk_bytes + 4
    raw = bytearray(store.get("k"))
    raw[3 * step + 100] ^= 0x10  # data of inner chunk (1, 1), the one the region needs
    store.put("d", bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"inner chunk \(1, 1\)") as e:
        read_shard_region(store, "d", geo, (slice(40, 50), slice(40, 50)),
                          np.empty((10, 10), np.float32), url=store.url, tensor="t",
                          expect=crcs)
    assert e.value.obj == "d"


@pytest.fixture
def saved(tmp_path) -> tuple[storage.Store, str, torch.Tensor]:
    store = storage.open_store(tmp_path / "c")
    w = torch.randn(512, 512)
    ckpt.save({"w": w}, store)
    m = json.loads(store.get(MANIFEST_KEY))
    key = chunk_key(m["tensors"]["w"]["array"], (0, 0))
    return store, key, w


def _flip(store: storage.Store, key: str, pos: int) -> None:
    raw = bytearray(store.get(key))
    raw[pos] ^= 0x10
    store.put(key, bytes(raw))


@pytest.mark.parametrize("where", ["data", "crc", "index"])
def test_bit_flip_is_checksum_mismatch(saved, where) -> None:
    store, key, _w = saved
    size = store.size(key)
    pos = {"data": 1000, "crc": (256 * 256 * 4) + 1, "index": size - 10}[where]
    _flip(store, key, pos)
    with pytest.raises(ckpt.ChecksumMismatchError) as e:
        ckpt.load({"w": torch.zeros(512, 512)}, store)
    assert e.value.tensor == "w" and e.value.obj == key and key in str(e.value)


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_truncated_or_missing_shard_is_missing_chunk(saved, how) -> None:
    store, key, _w = saved
    if how == "delete":
        store.delete(key)
    else:
        store.put(key, store.get(key)[:-100])
    with pytest.raises(ckpt.MissingChunkError) as e:
        ckpt.load({"w": torch.zeros(512, 512)}, store)
    assert e.value.tensor == "w" and e.value.obj == key


def test_index_marking_a_chunk_missing(saved) -> None:
    store, key, _w = saved
    raw = bytearray(store.get(key))
    geo = ShardGeometry((512, 512), (256, 256), 4)
    at = geo.object_bytes - geo.index_bytes
    index = np.frombuffer(raw, "<u8", count=2 * geo.n_chunks, offset=at).copy()
    index[2:4] = (1 << 64) - 1
    raw[at: at + index.nbytes] = index.tobytes()
    import google_crc32c

    raw[-4:] = int(google_crc32c.value(bytes(raw[at:-4]))).to_bytes(4, "little")
    store.put(key, bytes(raw))
    with pytest.raises(ckpt.MissingChunkError, match="inner chunk"):
        ckpt.load({"w": torch.zeros(512, 512)}, store)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_all_zero_tensors_round_trip(tmp_path, compression) -> None:
    """tensorstore drops chunks equal to the fill value unless told to store them; reads
    refuse missing chunks, so an all-zero shard used to be unreadable."""
    src = {"z": torch.zeros(600, 600), "zb": torch.zeros(1000, 700, dtype=torch.bfloat16),
           "small": torch.zeros(16)}
    url = tmp_path / "c"
    ckpt.save(src, url, options=ckpt.SaveOptions(compression=compression))
    dst = {k: torch.ones_like(v) for k, v in src.items()}
    ckpt.load(dst, url)
    assert all(torch.equal(dst[k], src[k]) for k in src)
    assert ckpt.verify(url).ok


def test_encode_into_a_buffer_too_small_or_not_bytes_is_refused() -> None:
    geo = ShardGeometry((4, 6), (2, 3), 4)
    x = np.zeros((4, 6), dtype=np.float32)
    for bad in (np.empty(geo.object_bytes - 1, np.uint8), np.empty(geo.object_bytes, np.int8),
                np.empty((2, geo.object_bytes), np.uint8)):
        with pytest.raises(ValueError, match="cannot hold shard"):
            encode_shard(x, geo, into=bad)


def test_reads_with_a_buffer_pool_reuse_its_buffers_and_check_every_chunk(tmp_path) -> None:
    """Reads into pooled buffers (`Store.get_view`): the same bytes as fresh reads, the
    pool's buffers come back after each read (cold objects, read around the page cache),
    a read of a cached object takes none (it is mapped), a bit flip is still caught, and
    a load keeps no fetch memory once it returns."""
    from relight.ckpt.errors import ChecksumMismatchError
    from relight.ckpt.read_pools import read_pools
    from relight.storage.direct_io import BufferPool

    store = storage.open_store(tmp_path / "s")
    geo = ShardGeometry((512, 1024), (256, 512), 4)  # 2 MiB objects: read direct
    pool = BufferPool()
    xs = [np.random.default_rng(i).standard_normal((512, 1024)).astype(np.float32)
          for i in range(3)]
    for i, x in enumerate(xs):
        store.put(f"k{i}", encode_shard(x, geo))
    def cached() -> int:
        return store.stats.snapshot()["bytes_read_cached"]

    for i, x in enumerate(xs):
        for region in ((slice(0, 512), slice(0, 1024)), (slice(0, 512), slice(600, 1000))):
            store.drop_cached(f"k{i}")  # (tmpfs keeps its pages: then the read maps them)
            before = cached()
            out = np.empty((512, region[1].stop - region[1].start), np.float32)
            read_shard_region(store, f"k{i}", geo, region, out, url=store.url, tensor="t",
                              buffers=pool)
            np.testing.assert_array_equal(out, x[region])
            if cached() == before:
                assert len(pool.free) >= 1, "the read gave its buffer back"
    assert len(pool.free) <= 2, "later reads reused the buffers instead of taking new ones"
    takes = []
    real_take = pool.take
    pool.take = lambda n: takes.append(n) or real_take(n)  # type: ignore[method-assign]
    store.get("k0")  # now every page of it is cached
    before = cached()
    out = np.empty((512, 1024), np.float32)
    read_shard_region(store, "k0", geo, (slice(0, 512), slice(0, 1024)), out,
                      url=store.url, tensor="t", buffers=pool)
    np.testing.assert_array_equal(out, xs[0])
    if cached() > before:  # served by the cache's own pages (cachestat counts them)
        assert takes == [], "a mapped read takes no buffer"
    pool.take = real_take  # type: ignore[method-assign]
    _flip(store, "k1", 5)
    with pytest.raises(ChecksumMismatchError):
        read_shard_region(store, "k1", geo, (slice(0, 512), slice(0, 1024)),
                          np.empty((512, 1024), np.float32), url=store.url, tensor="t",
                          buffers=pool)

    w = torch.randn(1024, 1024)
    ckpt.save({"w": w}, tmp_path / "c")
    got = {"w": torch.zeros(1024, 1024)}
    ckpt.load(got, tmp_path / "c")
    assert torch.equal(got["w"], w)
    assert read_pools().buffers.free == []
