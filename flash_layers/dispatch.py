"""Dispatch: run an already-validated call with the impl "auto" or the caller chose (`attend`).

Validation lives in validate.py (`prepare`) and the choice in auto.py (`choose`); this module runs
the choice: one jitted function per (impl, request) so a model's layers share one trace, and, for
"auto", one branch per platform whose choice differs (`jax.lax.platform_dependent`), so an AOT
compile for TPU from a CPU host runs the TPU choice. The public `attention`/`explain` (api.py), the
sharded and ring paths (parallel/), the tuner and the layers build on this module; it imports none
of them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from flash_layers import auto, lowering
from flash_layers.auto import AUTO
from flash_layers.impls import REGISTRY, Args, Request, registry

# Platforms whose choice may differ: the call is lowered with one branch per platform.
_DISPATCH_PLATFORMS = ("cpu", "tpu", "cuda", "rocm")


def _run(name: str, query, key, value, request: Request, args: Args):
  """``REGISTRY[name].attend`` as one jitted function of (q, k, v, the array arguments).

  A model calls attention once per layer with the same shapes and options: under the jit, the
  impl is traced (and lowered) once per program, not once per layer. The static key holds
  everything the trace reads besides the arrays: the impl, the request, the non-array arguments
  (static offsets), and the platform `lowering.lowered_only_for` names. Under `interpret_as`
  (tests) the impl runs inline: its interpreter parameters are not part of any key.
  """
  if lowering.interpreting() is not None:
    return _run_inline(name, query, key, value, request, args)
  fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
  arrays = {f: x for f, x in fields.items()
            if isinstance(x, (jax.Array, np.ndarray)) or f in ("mod_operands", "mod_tiles")}
  static = tuple((f, x) for f, x in fields.items() if f not in arrays)
  return _run_jit(query, key, value, arrays, name=name, request=request, static=static,
                  only=lowering.only_platform())


def _run_inline(name: str, query, key, value, request: Request, args: Args):
  # The scope names the impl in HLO metadata, so profiler traces show "flash_layers.<impl>".
  with jax.named_scope(f"flash_layers.{name}"):
    return REGISTRY[name].attend(query, key, value, request=request, args=args)


@functools.partial(jax.jit, static_argnames=("name", "request", "static", "only"))
def _run_jit(query, key, value, arrays, *, name: str, request: Request, static: tuple, only):
  del only  # part of the key: read by the impls through `lowering.only_platform()`
  args = Args(**dict(static), **arrays)
  return _run_inline(name, query, key, value, request, args)



def _by_platform(impl: str, request: Request, run, query, key, value):
  """``run(name, request, q, k, v)`` with the impl `impl` resolves to (and its tuned configuration,
  `choose`). For "auto", whose choice may differ by platform, the choice follows the platform the
  computation is lowered for, so that an AOT compile for TPU from a CPU host runs the TPU choice."""
  only = lowering.only_platform()
  here = only or lowering.default_platform()
  name, reason, chosen, _ = auto.choose(impl, request, here)
  if impl != AUTO:
    return run(name, chosen, query, key, value)
  auto.log_choice(request, here, name, reason)
  if only is not None:  # lowered for that platform alone (lowering.lowered_only_for): one branch
    return run(name, chosen, query, key, value)
  choices = {p: auto.choose(AUTO, request, p)[::2] for p in _DISPATCH_PLATFORMS}
  choices[here] = (name, chosen)
  if len(set(choices.values())) == 1:
    return run(name, chosen, query, key, value)
  # One callable per (impl, request): platform_dependent traces a callable shared by platforms once.
  runners = {c: (lambda q, k, v, c=c: run(*c, q, k, v)) for c in set(choices.values())}
  branches = {p: runners[c] for p, c in choices.items()}
  return jax.lax.platform_dependent(query, key, value, default=branches["cpu"], **branches)


def attend(query, key, value, *, impl: str, request: Request, args: Args):
  """Run an already-validated request; returns (out, lse). Used by `attention` and the ring."""
  return _by_platform(impl, request, lambda n, r, q, k, v: _run(n, q, k, v, r, args),
                      query, key, value)


def _run_backward(name: str, query, key, value, lse, delta, d_out, request: Request, args: Args):
  # Impls without a backward of their own (reference, xla_native: dense anyway) use xla_dense's:
  # plain XLA from the same statistics.
  backward = registry.method(name, "attention_backward") or registry.method("xla_dense",
                                                                            "attention_backward")
  with jax.named_scope(f"flash_layers.{name}.backward"):
    return backward(query, key, value, lse, delta, d_out, request=request, args=args)


def attend_backward(query, key, value, lse, delta, d_out, *, impl: str, request: Request,
                    args: Args):
  """(dq, dk, dv) of an already-validated request from given row statistics, without running
  its forward: ``lse [b, h, q]`` the softmax normaliser and ``delta [b, h, q]`` =
  rowsum(dO * O) - dlse of the whole output the rows belong to. Ring attention passes the
  global ones: each (q shard, kv shard) pair then yields its exact share of the gradients.
  """
  return _by_platform(
      impl, request,
      lambda n, r, q, k, v: _run_backward(n, q, k, v, lse, delta, d_out, r, args),
      query, key, value)
