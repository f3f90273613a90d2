"""Compiled grammars on disk, so that a restart, a new replica or another rank loads what one process compiled.

One file per entry in one directory, named by a digest of what decides the compiled grammar: the backend's
``compile_identity()`` (its name and engine version, the tokenizer's fingerprint, the flags that change a compile,
the code that compiles) and the constraint key. Whatever changes the grammar changes the name, so a stale entry is
never found, only left to age out.

An entry is a header (magic and format version, the entry's digest, the body's length, the body's SHA-256) and a
body (a JSON line of what the backend needs beside the payload, then the payload: the backend's
``export_grammar``). A file that fails any check (short, long, another entry's digest, a flipped bit) is removed
and reads as a miss, so the grammar is compiled again and the entry rewritten: a damaged file never crashes a
compile nor masks with a wrong grammar.

Several processes may share the directory (data-parallel replicas, ranks, the next start). Files are written to a
temporary name, synced, then renamed over the entry, so a reader opens either a whole old entry or a whole new one,
and a crash mid-write leaves only a temporary file that no reader opens (removed once stale). The directory is held
under ``max_bytes`` of entries: after each write the least recently used (by modification time, which a read
refreshes) are removed. Writes run on one background thread at the compile threads' low priority, after the
request that compiled the grammar has it; invalid grammars (errors) are never written, and neither are grammars
that do not pay to keep: the writer reads each entry back before writing it (checks its bytes and imports it, as
a restart would; entries under ``READ_BACK_FROM_BYTES`` are not), and writes it only if its compile took at least
``read_margin`` times that read, so that a restart never makes a grammar slower to get than a cold compile
(xgrammar's compiled form of a schema with a few hundred properties, compiled in a thread, takes longer to read back
than to compile). A grammar whose export alone took as long as its compile is not read back at all. (A compile
process sends its grammar back serialised, so what it compiles is written as it came, under ``auto`` too; its
compile time counts the serialising and the import.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sglang_constrained.cache.atomic_file import TEMPORARY_PREFIX, write_atomically
from sglang_constrained.cache.compiled import GrammarExport, GrammarStats
from sglang_constrained.constraint_spec import GrammarKey
from sglang_constrained.cpu_priority import COMPILE_NICENESS, set_nice, thread_nice

logger = logging.getLogger(__name__)

MAGIC = b"SGLGRAM\x01"
"""The first bytes of every entry; the last one is the format's version."""
HEADER = struct.Struct("<8s32sQ32s")
"""magic, the entry's digest (its file name), the body's length, the body's SHA-256."""
ENTRY_SUFFIX = ".grammar"
STALE_TEMPORARY_S = 3600.0
"""A temporary file this old belongs to a writer that died: eviction removes it."""
READ_MARGIN = 1.0
"""An entry is written only if its compile took at least this many times its read-back at write time. (A compile
process's compile time counts its import, which a read repeats: a small grammar's compile and read differ by the
child's compile and the pipe against the checksum, so a wider margin would drop grammars that do pay.)"""
READ_BACK_FROM_BYTES = 8 * 2**20
"""Entries smaller than this are written without a read-back: they read back in tens of milliseconds, where a
read-back against a compile of the same order would decide by noise."""
MAX_PENDING_WRITES = 16
"""Writes queued beyond this are dropped (each holds its grammar in memory until written): a cache may forget."""


