"""JAX's persistent compilation cache, as train.py, eval.py and the benchmarks use it.

Compiling is much of a short run's cost on a CPU (the 6-layer MiniLM's eval programs at 4,096
tokens take ~87 CPU-s, about as long as evaluating the split). With the cache on, jax writes each
compiled program to `directory` and a later run that compiles the same program (same computation,
shapes, shardings, flags, jax and XLA versions) loads it instead.

`config.compilation_cache_dir` chooses the directory; its default is `default_dir()`, under the
user's cache: $FLASH_LAYERS_CACHE, else $XDG_CACHE_HOME/flash_layers, else ~/.cache/flash_layers,
then jax_compilation_cache. "" turns the cache off. jax by default keeps only programs that took a
second or more to compile; here every program is kept, since a run compiles dozens of small ones
whose cost adds up. The cache is never pruned by us: delete the directory to reclaim its space.
"""

from __future__ import annotations

import os
import pathlib

from flash_layers.errors import UserError

SUBDIR = "jax_compilation_cache"


def cache_root() -> pathlib.Path:
  """flash_layers' cache directory: $FLASH_LAYERS_CACHE, else $XDG_CACHE_HOME/flash_layers, else
  ~/.cache/flash_layers."""
  if os.environ.get("FLASH_LAYERS_CACHE"):
    return pathlib.Path(os.environ["FLASH_LAYERS_CACHE"]).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME")
  base = pathlib.Path(xdg).expanduser() if xdg and os.path.isabs(os.path.expanduser(xdg)) else (
    pathlib.Path.home() / ".cache")  # the XDG spec: a relative XDG_CACHE_HOME is ignored
  return base / "flash_layers"


def default_dir() -> str:
  """Where compiled programs go unless config.compilation_cache_dir says otherwise."""
  return str(cache_root() / SUBDIR)


def enable(directory: str | os.PathLike | None) -> str | None:
  """Use `directory` as jax's persistent compilation cache for every program compiled from now on
  (None = `default_dir()`; "" = no persistent cache). Returns the directory used, or None.

  Call it before the process compiles anything: jax decides once, at its first compile, whether
  the cache is on.
  """
  import jax

  if not isinstance(directory, (str, os.PathLike, type(None))):
    raise TypeError(f"compilation_cache_dir must be a path, '' (off) or None (the default); "
                    f"got {directory!r}")
  path = default_dir() if directory is None else os.fspath(directory)
  if not path:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  path = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise UserError(f"config.compilation_cache_dir: cannot create {path!r} ({e.strerror}); choose another "
                    "directory, or '' to run without a compilation cache") from None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  # Keep every program: by default jax skips those compiled in under a second.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path


def add_argument(parser) -> None:
  """--compilation-cache-dir for a benchmark's argparse parser; pass its value to `enable`."""
  parser.add_argument("--compilation-cache-dir", metavar="DIR", default=None,
                      help="JAX's persistent compilation cache (default: under the user's cache, "
                           "flash_layers.training.compile_cache; '' = off)")
