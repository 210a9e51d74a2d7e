"""Auto: which impl `impl="auto"` runs for a request on a platform, and why.

`candidates` is the per-platform rule table (docs/contract.md, "How auto chooses"): impls in order,
each with its reason; `resolve` takes the first that serves the request (an explicit impl must serve
it or raise). `choose` adds the tuning cache: a tuned entry may replace auto's choice only by an impl
auto itself may take (`tunable`). The autotuner (tuning/candidates.py) starts from `resolve`'s
choice, so its untuned baseline is always what "auto" runs. What an impl offers (its decode path)
is asked of the registry, never of an impl's module.
"""

from __future__ import annotations

import dataclasses
import logging

from flash_layers.contract import mods
from flash_layers.impls import IMPLS, REGISTRY, Request, UnsupportedError, cpu_loop, registry
from flash_layers.tuning import cache as tuning_cache
from flash_layers.validate import AUTO, check_block_sizes, check_impl, resolve_precision

__all__ = ["AUTO", "CPU_CHUNKED_MIN_KV_LEN", "candidates", "choose", "resolve", "tunable"]

log = logging.getLogger("flash_layers")

# On CPU, xla_dense's fwd+bwd wins while its [q_len, kv_len] logits stay small; from this many keys
# on, "auto" takes xla_chunked, whose memory is O(len * chunk). Both run a forward pass that is not
# differentiated one batch row and kv head at a time there (impls/cpu_loop.py). (docs/contract.md:
# the auto rule; docs/benchmarks.md: the crossover.)
CPU_CHUNKED_MIN_KV_LEN = 1024
# Decoding (up to cpu_loop.FEW_QUERIES new queries against a long KV cache): the [q_len, kv_len] logits
# stay small at any kv_len, so "auto" keeps xla_dense on CPU, and the call runs whole.


def _decodes(name: str, request: Request, platform: str) -> bool:
  """Whether impl `name` serves `request` on its decode path (its `decode_unserved` says None)."""
  unserved = registry.method(name, "decode_unserved")
  return unserved is not None and unserved(request, platform) is None


def candidates(request: Request, platform: str) -> list[tuple[str, str]]:
  """The per-backend rule table (docs/contract.md, "How auto chooses"): candidates in order, with why."""
  decoding = _decodes("flash_pallas", request, platform)  # up to FEW_QUERIES queries, no dropout/ALiBi/...
  if platform == "tpu":
    if decoding:
      return [("flash_pallas", f"TPU: q_len {request.q_len} <= {cpu_loop.FEW_QUERIES} (decoding): our "
               "split-KV Mosaic decode kernel"),
              ("xla_chunked", "TPU: flash_pallas cannot serve it; chunked keeps memory linear"),
              ("xla_native", "TPU: fused XLA attention"),
              ("reference", "TPU: nothing else serves this request")]
    return [("flash_pallas", "TPU: our Mosaic flash kernel"),
            ("xla_chunked", "TPU: flash_pallas cannot serve it; chunked keeps memory linear"),
            ("xla_native", "TPU: fused XLA attention"),
            ("reference", "TPU: nothing else serves this request")]
  if platform in ("cuda", "rocm"):
    cands = []
    if decoding:  # before cuDNN, whose kernels tile the queries: one program per (batch, head)
      cands.append(("flash_pallas", f"GPU: q_len {request.q_len} <= {cpu_loop.FEW_QUERIES} (decoding): our "
                    "split-KV Triton decode kernel"))
    if REGISTRY["xla_native"].kernel(request, platform) == "cudnn":
      cands.append(("xla_native", "GPU: cuDNN flash attention is eligible"))
    return cands + [("flash_pallas", "GPU: our Triton flash kernel"),
                    ("xla_chunked", "GPU: flash_pallas cannot serve it; chunked keeps memory linear"),
                    ("xla_native", "GPU: XLA attention"),
                    ("reference", "GPU: nothing else serves this request")]
  if request.kv_len >= CPU_CHUNKED_MIN_KV_LEN and request.q_len <= cpu_loop.FEW_QUERIES:
    return [("xla_dense", f"CPU: q_len {request.q_len} <= {cpu_loop.FEW_QUERIES} (decoding): the "
             f"[q_len, kv_len] logits stay small at kv_len {request.kv_len}"),
            ("xla_chunked", "CPU: xla_dense cannot serve it"),
            ("reference", "CPU: nothing else serves this request")]
  if request.kv_len >= CPU_CHUNKED_MIN_KV_LEN:
    return [("xla_chunked", f"CPU: kv_len {request.kv_len} >= {CPU_CHUNKED_MIN_KV_LEN}, "
             "chunked attention keeps memory linear"),
            ("xla_dense", "CPU: dense attention"),
            ("reference", "CPU: nothing else serves this request")]
  return [("xla_dense", f"CPU: kv_len {request.kv_len} < {CPU_CHUNKED_MIN_KV_LEN}, dense attention "
           "laid out for XLA:CPU while the [q_len, kv_len] logits are small"),
          ("xla_chunked", "CPU: xla_dense cannot serve it"),
          ("reference", "CPU: nothing else serves this request")]


