"""UMAP embeddings of sampled router inputs, computed once per sample.

Fitting UMAP costs seconds to minutes (numba compiles on first use), so an embedding is kept in
memory by the page (`st.cache_data`) and on disk here, under the user's cache folder
(`$XDG_CACHE_HOME/moescope/embeddings`, else `~/.cache/...`), never inside the store: a
read-only dashboard writes nothing next to the data. A restarted dashboard reuses it. The disk
cache is keyed by the sampled vectors themselves, so it can never hand back the embedding of
other data.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moescope", "embeddings")


def embedding_key(hidden: np.ndarray, seed: int = 0) -> str:
    """A content key: the same vectors (in the same order) and seed give the same key."""
    digest = hashlib.sha256(np.ascontiguousarray(hidden, dtype=np.float32).tobytes())
    digest.update(f"{hidden.shape}:{seed}".encode())
    return digest.hexdigest()[:40]


def umap_2d(hidden: np.ndarray, seed: int = 0) -> np.ndarray:
    """(n, 2) UMAP coordinates of (n, width) vectors; needs n >= 4. Deterministic for a seed."""
    import umap

    n = len(hidden)
    if n < 4:
        raise ValueError(f"UMAP needs at least 4 points, got {n}")
    reducer = umap.UMAP(n_components=2, n_neighbors=min(15, n - 1), random_state=seed, n_jobs=1,
                        n_epochs=200, init="spectral" if n > 32 else "random")
    return np.asarray(reducer.fit_transform(np.asarray(hidden, dtype=np.float32)), dtype=np.float64)


def cached_umap_2d(hidden: np.ndarray, key: str, seed: int = 0, folder: str | None = None) -> np.ndarray:
    """`umap_2d(hidden)`, read from the disk cache when this key was embedded before."""
    folder = folder or cache_dir()
    path = os.path.join(folder, f"{key}.npy")
    if os.path.isfile(path):
        xy = np.load(path)
        if xy.shape == (len(hidden), 2):
            return xy
    xy = umap_2d(hidden, seed)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npy"
        np.save(tmp, xy)
        os.replace(tmp, path)
    except OSError:  # a read-only home: the in-memory cache still holds it
        pass
    return xy
