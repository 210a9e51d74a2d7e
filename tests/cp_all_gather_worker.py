"""Checks of the all-gather strategy that need several devices, run in a subprocess by
tests/test_cp_all_gather.py (8 simulated CPU devices):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/cp_all_gather_worker.py IMPL [hlo]

`all_gather.attention` is called directly inside `jax.shard_map` with a hand-built CPConfig and
compared with the unsharded `dispatch.attend` of the same impl on the whole arrays: the output, lse
and every gradient (q, k, v and a score_mod's float table). One JSON line per case, prefixed RESULT.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import flash_layers as fl
from flash_layers import dispatch, validate
from flash_layers.impls import Args
from flash_layers.parallel import all_gather
from flash_layers.parallel.context import CPConfig

BATCH, LENGTH, HEAD_DIM = 2, 64, 16


def relative_bias(score, b, h, q_idx, kv_idx, table):
  """A T5-style learned table [heads, 9 buckets] of clipped relative positions (defined once: the
  Request hashes a score_mod by identity)."""
  return score + table[h, jnp.clip(kv_idx - q_idx, -4, 4) + 4]


PREFIX_LM = fl.masks.prefix_lm(operand=0)
CHUNKED = fl.masks.chunked_causal(16)

# case -> (heads, kv heads, (data, sequence) mesh, the layout the strategy must pick)
CASES = {
    "causal_gqa": (8, 2, (1, 4), 2),
    "causal_seq8": (4, 2, (1, 8), 2),
    "packed": (4, 2, (2, 4), 2),
    "window": (4, 2, (1, 8), 1),
    "dropout_alibi": (4, 2, (2, 4), 2),
    "prefix_lm": (4, 2, (1, 4), 1),
    "chunked_causal": (4, 2, (1, 4), 1),
    "score_table": (4, 2, (1, 4), 2),
}
# Interpret mode is slow: two cases for the Pallas kernels, one of them beside a data axis. No
# score_table: flash_pallas refuses score_mod operand gradients.
IMPL_CASES = {"flash_pallas": ("causal_gqa", "packed", "dropout_alibi", "prefix_lm")}


def problem(case: str, seed=0):
  """q, k, v and the keywords of `validate.prepare` for a named case."""
  heads, kv_heads = CASES[case][:2]
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((BATCH, LENGTH, heads, HEAD_DIM)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((BATCH, LENGTH, kv_heads, HEAD_DIM)), jnp.float32)
          for _ in range(2))
  if case == "window":
    return q, k, v, {"window": (5, 2)}
  if case == "prefix_lm":
    return q, k, v, {"mask_mod": PREFIX_LM, "mod_operands": (jnp.asarray([10, 37], jnp.int32),)}
  if case == "chunked_causal":
    return q, k, v, {"mask_mod": CHUNKED}
  if case == "score_table":
    table = jnp.asarray(rng.standard_normal((heads, 9)), jnp.float32)
    return q, k, v, {"causal": True, "score_mod": relative_bias, "mod_operands": (table,)}
  kwargs = {"causal": True}
  if case in ("packed", "dropout_alibi"):
    seg = np.zeros((BATCH, LENGTH), np.int32)
    for row in range(BATCH):
      bounds = np.sort(rng.choice(np.arange(1, LENGTH), size=3, replace=False))
      for doc, (lo, hi) in enumerate(zip((0, *bounds[:-1]), bounds, strict=True)):
        seg[row, lo:hi] = doc + 1
    # The keys lack document 2: its queries see nothing (lse -inf, zero gradients).
    kwargs.update(segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(np.where(seg == 2, 7, seg)))
  if case == "dropout_alibi":
    kwargs.update(dropout_rate=0.3, dropout_rng=jax.random.key(11), alibi_slopes=fl.alibi_slopes(heads))
  return q, k, v, kwargs


def _loss(out, lse):
  # lse joins the loss (the ring merges by it; here it is a plain output), rows that see no key
  # excluded (-inf).
  w = jnp.arange(out.shape[-1], dtype=jnp.float32)
  return jnp.sum(jnp.sin(out) * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), jnp.cos(lse), 0.0))


def _float_operands(args: Args):
  return tuple(i for i, x in enumerate(args.mod_operands) if jnp.issubdtype(x.dtype, jnp.floating))


def _with_operands(args: Args, floats, values):
  operands = list(args.mod_operands)
  for i, x in zip(floats, values, strict=True):
    operands[i] = x
  return dataclasses.replace(args, mod_operands=tuple(operands))


def unsharded(impl, request, args):
  floats = _float_operands(args)

  def loss(q, k, v, float_ops):
    inner = _with_operands(args, floats, float_ops)
    out, lse = dispatch.attend(q, k, v, impl=impl, request=request, args=inner)
    return _loss(out, lse), (out, lse)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)), floats


def sharded_loss(impl, request, args, shape):
  """(loss(q, k, v, float operands) -> (loss, (out, lse)), float operand indices) of
  `all_gather.attention` in shard_map over a (data, seq) mesh of `shape`."""
  data, size = shape
  mesh = Mesh(np.asarray(jax.devices()[:data * size]).reshape(shape), ("data", "seq"))
  batch = "data" if data > 1 else None
  config = CPConfig(impl=impl, request=dataclasses.replace(request, batch=request.batch // data),
                    axis="seq", size=size)
  floats = _float_operands(args)
  arrays = {"q_seg": args.q_segment_ids, "kv_seg": args.kv_segment_ids, "seed": args.dropout_seed,
            "slopes": args.alibi_slopes}
  arrays = {name: x for name, x in arrays.items() if x is not None}
  specs = {"q_seg": P(batch, "seq"), "kv_seg": P(batch, "seq"), "seed": P(), "slopes": P()}

  def body(q, k, v, arrays, operands):
    batch_offset = jax.lax.axis_index("data") * config.request.batch if data > 1 else 0
    local = Args(batch_offset=batch_offset, dropout_seed=arrays.get("seed"),
                 alibi_slopes=arrays.get("slopes"), mod_operands=operands)
    return all_gather.attention(q, k, v, arrays.get("q_seg"), arrays.get("kv_seg"), config, local)

  heads = P(batch, "seq", None, None)
  mapped = jax.shard_map(body, mesh=mesh, in_specs=(heads, heads, heads, {n: specs[n] for n in arrays},
                                                    P()),
                         out_specs=(heads, P(batch, None, "seq")), check_vma=False)

  def loss(q, k, v, float_ops):
    out, lse = mapped(q, k, v, arrays, _with_operands(args, floats, float_ops).mod_operands)
    return _loss(out, lse), (out, lse)

  return loss, floats


def sharded(impl, request, args, shape):
  loss, floats = sharded_loss(impl, request, args, shape)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)), floats


def relative_errors(actual, expected) -> dict[str, float]:
  (dq, dk, dv, dops), (out, lse) = actual
  (eq, ek, ev, eops), (e_out, e_lse) = expected
  pairs = {"out": (out, e_out), "lse": (lse, e_lse), "dq": (dq, eq), "dk": (dk, ek), "dv": (dv, ev)}
  pairs.update({f"d_operand{i}": pair for i, pair in enumerate(zip(dops, eops, strict=True))})
  errors = {}
  for name, (a, e) in pairs.items():
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    finite = np.isfinite(e)
    if not np.array_equal(finite, np.isfinite(a)):
      errors[name] = float("inf")  # -inf lse rows must stay exactly where they are
      continue
    a, e = np.where(finite, a, 0.0), np.where(finite, e, 0.0)
    errors[name] = float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))
  return errors


def check(impl: str, case: str):
  q, k, v, kwargs = problem(case)
  request, args = validate.prepare(q, k, v, **kwargs)
  shape, chunks = CASES[case][2], CASES[case][3]
  expected_fn, floats = unsharded(impl, request, args)
  float_ops = tuple(args.mod_operands[i] for i in floats)
  expected = expected_fn(q, k, v, float_ops)
  actual_fn, _ = sharded(impl, request, args, shape)
  actual = actual_fn(q, k, v, float_ops)
  local = all_gather.local_request(request, shape[1], 1)
  layout = LENGTH // shape[1] // local.q_len
  print("RESULT " + json.dumps({"check": "case", "impl": impl, "case": case,
                                "errors": relative_errors(actual, expected), "chunks": layout,
                                "expected_chunks": chunks, "local_kv_len": local.kv_len}), flush=True)


def _collectives(text: str) -> dict[str, list[str]]:
  """op -> the result shapes of its instructions in compiled HLO text (async pairs by their start)."""
  found: dict[str, list[str]] = {}
  for op in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all"):
    pattern = re.compile(rf"= (\S+) {op}(?:-start)?\(")
    found[op] = [m.group(1).split("{")[0] for m in map(pattern.search, text.splitlines()) if m]
  return found


def check_hlo(impl="xla_chunked"):
  """The collectives of the compiled forward and of the compiled gradient program (causal_gqa,
  sequence axis of 4: K/V shards f32[2,16,2,16], the whole sequence f32[2,64,2,16])."""
  q, k, v, kwargs = problem("causal_gqa")
  request, args = validate.prepare(q, k, v, **kwargs)
  loss, _ = sharded_loss(impl, request, args, CASES["causal_gqa"][2])
  grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
  forward = jax.jit(lambda q, k, v: loss(q, k, v, ())[1])
  texts = {"forward": forward.lower(q, k, v).compile().as_text(),
           "grad": grad_fn.lower(q, k, v, ()).compile().as_text()}
  print("RESULT " + json.dumps({"check": "hlo", "impl": impl,
                                **{name: _collectives(text) for name, text in texts.items()}}), flush=True)


def main(argv):
  impl = argv[0]
  if "hlo" in argv[1:]:
    check_hlo(impl)
  for case in IMPL_CASES.get(impl, tuple(CASES)):
    check(impl, case)


if __name__ == "__main__":
  main(sys.argv[1:])
