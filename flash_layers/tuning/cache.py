"""The tuning cache: tuned configurations as JSON, keyed by device kind and shape bucket.

Two places are read, in order:

1. the user cache, ``$FLASH_LAYERS_TUNING_DIR`` or ``$XDG_CACHE_HOME/flash_layers/tuning``
   (``~/.cache/flash_layers/tuning``), written by `flash_layers.autotune`;
2. the tables shipped in the package (``flash_layers/tuning/data``), tuned ahead of time on the
   machines named in them.

Each directory holds one file per device kind, ``<device kind slug>.json``:

    {"device_kind": "cpu:AMD EPYC:2", "entries": {"<bucket key>": {
        "impl": "xla_chunked", "block_sizes": {"family": "cpu", "block_q": 256, ...},
        "seconds": 0.027, "default_seconds": 0.074, "mode": "train", ...}}}

A bucket key names everything a configuration may depend on: the impl asked for ("auto" or a
name), dtype, precision, the batch and both lengths rounded up to a power of two, the heads and
head dims, and the mask and features (`bucket_key`). Calls in one bucket share one entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import platform as _platform
import re
from typing import Any

import jax

from flash_layers.impls.base import Request
from flash_layers.impls.tiling import BlockSizes, CpuBlockSizes, GpuBlockSizes

ENV_DIR = "FLASH_LAYERS_TUNING_DIR"  # overrides the user cache directory
ENV_SHIPPED = "FLASH_LAYERS_TUNING_SHIPPED"  # "0": ignore the shipped tables (tests set it)
SHIPPED_DIR = pathlib.Path(__file__).resolve().parent / "data"
AUTOTUNE = "autotune"  # block_sizes="autotune": tune on a cache miss

# Where an entry came from, as `fl.explain` reports it.
SOURCE_CACHE = "tuned (cache hit)"
SOURCE_SHIPPED = "shipped"
SOURCE_DEFAULT = "default"

_FAMILIES = {"cpu": CpuBlockSizes, "tpu": BlockSizes, "gpu": GpuBlockSizes}


def user_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The user cache directory: `cache_dir`, else $FLASH_LAYERS_TUNING_DIR, else
  $XDG_CACHE_HOME/flash_layers/tuning (~/.cache/flash_layers/tuning)."""
  if cache_dir is not None:
    return pathlib.Path(cache_dir)
  if os.environ.get(ENV_DIR):
    return pathlib.Path(os.environ[ENV_DIR])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "flash_layers" / "tuning"


