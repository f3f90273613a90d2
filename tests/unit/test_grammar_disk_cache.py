"""The grammar disk cache as a store of exports: entries read back whole, any damage reads as a miss and removes
the entry, the least recently used entries go first past the byte bound, and processes that write, read and evict
at once (replicas, ranks) or die mid-write never leave an entry that reads torn.

Payloads here are opaque bytes and text, as the store treats every backend's export; the backend tests
(``tests/backends/test_grammar_disk_cache.py``) store real compiled grammars."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.server_args import GrammarArgs, ModelArgs, parse_server_args
from sglang_constrained.cache.atomic_file import TEMPORARY_PREFIX
from sglang_constrained.cache.compiled import GrammarExport, GrammarStats
from sglang_constrained.cache.disk import STALE_TEMPORARY_S, GrammarDiskCache, entry_digest

IDENTITY = {"backend": "test", "tokenizer": "0" * 64}
STATS = GrammarStats("json", 1.5, chosen_backend="llguidance", fallback_reasons=(("xgrammar", "refused: pattern"),))
NUM_KEYS = 6


def key(index: int) -> tuple[str, str]:
    return "json", f'{{"const": {index}}}'


def versioned_export(index: int, version: int) -> GrammarExport:
    """An export that says which key and version it is and whose bytes follow from them (50 to 400 kB)."""
    generator = random.Random(index * 100_000 + version)
    filler = generator.randbytes(generator.randrange(50_000, 400_000))
    return GrammarExport(f"{index}:{version}:".encode() + filler, "", STATS)


def is_whole(index: int, export: GrammarExport) -> bool:
    """Whether ``export`` is exactly a ``versioned_export`` of key ``index``."""
    assert isinstance(export.payload, bytes)
    written_index, version, _ = export.payload.split(b":", 2)
    return int(written_index) == index and export == versioned_export(index, int(version))


def entry_path(cache: GrammarDiskCache, index: int) -> Path:
    (path,) = [path for path in cache.entry_paths() if path.stem == entry_digest(IDENTITY, key(index))]
    return path


@pytest.mark.parametrize("payload", [b"\x00\xffbinary\n\nindex", "text grammar: start: /[a-z]+/\n"])
def test_an_entry_reads_back_as_written(tmp_path: Path, payload: bytes | str) -> None:
    cache = GrammarDiskCache(tmp_path, 10**6)
    cache.store(IDENTITY, key(0), GrammarExport(payload, "", STATS))
    assert cache.load(IDENTITY, key(0)) == GrammarExport(payload, "", STATS)
    assert cache.load(IDENTITY, key(1)) is None
    assert cache.load({**IDENTITY, "tokenizer": "1" * 64}, key(0)) is None, "another identity is another entry"


def test_an_invalid_grammar_is_never_written(tmp_path: Path) -> None:
    cache = GrammarDiskCache(tmp_path, 10**6)
    with pytest.raises(ValueError, match="never written"):
        cache.store(IDENTITY, key(0), GrammarExport(None, "invalid JSON schema"))
    assert cache.entry_paths() == []


def truncate(data: bytes, at: int) -> bytes:
    return data[: at % len(data)]


def flip(data: bytes, at: int) -> bytes:
    position = at % len(data)
    return data[:position] + bytes([data[position] ^ 0x41]) + data[position + 1 :]


def append_garbage(data: bytes, at: int) -> bytes:
    return data + bytes([at % 256]) * (1 + at % 7)


def garbage(data: bytes, at: int) -> bytes:
    return random.Random(at).randbytes(len(data))


@settings(max_examples=60, deadline=None)
@given(
    payload=st.binary(min_size=1, max_size=300),
    damage=st.sampled_from([truncate, flip, append_garbage, garbage]),
    at=st.integers(min_value=0, max_value=10**6),
)
def test_any_damage_reads_as_a_miss_and_removes_the_entry(payload: bytes, damage: object, at: int) -> None:
    """A cut, a flipped byte anywhere (header, metadata or payload), bytes after the end, or another file's bytes."""
    assert callable(damage)
    with tempfile.TemporaryDirectory() as directory:
        cache = GrammarDiskCache(Path(directory), 10**6)
        cache.store(IDENTITY, key(0), GrammarExport(payload, "", STATS))
        path = entry_path(cache, 0)
        path.write_bytes(damage(path.read_bytes(), at))
        assert cache.load(IDENTITY, key(0)) is None
        assert not path.exists()
        assert cache.num_corrupt == 1


def test_an_entry_under_another_name_is_not_read(tmp_path: Path) -> None:
    """A file copied over another key's entry is whole, but not that key's: its header names its own key."""
    cache = GrammarDiskCache(tmp_path, 10**6)
    cache.store(IDENTITY, key(0), versioned_export(0, 0))
    cache.store(IDENTITY, key(1), versioned_export(1, 0))
    entry_path(cache, 1).write_bytes(entry_path(cache, 0).read_bytes())
    assert cache.load(IDENTITY, key(1)) is None
    assert cache.load(IDENTITY, key(0)) == versioned_export(0, 0)