class GrammarDiskCache:
    """Compiled grammars under ``directory``, at most ``max_bytes`` of entries; see the module.

    Thread-safe, and safe with other processes on the same directory. ``load`` and ``store`` run on the caller's
    thread (a compile thread); ``store_later`` queues the write for this cache's writer thread.
    """

    def __init__(self, directory: Path, max_bytes: int, read_margin: float = READ_MARGIN) -> None:
        """``read_margin``: how many times its read-back a grammar's compile must have taken to be written (0: every
        grammar that exports faster than it compiled, not read back)."""
        if max_bytes < 0:
            raise ValueError("the grammar disk cache's byte bound must be 0 or more")
        if read_margin < 0:
            raise ValueError("the grammar disk cache's read margin must be 0 or more")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.max_bytes = max_bytes
        self.read_margin = read_margin
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-disk-writer")
        self._lock = threading.Lock()
        self._num_pending = 0
        self._is_closed = False
        self._nice = thread_nice() + COMPILE_NICENESS
        self.num_hits = 0
        self.num_misses = 0
        self.num_corrupt = 0
        self.num_writes = 0
        self.num_skipped = 0

    def load(self, identity: Mapping[str, Any], key: GrammarKey) -> GrammarExport | None:
        """The stored export for ``key`` compiled by a backend of ``identity``, or None (absent or damaged: a
        damaged entry is removed). A hit becomes the most recently used entry."""
        digest = entry_digest(identity, key)
        path = self._path(digest)
        try:
            with open(path, "rb") as file:
                data = file.read()
                inode = os.fstat(file.fileno()).st_ino
        except FileNotFoundError:
            self._count(hit=False)
            return None
        except OSError as e:
            logger.warning("cannot read the grammar disk cache entry %s: %s", path, e)
            self._count(hit=False)
            return None
        try:
            export = _decode(data, digest)
        except ValueError as e:
            logger.warning("grammar disk cache entry %s is damaged (%s): removed, the grammar compiles again", path, e)
            with self._lock:
                self.num_corrupt += 1
            self._remove_if_same(path, inode)
            self._count(hit=False)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        self._count(hit=True)
        return export

    def discard(self, identity: Mapping[str, Any], key: GrammarKey) -> None:
        """Remove ``key``'s entry, if any."""
        _unlink(str(self._path(entry_digest(identity, key))))

    def store(self, identity: Mapping[str, Any], key: GrammarKey, export: GrammarExport) -> None:
        """Write ``export`` (a valid grammar's: ``ValueError`` for an invalid one) as ``key``'s entry, atomically,
        then evict the least recently used entries past ``max_bytes``. An entry larger than the bound is not kept."""
        if export.payload is None:
            raise ValueError("an invalid grammar (a compile error) is never written to the disk cache")
        digest = entry_digest(identity, key)
        self._write_pieces(digest, _encode(export, digest))

    def _write_pieces(self, digest: str, pieces: list[bytes]) -> None:
        if sum(map(len, pieces)) > self.max_bytes:
            return
        write_atomically(self._path(digest), pieces)
        with self._lock:
            self.num_writes += 1
        self.evict()

    def store_later(
        self,
        identity: Mapping[str, Any],
        key: GrammarKey,
        export: Callable[[], GrammarExport],
        compile_s: float,
        read_back: Callable[[GrammarExport], object],
    ) -> None:
        """``store(identity, key, export())`` on the writer thread if it pays to keep: reading the entry back,
        decoded and imported with ``read_back`` as a restart would, took at most ``1 / read_margin`` of
        ``compile_s`` (what the compile took); not read back when ``export()`` alone took ``compile_s`` or longer.
        Dropped when ``MAX_PENDING_WRITES`` wait, or once closed. Failures are logged, never raised: a cache that
        cannot write only misses."""
        with self._lock:
            if self._is_closed or self._num_pending >= MAX_PENDING_WRITES:
                logger.debug("grammar disk cache: a %s grammar is not written (closed or busy)", key[0])
                return
            self._num_pending += 1
        self._writer.submit(self._write, identity, key, export, compile_s, read_back)

    def flush(self) -> None:
        """Wait until every write queued so far is on disk."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued writes, then refuse new ones (``store_later`` drops them)."""
        with self._lock:
            self._is_closed = True
        self._writer.shutdown(wait=True)

    def evict(self) -> None:
        """Remove the least recently used entries until the rest fit ``max_bytes``, and stale temporary files."""
        entries: list[tuple[int, int, str]] = []
        now = time.time()
        with os.scandir(self.directory) as scan:
            for item in scan:
                try:
                    stat = item.stat()
                except FileNotFoundError:
                    continue
                if item.name.endswith(ENTRY_SUFFIX):
                    entries.append((stat.st_mtime_ns, stat.st_size, item.path))
                elif item.name.startswith(TEMPORARY_PREFIX) and now - stat.st_mtime > STALE_TEMPORARY_S:
                    _unlink(item.path)
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            _unlink(path)
            total -= size

    @property
    def num_bytes(self) -> int:
        """Bytes of the entries on disk now (every process's)."""
        return sum(path.stat().st_size for path in self.entry_paths())

    def entry_paths(self) -> list[Path]:
        return sorted(self.directory.glob(f"*{ENTRY_SUFFIX}"))

    def _write(
        self,
        identity: Mapping[str, Any],
        key: GrammarKey,
        export: Callable[[], GrammarExport],
        compile_s: float,
        read_back: Callable[[GrammarExport], object],
    ) -> None:
        set_nice(threading.get_native_id(), self._nice)
        try:
            start = time.perf_counter()
            exported = export()
            export_s = time.perf_counter() - start
            if export_s >= compile_s:
                self._skip(key, f"compiled in {compile_s:.3f} s, serialised in {export_s:.3f} s")
                return
            digest = entry_digest(identity, key)
            pieces = _encode(exported, digest)
            if self.read_margin > 0 and sum(map(len, pieces)) >= READ_BACK_FROM_BYTES:
                start = time.perf_counter()
                read_back(_decode(b"".join(pieces), digest))
                read_s = time.perf_counter() - start
                if compile_s < self.read_margin * read_s:
                    self._skip(key, f"compiled in {compile_s:.3f} s, read back in {read_s:.3f} s")
                    return
            self._write_pieces(digest, pieces)
        except Exception:
            logger.warning("cannot write a %s grammar to the disk cache in %s", key[0], self.directory, exc_info=True)
        finally:
            with self._lock:
                self._num_pending -= 1

    def _skip(self, key: GrammarKey, why: str) -> None:
        logger.debug("a %s grammar %s: not written", key[0], why)
        with self._lock:
            self.num_skipped += 1

    def _path(self, digest: str) -> Path:
        return self.directory / f"{digest}{ENTRY_SUFFIX}"

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.num_hits += 1
            else:
                self.num_misses += 1

    @staticmethod
    def _remove_if_same(path: Path, inode: int) -> None:
        """Remove the damaged file read, unless another process has meanwhile renamed a new entry over it."""
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                os.unlink(path)


