"""Checks of sharded attention that need several devices, run in a subprocess by test_parallel.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel_worker.py meshes+hlo IMPL,...
    ... parallel_worker.py process ID NUM_PROCESSES PORT     (one process of a multi-process job)

Each check prints one JSON object per line, prefixed by RESULT, so the test can
start JAX once and check many things. Errors are relative: max |sharded - unsharded|
over max |unsharded|, for the output and each gradient.
"""

from __future__ import annotations

import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl
from flash_layers import parallel

MESHES = ((8, 1, 1, 1), (2, 1, 4, 1), (1, 1, 2, 4), (2, 1, 1, 4), (1, 2, 1, 4))
SEQUENCE_MESHES = tuple(m for m in MESHES if m[3] > 1)


def emit(**fields):
  print("RESULT " + json.dumps(fields), flush=True)


def problem(case: str, batch=8, length=64, head_dim=16, seed=0):
  """q, k, v and attention kwargs of a named case.

  causal_packed_gqa: causal, packed documents then padding (id 0), 2 kv heads; the keys
    lack document 2, so its queries see nothing (rows 0, gradients 0).
  window_mqa: a (5, 2) window, one kv head, no causal mask (the contiguous ring layout).
  uneven_gqa: 6 heads on 3 kv heads, so 2 tensor shards' heads straddle kv groups.
  explicit_mqa: causal_packed_gqa with one kv head, on a mesh with Explicit axis types.
  dropout_alibi: causal_packed_gqa with dropout (rate 0.3), ALiBi and attention sinks: the mask
    hashes global batch rows, heads and positions, so every mesh must give the unsharded result;
    the sinks join each row's denominator once, after a ring has merged its shards.
  bias_heads: a dense bias [batch, heads, q, kv], split with q over data and tensor.
  global_window_packed: a (5, 2) window with 2 global tokens per packed document: the encoded
    segment ids (global flag in the lowest bit) rotate around the ring.
  """
  rng = np.random.default_rng(seed)
  heads, kv_heads = {"causal_packed_gqa": (4, 2), "window_mqa": (4, 1), "uneven_gqa": (6, 3),
                     "explicit_mqa": (4, 1), "dropout_alibi": (4, 2), "bias_heads": (4, 2),
                     "global_window_packed": (4, 2)}[case]
  q = rng.standard_normal((batch, length, heads, head_dim))
  k = rng.standard_normal((batch, length, kv_heads, head_dim))
  v = rng.standard_normal((batch, length, kv_heads, head_dim))
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  if case == "window_mqa":
    return q, k, v, {"window": (5, 2)}
  if case == "uneven_gqa":
    return q, k, v, {"causal": True}
  if case == "bias_heads":
    return q, k, v, {"causal": True, "bias": jnp.asarray(rng.standard_normal((batch, heads, length, length)),
                                                          jnp.float32)}
  seg = np.zeros((batch, length), np.int32)
  for row in range(batch):
    bounds = np.sort(rng.choice(np.arange(1, length), size=3, replace=False))
    for doc, (lo, hi) in enumerate(zip((0, *bounds[:-1]), bounds, strict=True)):
      seg[row, lo:hi] = doc + 1
  if case == "global_window_packed":
    return q, k, v, {"window": (5, 2), "global_tokens": 2, "segment_ids": jnp.asarray(seg)}
  kv_seg = np.where(seg == 2, 7, seg)
  kwargs = {"causal": True, "segment_ids": jnp.asarray(seg), "kv_segment_ids": jnp.asarray(kv_seg)}
  if case == "dropout_alibi":
    kwargs.update(dropout_rate=0.3, dropout_rng=jax.random.key(11), alibi_slopes=fl.alibi_slopes(heads),
                  sinks=jnp.asarray(rng.standard_normal(heads) + 1.0, jnp.float32))
  return q, k, v, kwargs


def value_and_grads(impl, mesh, kwargs):
  """jit(q, k, v, arrays) -> ((dq, dk, dv), out); `arrays` are the array entries of kwargs."""
  static = {name: x for name, x in kwargs.items() if not hasattr(x, "shape")}

  def loss(q, k, v, arrays):
    out = fl.attention(q, k, v, impl=impl, mesh=mesh, context_parallel="ring", **static, **arrays)
    return jnp.sum(jnp.sin(out) * jnp.arange(out.shape[-1])), out

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