def tunable(request: Request, platform: str) -> list[str]:
  """The impls "auto" may take for `request` on `platform`, in its order, each once: those of
  `candidates` that serve the request, without the last resort every table ends with (reference:
  "nothing else serves this request"). A tuned cache entry may choose among them; the tuner times them."""
  names: list[str] = []
  for name, _ in candidates(request, platform)[:-1]:
    if name not in names and REGISTRY[name].unsupported(request, platform) is None:
      names.append(name)
  return names


def _who_can(request: Request, platform: str) -> list[str]:
  return [name for name in IMPLS if REGISTRY[name].unsupported(request, platform) is None]


def resolve(impl: str, request: Request, platform: str) -> tuple[str, str]:
  """(impl name, reason) for `platform`; raises UnsupportedError for an explicit impl."""
  check_impl(impl)
  if impl != AUTO:
    missing = REGISTRY[impl].unsupported(request, platform)
    if missing is not None:
      raise UnsupportedError(
          f"impl={impl!r} does not support {missing} on {platform}; impls that do: "
          f"{_who_can(request, platform) or 'none'}")
    return impl, "explicitly requested"
  for name, reason in candidates(request, platform):
    if REGISTRY[name].unsupported(request, platform) is None:
      return name, reason
  raise UnsupportedError(f"no impl supports this request on {platform}")  # reference supports all


def _tuned_impl_allowed(impl: str, tuned: str, request: Request, platform: str) -> bool:
  """A cache entry may choose among the impls "auto" itself may take on this platform (the same
  contract, never `reference`), or confirm the explicit impl it was tuned for."""
  if impl != AUTO:
    return tuned == impl
  return tuned in tunable(request, platform)


def choose(impl: str, request: Request, platform: str) -> tuple[str, str, Request, str]:
  """(impl name, reason, the request it runs, where its configuration came from).

  `resolve`, plus the tuning cache (flash_layers/tuning): "auto" without block sizes, and any impl
  with ``block_sizes="autotune"``, take the cached configuration for this device and shape bucket
  when there is one. The source is "tuned (cache hit)", "shipped" or "default".
  """
  check_block_sizes(impl, request.block_sizes)
  autotune = isinstance(request.block_sizes, str) and request.block_sizes == tuning_cache.AUTOTUNE
  if autotune:
    request = dataclasses.replace(request, block_sizes=None)
  if autotune or (impl == AUTO and request.block_sizes is None):
    tuned = tuning_cache.lookup(impl, request, platform)
    if tuned is not None and _tuned_impl_allowed(impl, tuned.impl, request, platform):
      resolve(tuned.impl, request, platform)  # an explicit impl still refuses what it cannot serve
      reason = "measured fastest for this shape bucket on this device"
      seconds, default = tuned.entry.get("seconds"), tuned.entry.get("default_seconds")
      if seconds and default:
        reason += f" ({1e3 * seconds:.1f} ms vs {1e3 * default:.1f} ms untuned, {tuned.entry.get('mode')})"
      return tuned.impl, reason, dataclasses.replace(request, block_sizes=tuned.block_sizes), tuned.source
  name, reason = resolve(impl, request, platform)
  return name, reason, request, tuning_cache.SOURCE_DEFAULT


_logged_auto: set[tuple[Request, str]] = set()  # (request, platform) pairs already logged


def log_choice(request: Request, platform: str, name: str, reason: str):
  """Log auto's choice for a (request, platform) once: at INFO, with the request's signature."""
  key = (request, platform)
  if key not in _logged_auto:
    _logged_auto.add(key)
    log.info("flash_layers auto: %s on %s for %s (%s)", name, platform, _signature(request), reason)


def _signature(r: Request) -> str:
  precision = r.precision.name.lower()
  extras = "".join(f"+{name}" for name, on in (
      (f"dropout={r.dropout_rate}", r.has_dropout), ("alibi", r.has_alibi), ("bias", r.has_bias),
      (f"precision={precision}", r.precision != resolve_precision(None, r.dtype)),
      (f"mask_mod={mods.describe(r.mask_mod)}", r.mask_mod is not None),
      (f"score_mod={mods.describe(r.score_mod)}", r.score_mod is not None)) if on)
  return (f"{r.dtype}[b={r.batch}, q={r.q_len}, kv={r.kv_len}, h={r.num_heads}/{r.num_kv_heads}, "
          f"d={r.head_dim}/{r.head_dim_v}] {r.spec.describe(r.has_segment_ids)}{extras}")

