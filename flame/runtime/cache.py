"""The on-disk, content-addressed kernel cache.

A key is the sha256 of everything that changes a compiled kernel (rendered source, arch, NVRTC
version, options, FLAME version); the value is opaque bytes (a cubin, PTX, or anything else).

Layout: `root/kernels/<key[:2]>/<key>.bin`. Each file is a fixed header followed by the payload:

    magic (4 bytes) | format version (u16) | reserved (u16) | payload length (u64) | sha256 (32)

The cache is an optimisation, so it never breaks the program that uses it:
- a corrupt, truncated or foreign file is a miss, and is removed so the next `put` repairs it;
- writes go to a unique temporary file in the same directory, are fsynced, then `os.replace`d
  into place, so readers in any process see the old file or the new one, never a partial one,
  and concurrent writers of one key simply race to the last replace;
- an unwritable directory or a full disk turns `put` into a no-op with one warning.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import struct
import threading
import warnings
from pathlib import Path

MAGIC = b"FLMK"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQ32s")
_KEY_PATTERN = re.compile(r"[0-9a-f]{16,128}")
# Changing how keys are derived must never reuse old entries; bump this with that change.
_KEY_DOMAIN = b"flame-kernel-cache-key-v1"
_SUFFIX = ".bin"
_TEMP_SUFFIX = ".tmp"


class CacheWarning(RuntimeWarning):
    """The disk cache could not be written; FLAME carries on without it."""


def default_cache_dir() -> Path:
    """`$FLAME_CACHE_DIR`, else `$XDG_CACHE_HOME/flame`, else `~/.cache/flame`.

    Read at call time, so tests and users can point it elsewhere after import.
    """
    explicit = os.environ.get("FLAME_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says relative values are invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "flame"
    return Path.home() / ".cache" / "flame"


class DiskCache:
    """A directory of content-addressed blobs, safe to share between processes."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.kernels_dir = self.root / "kernels"
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "writes": 0, "corrupt": 0, "write_errors": 0}
        self._warned = False

    def __repr__(self) -> str:
        return f"DiskCache({str(self.root)!r})"

    @staticmethod
    def key(*parts: str | bytes) -> str:
        """The sha256 hex digest of `parts`; each part is length-prefixed, so that
        ("ab", "c") and ("a", "bc") differ. Strings are hashed as UTF-8."""
        digest = hashlib.sha256(_KEY_DOMAIN)
        for part in parts:
            if isinstance(part, str):
                part = part.encode("utf-8")
            elif not isinstance(part, (bytes, bytearray, memoryview)):
                raise TypeError(f"DiskCache.key parts must be str or bytes, got {type(part)}")
            data = bytes(part)
            digest.update(struct.pack("<Q", len(data)))
            digest.update(data)
        return digest.hexdigest()

    def path(self, key: str) -> Path:
        """Where the entry for `key` lives (whether or not it exists)."""
        if not isinstance(key, str) or not _KEY_PATTERN.fullmatch(key):
            # Keys become file names; anything but lowercase hex could escape the directory.
            raise ValueError(f"cache key must be 16-128 lowercase hex digits, got {key!r}")
        return self.kernels_dir / key[:2] / f"{key}{_SUFFIX}"

    # -- reading ----------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The payload stored under `key`, or None on a miss (absent, unreadable or corrupt)."""
        path = self.path(key)
        try:
            with open(path, "rb") as file:
                blob = file.read()
                identity = os.fstat(file.fileno())
        except OSError:
            self._count("misses")
            return None
        payload = _decode(blob)
        if payload is None:
            self._count("corrupt")
            self._count("misses")
            _remove_if_same_file(path, identity)
            return None
        self._count("hits")
        return payload

    # -- writing ----------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key` atomically. Never raises for I/O trouble: warns once."""
        path = self.path(key)
        blob = _encode(bytes(data))
        temp_path = path.with_name(f".{key}.{os.getpid()}.{secrets.token_hex(8)}{_TEMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_synced(temp_path, blob)
            os.replace(temp_path, path)
        except OSError as error:
            _unlink_quietly(temp_path)
            self._count("write_errors")
            self._warn_once(error)
            return
        self._count("writes")

    def _warn_once(self, error: OSError) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        reason = errno.errorcode.get(error.errno or 0, "") or type(error).__name__
        warnings.warn(
            f"FLAME kernel cache at {self.root} is not writable ({reason}: {error}); "
            "continuing without saving compiled kernels. Set FLAME_CACHE_DIR to a writable "
            "directory to cache them.",
            CacheWarning,
            stacklevel=3,
        )

    # -- inspecting and clearing ------------------------------------------------------------

    def entries(self) -> list[tuple[str, int, float]]:
        """(key, size in bytes, mtime) of every entry on disk, sorted by key."""
        found = []
        for path in self._entry_paths():
            try:
                stat = path.stat()
            except OSError:
                continue  # removed by another process since we listed it
            found.append((path.name[: -len(_SUFFIX)], stat.st_size, stat.st_mtime))
        return sorted(found)

    def size_bytes(self) -> int:
        """Total size of the entries on disk."""
        return sum(size for _, size, _ in self.entries())

    def clear(self) -> int:
        """Remove every entry (and stale temporary files); return how many entries went."""
        removed = 0
        for path in self._entry_paths():
            if _unlink_quietly(path):
                removed += 1
        for path in self._shard_files(_TEMP_SUFFIX):
            _unlink_quietly(path)
        for shard in self._shards():
            try:
                shard.rmdir()
            except OSError:
                pass  # not empty: another process is writing into it
        return removed

    def stats(self) -> dict[str, int]:
        """Counters for this instance: hits, misses, writes, corrupt, write_errors."""
        with self._lock:
            return dict(self._counts)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _shards(self) -> list[Path]:
        try:
            return [Path(entry.path) for entry in os.scandir(self.kernels_dir) if entry.is_dir()]
        except OSError:
            return []

    def _shard_files(self, suffix: str) -> list[Path]:
        files = []
        for shard in self._shards():
            try:
                names = [entry.name for entry in os.scandir(shard) if entry.name.endswith(suffix)]
            except OSError:
                continue
            files.extend(shard / name for name in names)
        return files

    def _entry_paths(self) -> list[Path]:
        return [path for path in self._shard_files(_SUFFIX) if not path.name.startswith(".")]


def _encode(payload: bytes) -> bytes:
    digest = hashlib.sha256(payload).digest()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(payload), digest) + payload


def _decode(blob: bytes) -> bytes | None:
    """The payload of a well-formed file, or None if anything about it is off."""
    if len(blob) < _HEADER.size:
        return None
    magic, version, _reserved, length, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    payload = blob[_HEADER.size :]
    if len(payload) != length or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def _write_synced(path: Path, blob: bytes) -> None:
    # O_EXCL: the name is unique, so an existing file means something is wrong; don't clobber it.
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(descriptor, "wb") as file:
        file.write(blob)
        file.flush()
        # Without fsync, a crash after the rename can leave an empty file under the final name.
        os.fsync(file.fileno())


def _remove_if_same_file(path: Path, identity: os.stat_result) -> None:
    """Remove a bad entry, unless another process has already replaced it with a new file."""
    try:
        current = os.stat(path)
    except OSError:
        return
    if (current.st_dev, current.st_ino) == (identity.st_dev, identity.st_ino):
        _unlink_quietly(path)


def _unlink_quietly(path: Path) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True