def arrays_of(kwargs):
  return {name: x for name, x in kwargs.items() if hasattr(x, "shape")}


def relative_errors(actual, expected) -> dict[str, float]:
  names = ("dq", "dk", "dv", "out")
  actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
  errors = {}
  for name, a, e in zip(names, actual, expected, strict=True):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    errors[name] = float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))
  return errors


# dropout_alibi: data x tensor, tensor x ring (zig-zag) and fsdp x ring cover every axis its hash sees.
CASES = {"causal_packed_gqa": MESHES, "dropout_alibi": ((2, 1, 4, 1), (1, 1, 2, 4), (1, 2, 1, 4)),
         "window_mqa": ((2, 1, 4, 1), (1, 1, 2, 4)),
         "uneven_gqa": ((4, 1, 2, 1),), "explicit_mqa": ((2, 1, 2, 2),), "bias_heads": ((2, 1, 4, 1),),
         "global_window_packed": ((1, 1, 2, 4),)}
# Cases that test how a call is split, not an impl: run with the reference only.
PLAN_CASES = ("uneven_gqa", "explicit_mqa", "bias_heads")


# The other impls: causal_packed_gqa on the three meshes that hold every axis (data x tensor,
# tensor x ring, fsdp x ring) instead of five. flash_pallas runs interpreted (seconds per
# compiled program, proportional to the batch): a batch of 4, causal_packed_gqa on data x tensor
# and tensor x ring (its dropout_alibi case runs fsdp x ring), and one mesh per other case, the
# one with a ring.
THREE_MESHES = {"causal_packed_gqa": ((2, 1, 4, 1), (1, 1, 2, 4), (1, 2, 1, 4))}
INTERPRETED_MESHES = {"causal_packed_gqa": ((2, 1, 4, 1), (1, 1, 2, 4)), "dropout_alibi": ((1, 2, 1, 4),),
                      "window_mqa": ((1, 1, 2, 4),)}


def cases_for(impl: str) -> dict:
  cases = {case: meshes for case, meshes in CASES.items() if impl == "reference" or case not in PLAN_CASES}
  if impl != "reference":
    cases.update(THREE_MESHES)
  if impl == "flash_pallas":
    cases.update(INTERPRETED_MESHES)
  return cases


def batch_for(impl: str) -> int:
  return 4 if impl == "flash_pallas" else 8


def make_mesh(case, shape):
  if case != "explicit_mqa":
    return parallel.make_mesh(*shape)
  # jax.make_mesh's default axis types are Explicit (jax >= 0.7): shard_map then needs inputs
  # already sharded as its in_specs.
  return jax.make_mesh(shape, parallel.AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 4)


def check_meshes(impls):
  """Forward and gradients of each sharded call against the same impl unsharded."""
  for impl in impls:
    for case, meshes in cases_for(impl).items():
      q, k, v, kwargs = problem(case, batch=batch_for(impl))
      expected = value_and_grads(impl, None, kwargs)(q, k, v, arrays_of(kwargs))
      for shape in meshes:
        mesh = make_mesh(case, shape)
        try:
          actual = value_and_grads(impl, mesh, kwargs)(q, k, v, arrays_of(kwargs))
          emit(check="mesh", impl=impl, case=case, mesh=list(shape),
               errors=relative_errors(actual, expected),
               explain=str(fl.explain(q, k, v, impl=impl, mesh=mesh, context_parallel="ring", **kwargs)))
        except Exception as e:  # report, and go on with the other meshes
          emit(check="mesh", impl=impl, case=case, mesh=list(shape), error=f"{type(e).__name__}: {e}")


def check_gpu_kernels(shape=(1, 1, 2, 4)):
  """The ring with flash_pallas's GPU (Triton) kernels, interpreted, on one mesh."""
  q, k, v, kwargs = problem("causal_packed_gqa")
  with fl.interpret_as("gpu"):
    expected = value_and_grads("flash_pallas", None, kwargs)(q, k, v, arrays_of(kwargs))
    mesh = parallel.make_mesh(*shape)
    actual = value_and_grads("flash_pallas", mesh, kwargs)(q, k, v, arrays_of(kwargs))
    explain = str(fl.explain(q, k, v, impl="flash_pallas", mesh=mesh, context_parallel="ring", **kwargs))
  emit(check="gpu", mesh=list(shape), errors=relative_errors(actual, expected), explain=explain)


