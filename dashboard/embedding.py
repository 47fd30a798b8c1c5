"""UMAP embeddings of sampled router inputs: computed once per sample, off the page's thread.

Where the time goes (the demo store, 1,000 router inputs of 128 dims, 2 cores): the fit itself
takes about 1 s; the rest is numba compiling umap's and pynndescent's functions in every new
process, 7 s where numba's on-disk cache holds what umap marks cacheable and 25 s where it holds
nothing yet (a fresh install), and several times that on a loaded machine (the first visit of the
Semantic clusters page took 120 s on a loaded 2-core machine). So:

- **Numba caches every compiled umap/pynndescent function** (`cache_umap_compilation`): umap
  marks few of them `cache=True`, so without this each new process compiled again for 7 s.
  Numba keeps the cache beside umap's sources, or under the user's cache folder where those are
  read-only (`NUMBA_CACHE_DIR` moves it).
- **The fit runs in a process of its own** (`EmbeddingJobs`: one fit at a time, each in a fresh
  `python -m moescope.dashboard.embedding`, at a lower priority): numba's compiler holds the
  interpreter lock, and in the server's process it would stall every page for its duration. The
  page draws everything else at once and says what is being computed until the points come.
- **An embedding is kept on disk**, under the user's cache folder (`$XDG_CACHE_HOME/moescope/
  embeddings`, else `~/.cache/...`), never inside the store: a read-only dashboard writes
  nothing next to the data. A restarted dashboard reads it back instead of fitting again. The key
  is the sampled vectors themselves (`embedding_key`), so it can never hand back the embedding
  of other data.

Sharp edge: `cache_umap_compilation` switches on numba's caching for functions umap and
pynndescent define (their dispatchers' `enable_caching`), a change to another library's objects,
made once per process before their first compilation.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

MAX_JOBS_KEPT = 64  # finished embeddings kept in memory by the server (each n x 2 floats)


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moescope", "embeddings")


def embedding_key(hidden: np.ndarray, seed: int = 0) -> str:
    """A content key: the same vectors (in the same order) and seed give the same key."""
    digest = hashlib.sha256(np.ascontiguousarray(hidden, dtype=np.float32).tobytes())
    digest.update(f"{hidden.shape}:{seed}".encode())
    return digest.hexdigest()[:40]


@lru_cache(maxsize=1)
def cache_umap_compilation() -> int:
    """Switch on numba's on-disk cache for every jitted function of umap and pynndescent not cached
    yet; returns how many were switched on. Once per process, before UMAP's first fit."""
    import umap  # noqa: F401  (loads umap's and pynndescent's modules)
    from numba.core.caching import NullCache
    from numba.core.dispatcher import Dispatcher

    switched = 0
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in ("umap", "pynndescent") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher) and isinstance(getattr(value, "_cache", None), NullCache):
                value.enable_caching()
                switched += 1
    return switched


def umap_2d(hidden: np.ndarray, seed: int = 0) -> np.ndarray:
    """(n, 2) UMAP coordinates of (n, width) vectors; needs n >= 4. Deterministic for a seed.

    Raises:
        ValueError: for fewer than 4 vectors.
    """
    n = len(hidden)
    if n < 4:
        raise ValueError(f"UMAP needs at least 4 points, got {n}")
    cache_umap_compilation()
    import umap

    reducer = umap.UMAP(n_components=2, n_neighbors=min(15, n - 1), random_state=seed, n_jobs=1,
                        n_epochs=200, init="spectral" if n > 32 else "random")
    return np.asarray(reducer.fit_transform(np.asarray(hidden, dtype=np.float32)), dtype=np.float64)


def _path(folder: str, key: str) -> str:
    return os.path.join(folder, f"{key}.npy")


def cached_embedding(key: str, n: int, folder: str | None = None) -> np.ndarray | None:
    """The (n, 2) embedding kept on disk under `key`, or None where there is none (or a damaged one)."""
    path = _path(folder or cache_dir(), key)
    try:
        xy = np.load(path) if os.path.isfile(path) else None
    except (OSError, ValueError):
        return None
    return xy if xy is not None and xy.shape == (n, 2) else None