def test_past_the_byte_bound_the_least_recently_used_entries_go_first(tmp_path: Path) -> None:
    exports = [GrammarExport(bytes([index]) * 100_000, "", STATS) for index in range(3)]
    cache = GrammarDiskCache(tmp_path, 250_000)  # two entries fit, three do not
    for index in (0, 1):
        cache.store(IDENTITY, key(index), exports[index])
        os.utime(entry_path(cache, index), ns=(10**18 + index, 10**18 + index))  # key 0 older than key 1
    assert cache.load(IDENTITY, key(0)) is not None  # reading key 0 makes key 1 the least recently used
    cache.store(IDENTITY, key(2), exports[2])
    assert cache.load(IDENTITY, key(1)) is None
    assert cache.load(IDENTITY, key(0)) == exports[0]
    assert cache.load(IDENTITY, key(2)) == exports[2]
    assert sum(path.stat().st_size for path in cache.entry_paths()) <= cache.max_bytes


def test_an_entry_larger_than_the_whole_bound_is_not_kept(tmp_path: Path) -> None:
    cache = GrammarDiskCache(tmp_path, 1000)
    cache.store(IDENTITY, key(0), GrammarExport(b"x" * 1000, "", STATS))
    assert cache.entry_paths() == []


def hammer(directory: str, seed: int, num_operations: int, max_bytes: int) -> tuple[list[str], int, int, int]:
    """One process writing and reading random keys (versions of their exports) while others do the same:
    ``(torn reads, hits, writes, damaged entries found)``."""
    cache = GrammarDiskCache(Path(directory), max_bytes)
    generator = random.Random(seed)
    torn = []
    for _ in range(num_operations):
        index = generator.randrange(NUM_KEYS)
        if generator.random() < 0.5:
            cache.store(IDENTITY, key(index), versioned_export(index, generator.randrange(1000)))
            continue
        loaded = cache.load(IDENTITY, key(index))
        if loaded is not None and not is_whole(index, loaded):
            torn.append(f"key {index}: {bytes(loaded.payload or b'')[:20]!r}")
    return torn, cache.num_hits, cache.num_writes, cache.num_corrupt


def test_processes_writing_reading_and_evicting_at_once_never_read_a_torn_entry(tmp_path: Path) -> None:
    """Four processes on one directory bounded to about four entries, so that writes replace entries others are
    reading and evictions remove them."""
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.starmap(hammer, [(str(tmp_path), seed, 150, 1_000_000) for seed in range(4)])
    torn = [read for result in results for read in result[0]]
    assert torn == []
    assert sum(result[1] for result in results) > 0 and sum(result[2] for result in results) > 0
    assert sum(result[3] for result in results) == 0, "a reader found a damaged entry"
    assert sum(path.stat().st_size for path in GrammarDiskCache(tmp_path, 0).entry_paths()) <= 1_000_000


def write_forever(directory: str) -> None:
    cache = GrammarDiskCache(Path(directory), 10**9)
    for version in range(10**6):
        cache.store(IDENTITY, key(version % NUM_KEYS), versioned_export(version % NUM_KEYS, version))


def test_a_writer_killed_mid_write_leaves_only_whole_entries(tmp_path: Path) -> None:
    """SIGKILL a process that writes entries back to back, at random times: every entry left reads whole, and its
    half-written temporary file is no entry (eviction removes it once stale)."""
    generator = random.Random(0)
    for _ in range(3):
        writer = multiprocessing.get_context("fork").Process(target=write_forever, args=(str(tmp_path),))
        writer.start()
        deadline = time.monotonic() + 60
        while not GrammarDiskCache(tmp_path, 10**9).entry_paths():
            assert writer.is_alive() and time.monotonic() < deadline, "the writer wrote nothing"
            time.sleep(0.01)
        time.sleep(generator.uniform(0.05, 0.3))
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
    cache = GrammarDiskCache(tmp_path, 10**9)
    for path in cache.entry_paths():
        index = next(i for i in range(NUM_KEYS) if entry_digest(IDENTITY, key(i)) == path.stem)
        loaded = cache.load(IDENTITY, key(index))
        assert loaded is not None and is_whole(index, loaded)
    assert cache.num_corrupt == 0
    leftovers = list(tmp_path.glob(f"{TEMPORARY_PREFIX}*"))
    for leftover in leftovers:
        stale = time.time() - STALE_TEMPORARY_S - 60
        os.utime(leftover, (stale, stale))
    cache.evict()
    assert not list(tmp_path.glob(f"{TEMPORARY_PREFIX}*"))


def test_the_disk_cache_flags() -> None:
    default = GrammarArgs()
    assert default.grammar_disk_cache_path == ModelArgs().cache_path / "grammars", "beside the model's files"
    given = parse_server_args(["--grammar-cache-dir", "/srv/grammars"]).grammar
    assert given.grammar_disk_cache_path == Path("/srv/grammars")
    assert parse_server_args(["--disable-grammar-disk-cache"]).grammar.grammar_disk_cache_path is None
    assert parse_server_args(["--grammar-disk-cache-max-bytes", "1000"]).grammar.grammar_disk_cache_max_bytes == 1000
    with pytest.raises(ValueError, match="--grammar-disk-cache-max-bytes"):
        GrammarArgs(grammar_disk_cache_max_bytes=-1)
