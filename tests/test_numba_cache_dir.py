"""Numba's compiled kernels are cached in a directory named by the package's sources
(``ktc._use_numba_cache_dir``): a change to any source compiles afresh, so no module loads
machine code compiled against another module's older intrinsics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ktc


def test_source_key_follows_every_file(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text(f"X = '{name}'\n")
    roots = [tmp_path / "a", tmp_path / "b"]
    first = ktc._source_key(roots)
    assert ktc._source_key(roots) == first
    (tmp_path / "b" / "m.py").write_text("X = 'changed'\n")
    assert ktc._source_key(roots) != first
    (tmp_path / "b" / "m.py").write_text("X = 'b'\n")
    assert ktc._source_key(roots) == first
    (tmp_path / "b" / "n.py").write_text("")
    assert ktc._source_key(roots) != first


def test_numba_caches_under_a_directory_named_by_the_sources(tmp_path: Path) -> None:
    code = ("import numba, ktc, os, subprocess, sys; print(numba.config.CACHE_DIR); "
            "print(subprocess.run([sys.executable, '-c', 'import ktc, numba; print(numba.config.CACHE_DIR)'], "
            "capture_output=True, text=True).stdout.strip())")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    parent, child = out.stdout.split()
    assert Path(parent) == tmp_path / f"ktc-{ktc._source_key(ktc._source_roots())}"
    assert child == parent  # a child process keeps it (no directory inside it)
    assert (Path(parent) / "last-used").is_file()


def test_kernels_cached_says_whether_a_decode_call_was_compiled_for_these_sources(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """``ktc run`` says it is compiling (minutes, silent otherwise) where the cache of these
    sources holds no one-token decode call yet; nothing where the cache is not ktc's."""
    target = tmp_path / "ktc-0123456789abcdef"
    (target / "runtime_0a1b").mkdir(parents=True)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(target))
    assert not ktc.kernels_cached()
    (target / "runtime_0a1b" / "rows.experts_token-266.py311.nbi").write_bytes(b"")
    assert ktc.kernels_cached()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))  # a user's own cache: unknown
    assert ktc.kernels_cached()


def test_import_ktc_makes_the_cache_saves_take_turns() -> None:
    code = ("import ktc; from numba.core import caching; "
            "print(getattr(caching.IndexDataCacheFile.save, 'takes_turns', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_cache_saves_take_turns_between_processes(tmp_path: Path) -> None:
    import fcntl
    import threading

    from numba.core import caching

    ktc._cache_saves_take_turns()
    cache = caching.IndexDataCacheFile(str(tmp_path), "kernel", ("stamp", 1))
    index = tmp_path / "kernel.nbi"
    with open(tmp_path / "ktc-save.lock", "a") as held:  # another process's save, in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        saving = threading.Thread(target=cache.save, args=(("key", 1), b"code"))
        saving.start()
        saving.join(0.5)
        assert saving.is_alive() and not index.exists()  # waits for it
    saving.join(10)
    assert not saving.is_alive()
    cache.save(("key", 2), b"other code")
    assert cache.load(("key", 1)) == b"code" and cache.load(("key", 2)) == b"other code"