def compile_ring(impl, length, sequence):
  """Forward+backward of a causal packed ring over the first `sequence` devices, compiled."""
  mesh = parallel.make_mesh(sequence=sequence, devices=jax.devices()[:sequence])
  q = jax.ShapeDtypeStruct((1, length, 2, 32), jnp.float32)
  seg = jax.ShapeDtypeStruct((1, length), jnp.int32)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))

  def loss(q, k, v, seg):
    out = fl.attention(q, k, v, impl=impl, causal=True, segment_ids=seg, mesh=mesh, context_parallel="ring")
    return jnp.sum(out ** 2)

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(sharding,) * 4,
                 out_shardings=(sharding,) * 3)
  return step.lower(q, q, q, seg).compile()


def check_hlo(length=1536):
  """The compiled ring: collective-permutes, no buffer holding the whole sequence, and
  temporary memory per device that halves when the ring doubles (xla_chunked is linear)."""
  for impl in ("reference", "xla_chunked"):
    compiled = compile_ring(impl, length, 8)
    text = compiled.as_text()
    ops = {op: len(re.findall(rf"\b{op}(?:-start)?\(", text))
           for op in ("collective-permute", "all-gather", "all-to-all", "all-reduce")}
    # Any array with a dimension of the full length would be a gathered sequence.
    full = sorted(set(re.findall(rf"\w+\[[0-9,]*\b{length}\b[0-9,]*\]", text)))
    temp = {8: compiled.memory_analysis().temp_size_in_bytes}
    if impl == "xla_chunked":
      temp[4] = compile_ring(impl, length, 4).memory_analysis().temp_size_in_bytes
    emit(check="hlo", impl=impl, ops=ops, full_length_shapes=full[:10], temp_bytes=temp)


def _kernel_calls(jaxpr, counts):
  """Counts pallas_calls by name in a jaxpr and every jaxpr nested in it."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      name = eqn.params.get("name") or eqn.params.get("name_and_src_info")
      name = name if isinstance(name, str) else name.name
      counts[name] = counts.get(name, 0) + 1
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          _kernel_calls(sub, counts)
  return counts


def check_ring_kernels(shape=(2, 1, 1, 4)):
  """The pallas_calls in the jaxprs of a ring's forward and value_and_grad (TPU kernels)."""
  mesh = parallel.make_mesh(*shape)
  for case in ("window_mqa", "causal_packed_gqa"):  # contiguous and zig-zag layouts
    q, k, v, kwargs = problem(case, batch=2)
    arrays = arrays_of(kwargs)

    def loss(q, k, v, arrays, kwargs=kwargs):
      out = fl.attention(q, k, v, impl="flash_pallas", mesh=mesh, context_parallel="ring",
                         **{**kwargs, **arrays})
      return jnp.sum(out ** 2)

    with fl.interpret_as("tpu"):
      forward = _kernel_calls(jax.make_jaxpr(loss)(q, k, v, arrays).jaxpr, {})
      both = _kernel_calls(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
          q, k, v, arrays).jaxpr, {})
    emit(check="ring_kernels", case=case, forward=forward, value_and_grad=both)


def check_layer():
  """fl.MultiHeadAttention with a mesh (given, or current) against the same params unsharded."""
  import flax.linen as nn

  mesh = parallel.make_mesh(data=2, tensor=2, sequence=2)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((4, 32, 24)), jnp.float32)
  seg = jnp.asarray(np.repeat(np.array([[1] * 20 + [2] * 8 + [0] * 4]), 4, axis=0), jnp.int32)
  fields = dict(num_heads=4, num_kv_heads=2, head_dim=8, impl="xla_chunked", causal=True)
  params = nn.meta.unbox(fl.MultiHeadAttention(**fields).init(jax.random.key(0), x))

  def value_and_grad(layer):
    def loss(params, x):
      out = layer.apply(params, x, segment_ids=seg)
      return jnp.sum(jnp.sin(out)), out
    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))

  expected = value_and_grad(fl.MultiHeadAttention(**fields))(params, x)
  given = value_and_grad(fl.MultiHeadAttention(**fields, mesh=mesh))(params, x)
  with jax.set_mesh(mesh):
    current = value_and_grad(fl.MultiHeadAttention(**fields))(params, x)
  for name, actual in (("given", given), ("current", current)):
    # Relative, with a floor of 1: the key bias's gradient is zero up to rounding (softmax
    # ignores a shift common to all logits of a row).
    errors = [float(np.max(np.abs(np.asarray(a) - np.asarray(e))) / max(np.max(np.abs(np.asarray(e))), 1.0))
              for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)]
    emit(check="layer", mesh=name, max_error=max(errors))