def open_grammar_disk_cache(directory: Path | None, max_bytes: int) -> GrammarDiskCache | None:
    """The disk cache in ``directory`` (None: off); None with a warning if the directory cannot be made."""
    if directory is None:
        return None
    try:
        return GrammarDiskCache(directory, max_bytes)
    except OSError as e:
        logger.warning("grammars are not cached on disk: cannot use %s (%s)", directory, e)
        return None


def entry_digest(identity: Mapping[str, Any], key: GrammarKey) -> str:
    """The hex SHA-256 naming ``key``'s entry for a backend of ``identity`` (JSON-serialisable)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for part in key:
        encoded = part.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def _encode(export: GrammarExport, digest: str) -> list[bytes]:
    """An entry's bytes in pieces (header, metadata line, payload), so that a large payload is not copied."""
    payload = export.payload
    assert payload is not None
    meta = {
        "is_text": isinstance(payload, str),
        "stats": dataclasses.asdict(export.stats) if export.stats is not None else None,
    }
    meta_line = json.dumps(meta).encode() + b"\n"
    raw = payload.encode() if isinstance(payload, str) else payload
    checksum = hashlib.sha256(meta_line)
    checksum.update(raw)
    header = HEADER.pack(MAGIC, bytes.fromhex(digest), len(meta_line) + len(raw), checksum.digest())
    return [header, meta_line, raw]


def _decode(data: bytes, digest: str) -> GrammarExport:
    """The export in an entry's bytes; ``ValueError`` saying what is wrong with a damaged one."""
    if len(data) < HEADER.size:
        raise ValueError(f"{len(data)} bytes, shorter than the header")
    magic, stored_digest, length, checksum = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not an entry of this format")
    if stored_digest != bytes.fromhex(digest):
        raise ValueError("another entry's content")
    body = memoryview(data)[HEADER.size :]
    if len(body) != length:
        raise ValueError(f"a body of {len(body)} bytes where the header says {length}")
    if hashlib.sha256(body).digest() != checksum:
        raise ValueError("its checksum does not match")
    meta_end = data.find(b"\n", HEADER.size)
    raw = body[meta_end + 1 - HEADER.size :]
    try:
        meta = json.loads(data[HEADER.size : meta_end])
        stats = meta["stats"]
        if stats is not None:
            stats = GrammarStats(**{**stats, "fallback_reasons": tuple(map(tuple, stats["fallback_reasons"]))})
        return GrammarExport(str(raw, "utf-8") if meta["is_text"] else bytes(raw), "", stats)
    except (KeyError, TypeError, ValueError) as e:  # checksummed, so written by another version of this format
        raise ValueError(f"unreadable metadata: {e!r}") from e


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
