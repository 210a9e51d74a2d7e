"""Multi-device checks of the "ulysses" and "ulysses_ring" strategies, run by test_cp_ulysses.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/cp_ulysses_worker.py IMPL

Each strategy function is called directly inside `jax.shard_map` (check_vma=False), as
parallel/sharded.py calls it: batch over "data", heads over "tensor", tokens over "sequence".
Prints one RESULT json line per (strategy, case, mesh, group): the relative error (max |sharded -
unsharded| / max |unsharded|) of out, lse and every gradient (q, k, v, float mod operands) against
the unsharded `dispatch.attend` with the same impl and arguments.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import flash_layers as fl
from flash_layers import dispatch, validate
from flash_layers.impls import Args
from flash_layers.parallel import ulysses
from flash_layers.parallel.context import CPConfig

STRATEGIES = {"ulysses": ulysses.attention, "ulysses_ring": ulysses.hybrid_attention}


def _rel_bias(score, b, h, q_idx, kv_idx, table):
  return score + table[h, jnp.clip(kv_idx - q_idx, -4, 4) + 4]


PREFIX_LM = fl.masks.prefix_lm(operand=0)


def problem(case: str, batch=2, length=64, head_dim=16, seed=0):
  """q, k, v and `validate.prepare` keywords of a named case (global arrays)."""
  rng = np.random.default_rng(seed)
  heads, kv_heads = {"window": (4, 4), "mask_mod": (4, 2), "score_table": (4, 4)}.get(case, (8, 2))
  q, k, v = (jnp.asarray(rng.standard_normal((batch, length, h, head_dim)), jnp.float32)
             for h in (heads, kv_heads, kv_heads))
  if case == "window":
    return q, k, v, {"window": (5, 2)}
  if case == "mask_mod":  # prefix-LM: a per-row prefix length, indexed with the global row
    return q, k, v, {"mask_mod": PREFIX_LM, "mod_operands": (jnp.asarray([10, 37], jnp.int32),)}
  if case == "score_table":  # a learned relative-bias table: its gradient is checked too
    table = jnp.asarray(rng.standard_normal((heads, 9)), jnp.float32)
    return q, k, v, {"causal": True, "score_mod": _rel_bias, "mod_operands": (table,)}
  seg = np.zeros((batch, length), np.int32)
  for row in range(batch):
    bounds = np.sort(rng.choice(np.arange(1, length), size=3, replace=False))
    for doc, (lo, hi) in enumerate(zip((0, *bounds[:-1]), bounds, strict=True)):
      seg[row, lo:hi] = doc + 1
  kwargs = {"causal": True, "segment_ids": jnp.asarray(seg)}
  if case == "dropout_alibi":
    kwargs.update(dropout_rate=0.3, dropout_rng=jax.random.key(11), alibi_slopes=fl.alibi_slopes(heads))
  return q, k, v, kwargs


def _loss(out, lse):
  finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.sum(jnp.sin(out) * jnp.arange(out.shape[-1])) + 0.1 * jnp.sum(finite)


def _value_and_grads(attend, args: Args):
  """jit(q, k, v, float operands) -> ((dq, dk, dv, d operands), (out, lse))."""
  ops = args.mod_operands
  floats = [i for i, x in enumerate(ops) if jnp.issubdtype(x.dtype, jnp.floating)]

  def loss(q, k, v, float_ops):
    full = list(ops)
    for i, x in zip(floats, float_ops, strict=True):
      full[i] = x
    out, lse = attend(q, k, v, tuple(full))
    return _loss(out, lse), (out, lse)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  return lambda q, k, v: grad(q, k, v, [ops[i] for i in floats])


def sharded(strategy, impl, request, args: Args, shape, group):
  """attend(q, k, v, operands) -> global (out, lse), through the strategy on mesh `shape`."""
  data, tensor, size = shape
  mesh = fl.make_mesh(data=data, tensor=tensor, sequence=size)
  local = dataclasses.replace(request, batch=request.batch // data, num_heads=request.num_heads // tensor,
                              num_kv_heads=request.num_kv_heads // tensor)
  config = CPConfig(impl=impl, request=local, axis="sequence", size=size, group=group)

  def local_call(q, k, v, q_seg, kv_seg, seed, slopes, ops):
    local_args = Args(batch_offset=jax.lax.axis_index("data") * local.batch,
                      head_offset=jax.lax.axis_index("tensor") * local.num_heads,
                      dropout_seed=seed, alibi_slopes=slopes, mod_operands=ops)
    return STRATEGIES[strategy](q, k, v, q_seg, kv_seg, config, local_args)

  heads, seg = P("data", "sequence", "tensor", None), P("data", "sequence")

  def attend(q, k, v, ops):
    in_specs = (heads, heads, heads, seg, seg, P(), P("tensor"), P())
    f = jax.shard_map(local_call, mesh=mesh, in_specs=in_specs,
                      out_specs=(heads, P("data", "tensor", "sequence")), check_vma=False)
    return f(q, k, v, args.q_segment_ids, args.kv_segment_ids, args.dropout_seed, args.alibi_slopes, ops)

  return attend


def relative_errors(actual, expected) -> dict[str, float]:
  (grads, (out, lse)), (e_grads, (e_out, e_lse)) = actual, expected
  names = ["dq", "dk", "dv"] + [f"d_operand{i}" for i in range(len(grads[3]))]
  values = zip((*grads[:3], *grads[3]), (*e_grads[:3], *e_grads[3]), strict=True)
  pairs = dict(zip(names, values, strict=True))
  pairs.update(out=(out, e_out), lse=(lse, e_lse))
  errors = {}
  for name, (a, e) in pairs.items():
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    if not np.array_equal(np.isfinite(a), np.isfinite(e)):
      errors[name] = float("inf")
      continue
    a, e = np.where(np.isfinite(e), a, 0.0), np.where(np.isfinite(e), e, 0.0)
    errors[name] = float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))
  return errors


# (strategy, case, (data, tensor, sequence), group) per impl; flash_pallas runs interpreted (slow).
RUNS = {
    "reference": [
        ("ulysses", "causal_packed_gqa", (2, 1, 4), 1), ("ulysses", "causal_packed_gqa", (1, 2, 4), 1),
        ("ulysses", "causal_packed_gqa", (1, 1, 8), 1), ("ulysses", "window", (2, 1, 4), 1),
        ("ulysses", "dropout_alibi", (1, 2, 4), 1), ("ulysses", "mask_mod", (2, 1, 4), 1),
        ("ulysses", "score_table", (2, 1, 4), 1),
        ("ulysses_ring", "causal_packed_gqa", (2, 1, 4), 2), ("ulysses_ring", "window", (1, 1, 8), 2),
        ("ulysses_ring", "dropout_alibi", (1, 2, 4), 2), ("ulysses_ring", "mask_mod", (1, 1, 8), 4),
        ("ulysses_ring", "score_table", (2, 1, 4), 2), ("ulysses_ring", "score_table", (2, 1, 4), 1),
    ],
    "xla_chunked": [
        ("ulysses", "causal_packed_gqa", (1, 2, 4), 1), ("ulysses", "dropout_alibi", (2, 1, 4), 1),
        ("ulysses", "score_table", (2, 1, 4), 1), ("ulysses", "mask_mod", (2, 1, 4), 1),
        ("ulysses_ring", "causal_packed_gqa", (1, 1, 8), 4), ("ulysses_ring", "score_table", (1, 1, 8), 2),
    ],
    "flash_pallas": [
        ("ulysses", "causal_packed_gqa", (2, 1, 4), 1), ("ulysses_ring", "causal_packed_gqa", (2, 1, 4), 2),
        ("ulysses_ring", "score_table", (2, 1, 4), 1),  # the plain ring: the kernels' operand gradients
    ],
}


def check(impl: str):
  for strategy, case, shape, group in RUNS[impl]:
    q, k, v, kwargs = problem(case)
    request, args = validate.prepare(q, k, v, **kwargs)
    unsharded = lambda q, k, v, ops, args=args, request=request: dispatch.attend(  # noqa: E731
        q, k, v, impl=impl, request=request, args=dataclasses.replace(args, mod_operands=ops))
    fields = dict(impl=impl, strategy=strategy, case=case, mesh=list(shape), group=group)
    try:
      expected = _value_and_grads(unsharded, args)(q, k, v)
      attend = sharded(strategy, impl, request, args, shape, group)
      actual = _value_and_grads(attend, args)(q, k, v)
      print("RESULT " + json.dumps(dict(fields, errors=relative_errors(actual, expected))), flush=True)
    except Exception as e:  # report, and go on with the other runs
      print("RESULT " + json.dumps(dict(fields, error=f"{type(e).__name__}: {e}"[:2000])), flush=True)


def check_hlo():
  """Which collectives each strategy compiles to (reference impl, causal_packed_gqa, no grads)."""
  q, k, v, kwargs = problem("causal_packed_gqa")
  request, args = validate.prepare(q, k, v, **kwargs)
  for strategy, group in (("ulysses", 1), ("ulysses_ring", 2)):
    attend = sharded(strategy, "reference", request, args, (2, 1, 4), group)
    text = jax.jit(attend).lower(q, k, v, ()).compile().as_text()
    ops = {op: text.count(f" {op}(") + text.count(f" {op}-start(")
           for op in ("all-to-all", "collective-permute", "all-gather")}
    print("RESULT " + json.dumps(dict(check="hlo", strategy=strategy, ops=ops)), flush=True)


if __name__ == "__main__":
  for name in sys.argv[1].split(","):
    if name == "hlo":
      check_hlo()
    elif name == "flash_pallas":
      with fl.interpret_as("tpu"):
        check(name)
    else:
      check(name)
