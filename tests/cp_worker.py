"""Every feature on every mesh and context-parallel strategy, run by test_context_parallel.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/cp_worker.py IMPL STRATEGY[,..] [REQ,..]

For each mesh of MESHES (those without a sequence axis once, those with one once per strategy)
and each request of REQUESTS: the output and the gradients of q, k, v, the float mod operands
and the sinks of a sharded call, against the same impl unsharded. One JSON line per case,
prefixed by RESULT: relative errors (max |sharded - unsharded| / max |unsharded|), or the
refusal's message.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl

# (name, make_mesh sizes): data, data x tensor, sequence, data x sequence, tensor x sequence.
MESHES = (("data", dict(data=4)), ("data_tensor", dict(data=2, tensor=2)), ("sequence", dict(sequence=4)),
          ("data_sequence", dict(data=2, sequence=4)), ("tensor_sequence", dict(tensor=2, sequence=4)))
REQUESTS = ("causal", "packed", "window", "global_tokens", "prefix_lm", "chunked_causal", "t5_table",
            "sinks", "dropout", "gqa")
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM, BUCKETS = 4, 64, 8, 2, 8, 16


def emit(**fields):
  print("RESULT " + json.dumps(fields), flush=True)


def _documents(rng) -> np.ndarray:
  seg = np.zeros((BATCH, LENGTH), np.int32)
  for row in range(BATCH):
    bounds = np.sort(rng.choice(np.arange(1, LENGTH), size=3, replace=False))
    for doc, (lo, hi) in enumerate(zip((0, *bounds[:-1]), bounds, strict=True)):
      seg[row, lo:hi] = doc + 1
  return seg


def t5_bias(score, b, h, q_idx, kv_idx, table):
  """A learned relative-position bias (T5): table[h, bucket(q - kv)], buckets by clipped distance."""
  bucket = jnp.clip(q_idx - kv_idx, -(BUCKETS // 2), BUCKETS // 2 - 1) + BUCKETS // 2
  return score + table[h, bucket]


def problem(name: str, seed: int = 0):
  """(q, k, v, static kwargs, array kwargs, differentiable array names) of a request."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal((BATCH, LENGTH, h, HEAD_DIM)), jnp.float32)
             for h in (HEADS, KV_HEADS, KV_HEADS))
  seg = jnp.asarray(_documents(rng))
  static, arrays, grads = {}, {}, ()
  if name == "causal":
    static = {"causal": True}
  elif name == "packed":
    static, arrays = {"causal": True}, {"segment_ids": seg}
  elif name == "window":
    static = {"window": (5, 2)}
  elif name == "global_tokens":
    static, arrays = {"window": (5, 2), "global_tokens": 2}, {"segment_ids": seg}
  elif name == "prefix_lm":
    prefix = jnp.asarray(rng.integers(1, LENGTH, BATCH), jnp.int32)
    static = {"mask_mod": fl.masks.prefix_lm(operand=0), "mod_operand_axes": (("batch",),)}
    arrays = {"mod_operands": (prefix,)}
  elif name == "chunked_causal":
    static = {"mask_mod": fl.masks.chunked_causal(16)}
  elif name == "t5_table":
    table = jnp.asarray(rng.standard_normal((HEADS, BUCKETS)) * 0.5, jnp.float32)
    static = {"causal": True, "score_mod": t5_bias, "mod_operand_axes": (("heads", None),)}
    arrays, grads = {"mod_operands": (table,)}, ("mod_operands",)
  elif name == "sinks":
    static = {"causal": True}
    arrays, grads = {"sinks": jnp.asarray(rng.standard_normal(HEADS) + 1.0, jnp.float32)}, ("sinks",)
  elif name == "dropout":
    static, arrays = {"causal": True, "dropout_rate": 0.3}, {"dropout_rng": jax.random.key(11)}
  elif name == "gqa":
    static = {}
  else:
    raise ValueError(f"unknown request {name!r}")
  return q, k, v, static, arrays, grads


def value_and_grads(impl: str, static: dict, grads: tuple, **sharding):
  """jit(q, k, v, arrays) -> (out, (dq, dk, dv, d arrays named in `grads`))."""
  def loss(q, k, v, diff, rest):
    out = fl.attention(q, k, v, impl=impl, **static, **diff, **rest, **sharding)
    return jnp.sum(jnp.sin(out) * jnp.arange(1, out.shape[-1] + 1)), out

  grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)

  def run(q, k, v, arrays):
    diff = {name: x for name, x in arrays.items() if name in grads}
    rest = {name: x for name, x in arrays.items() if name not in grads}
    g, out = grad(q, k, v, diff, rest)
    return out, g
  return jax.jit(run)


def relative_errors(actual, expected) -> dict[str, float]:
  out_a, grads_a = actual
  out_e, grads_e = expected
  names = ["out", "dq", "dk", "dv"] + [f"d{n}" for n in sorted(grads_e[3])]
  leaves_a = [out_a, *grads_a[:3], *(jax.tree.leaves(grads_a[3][n]) for n in sorted(grads_a[3]))]
  leaves_e = [out_e, *grads_e[:3], *(jax.tree.leaves(grads_e[3][n]) for n in sorted(grads_e[3]))]
  errors = {}
  for name, a, e in zip(names, leaves_a, leaves_e, strict=True):
    a = np.asarray(a[0] if isinstance(a, list) else a, np.float64)
    e = np.asarray(e[0] if isinstance(e, list) else e, np.float64)
    errors[name] = float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))
  return errors


def main(impl: str, strategies: list[str], requests: list[str], meshes: list[str]) -> None:
  devices = jax.devices()
  for request in requests:
    q, k, v, static, arrays, grads = problem(request)
    expected = value_and_grads(impl, static, grads)(q, k, v, arrays)
    for mesh_name, sizes in MESHES:
      if mesh_name not in meshes:
        continue
      n = int(np.prod(list(sizes.values())))
      mesh = fl.make_mesh(**sizes, devices=devices[:n])
      for strategy in (strategies if "sequence" in sizes else ["auto"]):
        case = dict(impl=impl, request=request, mesh=mesh_name, strategy=strategy)
        try:
          actual = value_and_grads(impl, static, grads, mesh=mesh, context_parallel=strategy)(q, k, v, arrays)
        except (fl.UnsupportedError, ValueError) as e:
          emit(**case, refused=f"{type(e).__name__}: {e}")
          continue
        except Exception as e:  # noqa: BLE001 -- reported, and failed, by the test
          emit(**case, error=f"{type(e).__name__}: {str(e)[:2000]}")
          continue
        explained = fl.explain(q, k, v, impl=impl, mesh=mesh, context_parallel=strategy, **static,
                               **arrays).sharding
        emit(**case, errors=relative_errors(actual, expected), explain=explained)


if __name__ == "__main__":
  impl, strategies = sys.argv[1], sys.argv[2].split(",")
  requests = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else list(REQUESTS)
  meshes = sys.argv[4].split(",") if len(sys.argv) > 4 else [m for m, _ in MESHES]
  main(impl, strategies, requests, meshes)
