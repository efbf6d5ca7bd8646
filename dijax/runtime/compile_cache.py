"""The engine's compiled steps kept on disk: JAX's persistent compilation cache, pointed at one directory.

A step bucket of the real V4.1-Flash config compiles in about a minute on the H200 (GEMM autotuning included), and
the warm-up of a 1M-context engine compiles 55 of them. JAX can keep every compiled executable on disk, keyed by
the program, its compile options, ``XLA_FLAGS``, the backend and the jax / jaxlib versions, and load it instead of
compiling when a later process asks for the same program. ``enable_compile_cache(path)`` turns that on for this
process (``LLM(..., compile_cache_dir=path)``, ``dijax generate --compile-cache DIR``); setting JAX's own
``JAX_COMPILATION_CACHE_DIR`` does the same without dijax. ``dijax generate`` keeps its compiles in
``default_compile_cache_dir()`` unless told otherwise (``--no-compile-cache``); the library stays opt-in, as JAX is.
On the H200 a real-config bucket that compiles in 37-44 s loads in ~4 s (docs/benchmarks.md, twelfth session).
When the cache is on, JAX also keeps XLA's per-fusion GEMM autotuning results in a subdirectory
(``jax_persistent_cache_enable_xla_caches``), so a bucket whose executable is not cached can still skip autotuning
the fusions that another bucket already tuned.

What is cached: compiles that took at least ``jax_persistent_cache_min_compile_time_secs`` (JAX's default: 1 s).
The directory grows without bound unless ``jax_compilation_cache_max_size`` is set; deleting it is always safe.
The setting is process-wide (JAX has one cache): a second engine with another directory moves it there.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from dijax.io.checkpoint import cache_root


def default_compile_cache_dir() -> str | None:
    """``dijax generate``'s cache: ``compile`` in dijax's cache directory (``$DIJAX_CACHE``, else ``~/.cache/dijax``),
    or None when ``JAX_COMPILATION_CACHE_DIR`` is set (JAX then uses that one)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    return os.path.join(cache_root(), "compile")


def enable_compile_cache(path: str) -> str:
    """Keep this process's compiled executables in ``path`` (created if missing) and load them from there.

    Returns the absolute directory. ValueError names ``compile_cache_dir`` when ``path`` is empty or is not a
    directory that can be created and written."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"compile_cache_dir must be a directory path (or None for no cache), got {path!r}")
    directory = os.path.abspath(os.path.expanduser(os.fspath(path)))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ValueError(f"compile_cache_dir {directory!r} cannot be created: {error.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise ValueError(f"compile_cache_dir {directory!r} is not writable")
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()  # JAX opens its cache once per process; a new directory needs a reset
    return directory