def cached_umap_2d(hidden: np.ndarray, key: str, seed: int = 0, folder: str | None = None) -> np.ndarray:
    """`umap_2d(hidden)`, read from the disk cache when this key was embedded before, and kept there
    when it was not (a read-only cache folder keeps nothing and raises nothing)."""
    folder = folder or cache_dir()
    xy = cached_embedding(key, len(hidden), folder)
    if xy is not None:
        return xy
    xy = umap_2d(hidden, seed)
    _keep(xy, key, folder)
    return xy


def _fit_in_worker(hidden: np.ndarray, key: str, seed: int, folder: str) -> np.ndarray:
    """Fit in a process of its own (`python -m moescope.dashboard.embedding IN OUT SEED`), keep the
    result in the disk cache, return it. Raises RuntimeError with the worker's last words when it
    failed."""
    with tempfile.TemporaryDirectory(prefix="moescope-umap-") as scratch:
        inputs, output = os.path.join(scratch, "hidden.npy"), os.path.join(scratch, "xy.npy")
        np.save(inputs, np.asarray(hidden, dtype=np.float32))
        result = subprocess.run([sys.executable, "-m", __name__, inputs, output, str(seed)], capture_output=True,
                                text=True, stdin=subprocess.DEVNULL)
        if result.returncode != 0 or not os.path.isfile(output):
            last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
            raise RuntimeError(f"the UMAP worker failed: {last}")
        xy = np.load(output)
    _keep(xy, key, folder)
    return xy


def _keep(xy: np.ndarray, key: str, folder: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{_path(folder, key)}.{os.getpid()}.tmp.npy"
        np.save(tmp, xy)
        os.replace(tmp, _path(folder, key))
    except OSError:  # a read-only home: the server's jobs still hold it
        pass


@dataclass
class Job:
    """One embedding asked for: its future (the (n, 2) coordinates) and when it was asked."""

    future: concurrent.futures.Future
    n: int
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


class EmbeddingJobs:
    """The server's embeddings: each key fitted at most once, one fit at a time, each in a worker
    process of its own (a fresh interpreter: it shares no thread, lock or connection with the
    server). Thread-safe: every browser session asks the same object."""

    def __init__(self, folder: str | None = None) -> None:
        self._folder = folder
        self._runner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moescope-umap")
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def submit(self, hidden: np.ndarray, key: str, seed: int = 0) -> Job:
        """The job of `key`: done at once where the disk cache has it, else the fit in a worker,
        asked once however many sessions ask for it. A job that failed is asked again."""
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not (job.future.done() and job.future.exception() is not None):
                return job
            folder = self._folder or cache_dir()
            xy = cached_embedding(key, len(hidden), folder)
            if xy is not None:
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_result(xy)
            else:
                future = self._runner.submit(_fit_in_worker, np.array(hidden, dtype=np.float32), key, seed, folder)
            job = self._jobs[key] = Job(future, len(hidden))
            for old in [k for k, j in self._jobs.items() if j.future.done()][:-MAX_JOBS_KEPT]:
                del self._jobs[old]
            return job

    def pending(self) -> int:
        """How many embeddings are being computed."""
        with self._lock:
            return sum(not job.future.done() for job in self._jobs.values())

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no embedding is being computed; False if `timeout` (seconds) passed first."""
        with self._lock:
            futures = [job.future for job in self._jobs.values()]
        _, waiting = concurrent.futures.wait(futures, timeout=timeout)
        return not waiting


_jobs: EmbeddingJobs | None = None
_jobs_lock = threading.Lock()


def embedding_jobs() -> EmbeddingJobs:
    """The process's EmbeddingJobs (one queue of fits for every session of a dashboard server)."""
    global _jobs
    with _jobs_lock:
        if _jobs is None:
            _jobs = EmbeddingJobs()
        return _jobs


def _worker(argv: list[str]) -> int:
    """The worker: `IN.npy OUT.npy SEED`, below the server's priority, gone with the server."""
    inputs, output, seed = argv[0], argv[1], int(argv[2])
    try:
        os.nice(10)  # the pages' own work comes first on a machine of few cores
    except OSError:
        pass
    if sys.platform == "linux":  # a server killed outright takes its worker with it
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    xy = umap_2d(np.load(inputs), seed)
    np.save(output, xy)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
