"""ktc: an ahead-of-time weight compiler and planner for Mixture-of-Experts language models.

``import ktc`` stays light (no click, networkx or transformers) so that ``ktc.runtime`` can be
embedded; the entry points below load their modules on first use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_CACHES_KEPT = 6  # source versions whose compiled kernels stay on disk


def _source_roots() -> list[Path]:
    """The package's source directories (``ktc`` and, in a source checkout, the ``formats``,
    ``passes`` and ``runtime`` directories beside it that ``ktc.formats`` and the rest map to)."""
    package = Path(__file__).resolve().parent
    return [package] + [package.parent / name for name in ("formats", "passes", "runtime")
                        if (package.parent / name / "__init__.py").is_file()]


def _source_key(roots: list[Path]) -> str:
    """A hash of every Python source under ``roots`` (names and contents)."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _use_numba_cache_dir() -> None:
    """Numba's on-disk cache checks a compiled function against its own source file only: after
    an edit or a ``git pull`` that changes one module but not another whose compiled functions
    inline its intrinsics (runtime/rows.py and kquants.py), the unchanged one loads stale
    machine code, which crashed with a segmentation fault. So the cache lives in a directory
    named by a hash of every source of the package (``$NUMBA_CACHE_DIR``, where set, or
    ``$XDG_CACHE_HOME/ktc/numba`` under it): any change compiles afresh, and checkouts of the same
    sources share it. The last few versions are kept. Nothing happens where the directory
    cannot be made (Numba then caches beside the sources, as it does by default)."""
    try:
        configured = os.environ.get("NUMBA_CACHE_DIR")
        if configured and Path(configured).name.startswith("ktc-"):  # set by ktc in a parent process
            configured = str(Path(configured).parent)
        cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        base = Path(configured) if configured else cache_home / "ktc" / "numba"
        target = base / f"ktc-{_source_key(_source_roots())}"
        target.mkdir(parents=True, exist_ok=True)
        (target / "last-used").touch()
        versions = sorted(base.glob("ktc-*"), key=lambda p: (p / "last-used").stat().st_mtime
                          if (p / "last-used").exists() else 0.0, reverse=True)
        for stale in versions[_CACHES_KEPT:]:
            shutil.rmtree(stale, ignore_errors=True)
    except (OSError, RuntimeError):  # RuntimeError: no home directory
        return
    os.environ["NUMBA_CACHE_DIR"] = str(target)  # read by Numba when it is imported
    numba = sys.modules.get("numba")
    if numba is not None:  # imported already: its configuration has been read
        numba.config.CACHE_DIR = str(target)


_use_numba_cache_dir()


def _cache_saves_take_turns() -> None:
    """Makes Numba's on-disk cache's saves take turns between processes. Numba saves a
    function's compiled code by reading the function's index file, picking the first free data
    file name, and writing the index, then the data; two processes that save two signatures of
    one function at once pick the same name, and one of them then loads the other's machine code
    for its own types. That happens where processes compile the same kernels into an empty cache
    at once: ``ktc compile --jobs``'s workers, the test run's workers, two runs started together.
    The lock (a file beside the index, ``flock``) makes each save read the index the last one
    wrote. Loads take none: the index and data files are each replaced whole, and a name in the
    index whose data is not written yet reads as a miss, which compiles. Installed at ``import
    ktc``, which imports Numba for it (0.3-0.5 s here; ``ktc.cli`` and the runtime import it
    anyway), not through Numba's extension entry point: that would import ktc, and with it point
    the cache of every Numba program in the environment at ktc's directory."""
    try:
        import fcntl

        from numba.core import caching
    except ImportError:  # no flock (Windows): saves as Numba makes them
        return
    save = caching.IndexDataCacheFile.save
    if getattr(save, "takes_turns", False):
        return

    def save_in_turn(self, key, data):  # type: ignore[no-untyped-def]
        # the directory is there: Numba's Cache.save_overload makes it before it calls this
        with open(os.path.join(self._cache_path, "ktc-save.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            save(self, key, data)

    save_in_turn.takes_turns = True  # type: ignore[attr-defined]
    caching.IndexDataCacheFile.save = save_in_turn


_cache_saves_take_turns()


def kernels_cached() -> bool:
    """Whether the compiled-kernel cache of these sources holds a one-token decode call's kernels
    (``rows.experts_token``): False on the first CPU run after installing or updating ktc, which
    compiles them first (two to three minutes on two Zen 4 cores), True where unknown (Numba's
    cache not ktc's)."""
    target = os.environ.get("NUMBA_CACHE_DIR")
    if not target or not Path(target).name.startswith("ktc-"):
        return True
    return any(Path(target).glob("*/rows.experts_token-*.nbi"))


if TYPE_CHECKING:
    from ktc.api import generate_gpu_experts_masks, load_model, plan

__all__ = ["__version__", "generate_gpu_experts_masks", "load_model", "plan"]


def __getattr__(name: str) -> Any:
    if name in ("load_model", "plan", "generate_gpu_experts_masks"):
        from ktc import api

        return getattr(api, name)
    raise AttributeError(f"module 'ktc' has no attribute {name!r}")