def cpu_model() -> str:
  """The processor's model name (Linux's /proc/cpuinfo), else what `platform` knows, else "unknown"."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return _platform.processor() or _platform.machine() or "unknown"


@functools.cache
def device_kind(platform: str | None = None) -> str:
  """What a tuned configuration is valid for: the accelerator's device kind ("TPU v5 lite",
  "NVIDIA H100 80GB HBM3"), or on CPU "cpu:<model name>:<cores>" (the cores XLA:CPU's threads
  use change the best layout as much as the model does)."""
  device = jax.devices()[0] if platform is None else jax.devices(platform)[0]
  if device.platform == "cpu":
    return f"cpu:{cpu_model()}:{os.cpu_count()}"
  return device.device_kind


def _slug(kind: str) -> str:
  return re.sub(r"[^A-Za-z0-9]+", "_", kind).strip("_").lower() or "device"


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def bucket_key(impl: str, request: Request) -> str:
  """The shape bucket of a call: what its tuned configuration is shared by."""
  r = request
  spec = r.spec
  mask = "+".join(part for part, on in (
      ("causal", spec.causal), (f"window={spec.window}", spec.window is not None),
      (f"global={spec.global_tokens}", spec.global_tokens > 0), ("segments", r.has_segment_ids),
      ("dense_mask", r.has_dense_mask), ("softcap", r.softcap is not None),
      ("dropout" + ("_broadcast" if r.dropout_broadcast else ""), r.has_dropout),
      ("alibi", r.has_alibi), ("bias", r.has_bias)) if on) or "none"
  return (f"{impl}|{r.dtype}|{r.precision.name.lower()}|b{_pow2(r.batch)}|q{_pow2(r.q_len)}|"
          f"kv{_pow2(r.kv_len)}|h{r.num_heads}/{r.num_kv_heads}|d{r.head_dim}/{r.head_dim_v}|{mask}")


def encode_block_sizes(sizes: Any) -> dict | None:
  if sizes is None:
    return None
  for family, cls in _FAMILIES.items():
    if isinstance(sizes, cls):
      return {"family": family, **dataclasses.asdict(sizes)}
  raise TypeError(f"cannot store block sizes of type {type(sizes).__name__}")


def decode_block_sizes(data: dict | None) -> Any:
  if data is None:
    return None
  fields = dict(data)
  family = fields.pop("family")
  if family not in _FAMILIES:
    raise ValueError(f"unknown block-size family {family!r}; expected one of {sorted(_FAMILIES)}")
  return _FAMILIES[family](**fields)


@dataclasses.dataclass(frozen=True)
class Tuned:
  """A cache entry as auto.choose uses it."""

  impl: str
  block_sizes: Any
  source: str  # SOURCE_CACHE or SOURCE_SHIPPED
  entry: dict  # the stored JSON entry (times, candidates, ...)


_loaded: dict[pathlib.Path, tuple[float, dict]] = {}
_disabled = False


@contextlib.contextmanager
def disabled():
  """While tracing inside this block, calls run their defaults: no cache or shipped table is read
  (benchmarks compare tuned against untuned this way)."""
  global _disabled
  saved, _disabled = _disabled, True
  try:
    yield
  finally:
    _disabled = saved


def _read(path: pathlib.Path) -> dict:
  """The entries of one cache file (memoised by modification time; {} if absent or unreadable)."""
  try:
    mtime = path.stat().st_mtime
  except OSError:
    return {}
  hit = _loaded.get(path)
  if hit is not None and hit[0] == mtime:
    return hit[1]
  try:
    entries = json.loads(path.read_text()).get("entries", {})
  except (OSError, ValueError):
    entries = {}
  _loaded[path] = (mtime, entries)
  return entries


def file_for(directory: pathlib.Path, kind: str) -> pathlib.Path:
  return directory / f"{_slug(kind)}.json"


def _shipped_enabled() -> bool:
  return os.environ.get(ENV_SHIPPED, "1") != "0"


def lookup(impl: str, request: Request, platform: str, *, cache_dir: str | os.PathLike | None = None,
           shipped_dir: str | os.PathLike | None = None) -> Tuned | None:
  """The tuned configuration for this call on this machine, or None (then the defaults apply).

  Only for the platform jax runs on here: a computation lowered for another platform (an AOT
  compile) has no device to be tuned for.
  """
  if _disabled or (platform != jax.default_backend()
                   and not (platform == "cuda" and jax.default_backend() == "gpu")):
    return None
  kind = device_kind()
  key = bucket_key(impl, request)
  places = [(user_dir(cache_dir), SOURCE_CACHE)]
  if shipped_dir is not None or _shipped_enabled():
    places.append((pathlib.Path(shipped_dir) if shipped_dir is not None else SHIPPED_DIR, SOURCE_SHIPPED))
  for directory, source in places:
    entry = _read(file_for(directory, kind)).get(key)
    if entry is not None:
      return Tuned(entry["impl"], decode_block_sizes(entry.get("block_sizes")), source, entry)
  return None


def store(impl: str, request: Request, entry: dict, *,
          cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Write `entry` for this call's bucket into the user cache (atomically); returns the file."""
  kind = device_kind()
  directory = user_dir(cache_dir)
  directory.mkdir(parents=True, exist_ok=True)
  path = file_for(directory, kind)
  entries = dict(_read(path))
  entries[bucket_key(impl, request)] = entry
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(json.dumps({"device_kind": kind, "entries": entries}, indent=1, sort_keys=True) + "\n")
  os.replace(tmp, path)
  _loaded.pop(path, None)
  return path