def check_attention_fn():
  """flax's MultiHeadDotProductAttention with fl.attention_fn on a data x tensor mesh (given as
  attention_fn's `mesh=`, or current) against the same params without a mesh: flax's dense mask
  (causal and padding, [batch, 1, q, kv]) and dropout per batch row and head both travel through
  shard_map, and the traced call holds a shard_map."""
  import flax.linen as nn

  mesh = parallel.make_mesh(data=2, tensor=2)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((4, 16, 32)), jnp.float32)
  valid = jnp.arange(16)[None, :] < jnp.asarray([[16], [11], [7], [16]])
  mask = nn.combine_masks(nn.make_causal_mask(valid), nn.make_attention_mask(valid, valid))

  def layer(**fixed):
    return nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.3, broadcast_dropout=False,
                                           attention_fn=fl.attention_fn(impl="auto", **fixed))

  params = layer().init(jax.random.key(0), x, deterministic=True)

  def loss(layer, params, x):
    out = layer.apply(params, x, mask=mask, deterministic=False, rngs={"dropout": jax.random.key(3)})
    return jnp.sum(jnp.sin(out)), out

  def value_and_grad(layer):
    return jax.jit(jax.grad(functools.partial(loss, layer), argnums=(0, 1), has_aux=True))

  def has_shard_map(layer):
    return "shard_map" in str(jax.make_jaxpr(functools.partial(loss, layer))(params, x))

  expected = value_and_grad(layer())(params, x)
  given = value_and_grad(layer(mesh=mesh))(params, x)
  sharded = {"given": has_shard_map(layer(mesh=mesh))}
  with jax.set_mesh(mesh):
    current = value_and_grad(layer())(params, x)
    sharded["current"] = has_shard_map(layer())
  for name, actual in (("given", given), ("current", current)):
    # As check_layer: relative, with a floor of 1 (the key bias's gradient is zero up to rounding).
    errors = [float(np.max(np.abs(np.asarray(a) - np.asarray(e))) / max(np.max(np.abs(np.asarray(e))), 1.0))
              for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)]
    emit(check="attention_fn", mesh=name, max_error=max(errors), sharded=sharded[name])


def check_process(process_id: int, num_processes: int, port: int):
  """One process of a multi-process job: sharded calls against this process's unsharded result."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                             process_id=process_id)
  n = len(jax.devices())
  for case in ("causal_packed_gqa", "window_mqa"):
    q, k, v, kwargs = problem(case, batch=4, length=32)
    expected = value_and_grads("reference", None, kwargs)(q, k, v, arrays_of(kwargs))  # local device
    for shape in ((1, 1, 1, n), (2, 1, n // 2, 1), (1, 1, 2, n // 2)):
      mesh = parallel.make_mesh(*shape)
      replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      # Global arrays: every process holds the same values (same seed).
      to_global = lambda x, s=replicated: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i])
      step = jax.jit(value_and_grads("reference", mesh, kwargs), out_shardings=replicated)
      actual = step(*(to_global(x) for x in (q, k, v)), jax.tree.map(to_global, arrays_of(kwargs)))
      actual = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), actual)
      emit(check="process", process=process_id, devices=n, case=case, mesh=list(shape),
           errors=relative_errors(actual, expected))
  jax.distributed.shutdown()


if __name__ == "__main__":
  what = sys.argv[1]
  if what == "process":
    check_process(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
  else:
    for check in what.split("+"):
      if check == "hlo":
        check_hlo()
      elif check == "layer":
        check_layer()
      elif check == "attention_fn":
        check_attention_fn()
      elif check == "gpu":
        check_gpu_kernels()
      elif check == "ring_kernels":
        check_ring_kernels()
      elif check == "meshes":
        check_meshes(sys.argv[2].split(","))
      else:
        raise SystemExit(f"unknown check {check!r}; meshes, hlo, layer, attention_fn, gpu (joined by +) "
                         "or process")
