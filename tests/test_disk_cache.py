"""The on-disk kernel cache: round trips, corruption, concurrency, fresh processes, env, errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from flame.runtime.cache import CacheWarning, DiskCache, default_cache_dir

REPO_ROOT = Path(__file__).resolve().parents[1]

# Shared by the writer processes and by this test: every payload says who wrote it and is
# long and varied enough that a partial or mixed file could not pass for a whole one.
PAYLOAD_SOURCE = textwrap.dedent(
    """
    def make_payload(writer, index):
        head = f"{writer}:{index}:".encode()
        return head + bytes([(writer * 31 + index) % 251]) * (20000 + 997 * (index % 17))

    def is_valid_payload(data):
        writer, index, _ = data.split(b":", 2)
        return data == make_payload(int(writer), int(index))
    """
)
PAYLOAD_HELPERS: dict = {}
exec(PAYLOAD_SOURCE, PAYLOAD_HELPERS)


def child_environment() -> dict[str, str]:
    environment = dict(os.environ)
    existing = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), existing]))
    return environment


def run_python(source: str, *arguments: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", source, *arguments],
        env=child_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_put_get_roundtrip(tmp_path):
    cache = DiskCache(tmp_path)
    key = DiskCache.key("source", "sm_90", b"\x00options")
    assert cache.get(key) is None
    cache.put(key, b"cubin bytes \x00\xff")
    assert cache.get(key) == b"cubin bytes \x00\xff"
    cache.put(key, b"")
    assert cache.get(key) == b""
    assert cache.path(key) == tmp_path / "kernels" / key[:2] / f"{key}.bin"
    assert cache.stats() == {"hits": 2, "misses": 1, "writes": 2, "corrupt": 0, "write_errors": 0}


def test_key_is_length_prefixed_and_stable():
    assert DiskCache.key("ab", "c") != DiskCache.key("a", "bc")
    assert DiskCache.key("abc") != DiskCache.key("ab", "c")
    assert DiskCache.key("a", "") != DiskCache.key("a")
    assert DiskCache.key("x", b"y") == DiskCache.key(b"x", "y")
    key = DiskCache.key("kernel")
    assert key == DiskCache.key("kernel")
    assert len(key) == 64 and int(key, 16) >= 0


def test_bad_keys_and_parts_are_rejected(tmp_path):
    cache = DiskCache(tmp_path)
    for bad_key in ["../../etc/passwd", "ABCDEF0123456789", "short", ""]:
        with pytest.raises(ValueError):
            cache.get(bad_key)
    with pytest.raises(TypeError):
        DiskCache.key("a", 3)


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "empty", "garbage_header"])
def test_damaged_file_is_a_miss_and_next_put_repairs(tmp_path, damage):
    cache = DiskCache(tmp_path)
    key = DiskCache.key("damaged", damage)
    data = bytes(range(256)) * 40
    cache.put(key, data)
    path = cache.path(key)
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) - 100]
    elif damage == "flip_byte":
        blob[len(blob) // 2] ^= 0x01
    elif damage == "empty":
        blob = bytearray()
    else:
        blob[:4] = b"XXXX"
    path.write_bytes(bytes(blob))

    assert cache.get(key) is None
    assert not path.exists(), "a corrupt entry should be removed"
    assert cache.stats()["corrupt"] == 1
    cache.put(key, data)
    assert cache.get(key) == data


def test_entries_size_and_clear(tmp_path):
    cache = DiskCache(tmp_path)
    assert cache.entries() == [] and cache.size_bytes() == 0 and cache.clear() == 0
    keys = sorted(DiskCache.key(str(index)) for index in range(5))
    for key in keys:
        cache.put(key, b"x" * 100)
    entries = cache.entries()
    assert [key for key, _, _ in entries] == keys
    assert all(size > 100 for _, size, _ in entries)
    assert cache.size_bytes() == sum(size for _, size, _ in entries)
    assert cache.clear() == 5
    assert cache.entries() == [] and cache.get(keys[0]) is None


WRITER_SOURCE = PAYLOAD_SOURCE + textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from flame.runtime.cache import DiskCache

    root, key, writer, rounds, start_file = sys.argv[1:]
    cache = DiskCache(root)
    while not Path(start_file).exists():  # line the writers up so their writes overlap
        time.sleep(0.001)
    bad = 0
    for index in range(int(rounds)):
        cache.put(key, make_payload(int(writer), index))
        data = cache.get(key)
        if data is None or not is_valid_payload(data):
            bad += 1
    stats = cache.stats()
    print(bad, stats["corrupt"], stats["writes"])
    """
)


@pytest.mark.slow
def test_concurrent_writers_never_expose_partial_files(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    key = DiskCache.key("contended")
    start_file = tmp_path / "start"
    rounds = 150
    writers = [
        run_python(WRITER_SOURCE, str(cache.root), key, str(writer), str(rounds), str(start_file))
        for writer in (1, 2)
    ]
    start_file.touch()
    reads = 0
    while any(process.poll() is None for process in writers):
        data = cache.get(key)
        if data is not None:
            assert PAYLOAD_HELPERS["is_valid_payload"](data)
            reads += 1
    for process in writers:
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        bad, corrupt, writes = (int(field) for field in stdout.split())
        assert (bad, corrupt, writes) == (0, 0, rounds)
    assert cache.stats()["corrupt"] == 0
    assert PAYLOAD_HELPERS["is_valid_payload"](cache.get(key))
    leftovers = [path.name for path in cache.root.rglob("*") if path.name.endswith(".tmp")]
    assert leftovers == []


def test_hit_from_a_fresh_process(tmp_path):
    cache = DiskCache(tmp_path)
    key = DiskCache.key("fresh process")
    cache.put(key, b"compiled in the parent")
    reader = textwrap.dedent(
        """
        import sys
        from flame.runtime.cache import DiskCache
        cache = DiskCache(sys.argv[1])
        data = cache.get(sys.argv[2])
        print(data.decode(), cache.stats()["hits"], cache.stats()["misses"], sep="|")
        """
    )
    process = run_python(reader, str(tmp_path), key)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert stdout.strip() == "compiled in the parent|1|0"


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FLAME_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "flame"

    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "flame"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "flame"

    monkeypatch.setenv("FLAME_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    assert DiskCache().root == tmp_path / "explicit"

    monkeypatch.setenv("FLAME_CACHE_DIR", "")
    assert default_cache_dir() == tmp_path / "xdg" / "flame"


def put_many_expecting_one_warning(cache: DiskCache) -> None:
    key = DiskCache.key("unwritable")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            cache.put(key, b"data")  # must not raise
    assert [warning.category for warning in caught] == [CacheWarning]
    assert str(cache.root) in str(caught[0].message)
    assert cache.get(key) is None
    assert cache.stats()["write_errors"] == 3 and cache.stats()["writes"] == 0


def test_root_under_a_file_warns_once_and_does_not_raise(tmp_path):
    # A file where a directory should be defeats even root, unlike permission bits.
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    put_many_expecting_one_warning(DiskCache(blocker / "cache"))


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores permission bits"
)
def test_read_only_directory_warns_once_and_does_not_raise(tmp_path):
    root = tmp_path / "read_only"
    root.mkdir()
    root.chmod(0o500)
    try:
        put_many_expecting_one_warning(DiskCache(root))
    finally:
        root.chmod(0o700)


def test_full_disk_warns_and_leaves_no_temp_file(tmp_path, monkeypatch):
    def disk_full(descriptor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    cache = DiskCache(tmp_path)
    put_many_expecting_one_warning(cache)
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []
