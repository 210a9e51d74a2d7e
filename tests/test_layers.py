"""The layers: Flax (linen and NNX) and Haiku MultiHeadAttention and the attention_fn adapter.

Independent references: flax's own MultiHeadDotProductAttention / nnx
MultiHeadAttention with their default dot-product attention (masks built with
flax's helpers), loaded with the same weights. Every impl in fl.IMPLS runs; none is skipped.
The NNX layer runs the linen layer's tests through `NnxLayer`, which loads the linen
params into it (so those tests also check that the weights port).
"""

import dataclasses
import functools
import importlib
import inspect
import sys

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flash_layers as fl
from flash_layers import haiku as flh
from flash_layers import nnx as flnnx

IMPLS = fl.IMPLS
BATCH, Q_LEN, KV_LEN, EMBED, KV_EMBED, HEADS = 2, 12, 9, 32, 24, 4
TOL = dict(rtol=2e-5, atol=2e-5)


def inputs(length=Q_LEN, features=EMBED, seed=0):
  return jax.random.normal(jax.random.key(seed), (BATCH, length, features), jnp.float32)


def segments(length, seed):
  """Packed documents 1, 2, ... with trailing padding 0, different per row."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(BATCH):
    cuts = np.sort(rng.choice(np.arange(1, length), size=2, replace=False))
    ids = np.searchsorted(cuts, np.arange(length), side="right") + 1
    ids[length - rng.integers(0, 3):] = 0
    rows.append(ids)
  return jnp.asarray(np.stack(rows), jnp.int32)


# Layers run op by op: XLA caches each small op across tests, which on the CPU
# costs less than compiling one program per call. Only gradients are jitted.

def apply(module, params, *args, **kwargs):
  return module.apply(params, *args, **kwargs)


def nnx_call(model, *args, **kwargs):
  return model(*args, **kwargs)


def init_params(layer, *args, **kwargs):
  """Params with random biases too, so that a misplaced bias cannot hide."""
  layer = layer.clone(impl="reference", bias_init=nn.initializers.normal(0.5))
  return nn.meta.unbox(layer.init(jax.random.key(1), *args, **kwargs))


def flax_mha(**kwargs):
  return nn.MultiHeadDotProductAttention(num_heads=HEADS, **kwargs)


class NnxLayer:
  """`flash_layers.nnx.MultiHeadAttention` behind the linen layer's `clone`/`apply(variables, ...)`.

  `apply` builds the NNX layer for the inputs' widths and loads the linen variables into it.
  Dropout keys: `rngs={"dropout": key}` is passed to the call as the key itself.
  """

  def __init__(self, **fields):
    self.fields = fields

  def clone(self, **fields):
    return NnxLayer(**{**self.fields, **fields})

  def build(self, inputs_q, inputs_kv=None, variables=None):
    fields = dict(self.fields)
    in_kv = None if inputs_kv is None else inputs_kv.shape[-1]
    model = flnnx.MultiHeadAttention(fields.pop("num_heads"), inputs_q.shape[-1], in_kv_features=in_kv,
                                     rngs=nnx.Rngs(0), **fields)
    if variables is not None:
      state = nnx.state(model, nnx.Param)
      state.replace_by_pure_dict(flnnx.params_from_linen(variables))
      nnx.update(model, state)
    return model

  def apply(self, variables, inputs_q, inputs_kv=None, *, rngs=None, **kwargs):
    model = self.build(inputs_q, inputs_kv, variables)
    if rngs is not None:
      kwargs["rngs"] = rngs["dropout"]
    return model(inputs_q, inputs_kv, **kwargs)


KINDS = ("linen", "nnx")


def make_layer(kind, **fields):
  return fl.MultiHeadAttention(**fields) if kind == "linen" else NnxLayer(**fields)


# ----------------------------------------------------------------------------
# One layer, every impl
# ----------------------------------------------------------------------------

CASES = {
    "gqa_causal_segments": dict(layer=dict(num_kv_heads=2, causal=True), cross=False, seg=True),
    "mqa_window_head_dim": dict(layer=dict(num_kv_heads=1, head_dim=16, window=(3, 1), out_features=20),
                                cross=False, seg=False),
    "cross_segments_scale": dict(layer=dict(num_kv_heads=2, scale=0.3), cross=True, seg=True),
}


@functools.cache
def case_setup(case):
  """(layer, params, args, kwargs, loss_and_grad, reference value and grads) for one case."""
  spec = CASES[case]
  x = inputs()
  args = (x, inputs(KV_LEN, KV_EMBED, seed=2)) if spec["cross"] else (x,)
  kwargs = {}
  if spec["seg"]:
    kwargs["segment_ids"] = segments(Q_LEN, 3)
    if spec["cross"]:
      kwargs["kv_segment_ids"] = segments(KV_LEN, 4)
  layer = fl.MultiHeadAttention(num_heads=HEADS, **spec["layer"])
  params = init_params(layer, *args, **kwargs)

  def loss(params, impl, kind):
    impl_layer = make_layer(kind, num_heads=HEADS, impl=impl, **spec["layer"])
    return jnp.sum(jnp.sin(impl_layer.apply(params, *args, **kwargs)))

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2))
  return layer, params, args, kwargs, value_and_grad, value_and_grad(params, "reference", "linen")


# The NNX layer makes the same attend_heads call as the linen one; flash_pallas and jax_splash (slow
# in interpret mode) run for linen only.
INTERPRETED = ("flash_pallas", "jax_splash")
IMPL_KINDS = ([(impl, "linen") for impl in IMPLS]
              + [(impl, "nnx") for impl in IMPLS if impl not in INTERPRETED])


@pytest.mark.parametrize(("impl", "kind"), IMPL_KINDS)
@pytest.mark.parametrize("case", CASES)
def test_same_params_same_output_under_every_impl(case, impl, kind):
  """Forward and parameter gradients of one layer agree across impls (vs the linen layer, reference impl)."""
  layer, params, args, kwargs, value_and_grad, (want, want_grad) = case_setup(case)
  got, got_grad = value_and_grad(params, impl, kind)
  np.testing.assert_allclose(got, want, **TOL)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **TOL), got_grad, want_grad)
  out = jax.eval_shape(layer.clone(impl=impl).apply, params, *args, **kwargs)
  assert out.shape == (BATCH, Q_LEN, CASES[case]["layer"].get("out_features", EMBED))


@pytest.mark.parametrize("kind", KINDS)
def test_unsupported_features_raise_for_xla_native(kind):
  x = inputs()
  layer = make_layer(kind, num_heads=HEADS, softcap=20.0, impl="xla_native")
  params = jax.eval_shape(fl.MultiHeadAttention(num_heads=HEADS).init, jax.random.key(0), x)
  with pytest.raises(fl.UnsupportedError, match="softcap"):
    jax.eval_shape(layer.apply, params, x)
  # head_dim_v != head_dim: other impls serve it, xla_native refuses it by name.
  layer = make_layer(kind, num_heads=HEADS, head_dim_v=4, impl="xla_native")
  params = nn.meta.unbox(jax.eval_shape(fl.MultiHeadAttention(num_heads=HEADS, head_dim_v=4).init,
                                        jax.random.key(0), x))
  assert params["params"]["value"]["kernel"].shape == (EMBED, HEADS, 4)
  assert params["params"]["out"]["kernel"].shape == (HEADS, 4, EMBED)
  with pytest.raises(fl.UnsupportedError, match="head_dim_v"):
    jax.eval_shape(layer.apply, params, x)
  # Dropout: xla_native (jax.nn.dot_product_attention) has none.
  layer = make_layer(kind, num_heads=HEADS, dropout_rate=0.1, impl="xla_native")
  params = jax.eval_shape(fl.MultiHeadAttention(num_heads=HEADS).init, jax.random.key(0), x)
  with pytest.raises(fl.UnsupportedError, match="dropout"):
    jax.eval_shape(functools.partial(layer.apply, deterministic=False), params, x,
                   rngs={"dropout": jax.random.key(0)})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", ["reference", "xla_native"])
def test_bfloat16_compute(impl, kind):
  """dtype=bfloat16 computes and returns bfloat16, close to the float32 layer with the same params."""
  x = inputs()
  layer = make_layer(kind, num_heads=HEADS, num_kv_heads=2, causal=True, impl=impl)
  params = init_params(fl.MultiHeadAttention(num_heads=HEADS, num_kv_heads=2), x)
  out = apply(layer.clone(dtype=jnp.bfloat16), params, x)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), apply(layer, params, x), atol=0.1, rtol=0.05)


# ----------------------------------------------------------------------------
# Against flax's own attention modules
# ----------------------------------------------------------------------------

# The other impls equal the reference in the layer (test above, with gradients), so
# reference and auto (the default) suffice against flax.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_layer_matches_flax_mha(impl, kind):
  """Same weights, flax's own dot-product attention: also checks the 1/sqrt(head_dim) default scale."""
  x, y = inputs(), inputs(KV_LEN, seed=2)  # same features: the params serve self- and cross-attention
  q_seg, kv_seg = segments(Q_LEN, 5), segments(KV_LEN, 6)
  params = init_params(fl.MultiHeadAttention(num_heads=HEADS), x, y)
  ours = make_layer(kind, num_heads=HEADS, impl=impl)
  # Flax's param tree is ours: init it from the same key and compare the structure.
  theirs = jax.eval_shape(flax_mha().init, jax.random.key(1), x, y)
  assert jax.tree.map(jnp.shape, theirs) == jax.tree.map(jnp.shape, params)

  got = apply(ours, params, x, y)
  np.testing.assert_allclose(got, apply(flax_mha(), params, x, y), **TOL)
  causal_mask = nn.make_causal_mask(jnp.ones((BATCH, Q_LEN)))
  got_causal = apply(ours.clone(causal=True), params, x)
  np.testing.assert_allclose(got_causal, apply(flax_mha(), params, x, mask=causal_mask), **TOL)
  assert not np.allclose(got_causal, apply(flax_mha(), params, x), atol=1e-3)  # the mask matters
  # Segment ids, cross-attention: flax's mask from equal ids.
  seg_mask = nn.make_attention_mask(q_seg, kv_seg, jnp.equal)
  got_seg = apply(ours, params, x, y, segment_ids=q_seg, kv_segment_ids=kv_seg)
  np.testing.assert_allclose(got_seg, apply(flax_mha(), params, x, y, mask=seg_mask), **TOL)


def _mask_impl_expectation(impl):
  """The Pallas kernels (flash_pallas, jax_splash) never take a dense mask; they must say so by name."""
  if impl in INTERPRETED:
    return pytest.raises(fl.UnsupportedError, match="dense mask")
  return None


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_fn_in_linen_mha(impl):
  x, y = inputs(), inputs(KV_LEN, seed=2)
  params = init_params(fl.MultiHeadAttention(num_heads=HEADS), x, y)
  adapted = flax_mha(attention_fn=fl.attention_fn(impl=impl))
  ours = fl.MultiHeadAttention(num_heads=HEADS, impl="reference")
  # No mask: every impl serves it.
  np.testing.assert_allclose(apply(adapted, params, x, y), apply(ours, params, x, y), **TOL)
  # A dense causal mask through the adapter == our layer with causal=True.
  mask = nn.make_causal_mask(jnp.ones((BATCH, Q_LEN)))
  expectation = _mask_impl_expectation(impl)
  if expectation is not None:
    with expectation:
      apply(adapted, params, x, mask=mask)
    return
  got = apply(adapted, params, x, mask=mask)
  np.testing.assert_allclose(got, apply(ours.clone(causal=True), params, x), **TOL)
  # Fixed options apply to every call: a custom scale and causal, with no mask.
  fixed = flax_mha(attention_fn=fl.attention_fn(impl=impl, scale=0.3, causal=True))
  np.testing.assert_allclose(apply(fixed, params, x),
                             apply(ours.clone(causal=True, scale=0.3), params, x), **TOL)


def test_attention_fn_extra_batch_dims():
  """flax modules accept [batch..., length, features]; the adapter flattens and restores them."""
  x = jax.random.normal(jax.random.key(0), (2, 3, Q_LEN, EMBED))
  module = flax_mha()
  adapted = flax_mha(attention_fn=fl.attention_fn(impl="reference"))
  mask = nn.make_causal_mask(jnp.ones((2, 3, Q_LEN)))

  @jax.jit
  def both(key):
    params = module.init(key, x)
    return adapted.apply(params, x, mask=mask), module.apply(params, x, mask=mask)

  got, want = both(jax.random.key(1))
  np.testing.assert_allclose(got, want, **TOL)


def _nnx_with_weights(params, **kwargs):
  model = nnx.MultiHeadAttention(num_heads=HEADS, in_features=EMBED, decode=False,
                                 rngs=nnx.Rngs(0), **kwargs)
  for name in ("query", "key", "value", "out"):
    getattr(model, name).kernel[...] = params["params"][name]["kernel"]
    getattr(model, name).bias[...] = params["params"][name]["bias"]
  return model


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_fn_in_nnx_mha(impl):
  """nnx passes its kwargs unfiltered (is_causal, ...); GQA heads as nnx lays them out."""
  x = inputs()
  params = init_params(fl.MultiHeadAttention(num_heads=HEADS, num_kv_heads=2), x)
  ours = fl.MultiHeadAttention(num_heads=HEADS, num_kv_heads=2, impl="reference")
  own = _nnx_with_weights(params, num_kv_heads=2)  # nnx's own attention: the independent check
  adapted = _nnx_with_weights(params, num_kv_heads=2, attention_fn=fl.attention_fn(impl=impl))
  np.testing.assert_allclose(apply(ours, params, x), nnx_call(own, x), **TOL)
  np.testing.assert_allclose(nnx_call(adapted, x), nnx_call(own, x), **TOL)
  np.testing.assert_allclose(nnx_call(adapted, x, is_causal=True), apply(ours.clone(causal=True), params, x),
                             **TOL)
  mask = nn.make_causal_mask(jnp.ones((BATCH, Q_LEN)))
  expectation = _mask_impl_expectation(impl)
  if expectation is not None:
    with expectation:
      nnx_call(adapted, x, mask=mask)
    return
  np.testing.assert_allclose(nnx_call(adapted, x, mask=mask), nnx_call(own, x, mask=mask), **TOL)


def test_attention_fn_refuses_what_it_cannot_do():
  q = k = v = jnp.ones((1, 4, 2, 8))
  fn = fl.attention_fn(impl="reference")
  with pytest.raises(fl.UnsupportedError, match="dense bias"):
    fl.attention_fn(impl="flash_pallas")(q, k, v, bias=jnp.zeros((1, 2, 4, 4)))
  with pytest.raises(fl.UnsupportedError, match="dropout"):
    fl.attention_fn(impl="xla_native")(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0))
  with pytest.raises(ValueError, match="needs a dropout_rng"):
    fn(q, k, v, dropout_rate=0.1, deterministic=False)
  np.testing.assert_allclose(fn(q, k, v, dropout_rate=0.1, deterministic=True), v)
  with pytest.raises(ValueError, match="bias must broadcast"):
    fn(q, k, v, bias=jnp.zeros((3, 4, 4)))
  with pytest.raises(fl.UnsupportedError, match="sow_weights"):  # an impl that never materialises them
    fl.attention_fn(impl="xla_chunked")(q, k, v, module=object())
  with pytest.raises(TypeError, match="surprise"):
    fn(q, k, v, surprise=1)
  fn(q, k, v, promote_dtype=None, force_fp32_for_softmax=True, is_causal=False)  # harmless
  with pytest.raises(ValueError, match="impl must be one of"):
    fl.attention_fn(impl="fastest")
  with pytest.raises(TypeError, match="segment_ids"):
    fl.attention_fn(segment_ids=jnp.ones((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="mask"):
    fn(q, k, v, mask=jnp.ones((3, 4, 4), bool))
  # flash_pallas skips blocks by the mask spec; it refuses a dense mask by name.
  with pytest.raises(fl.UnsupportedError, match="dense mask"):
    fl.attention_fn(impl="flash_pallas")(q, k, v, mask=jnp.ones((4, 4), bool))


# ----------------------------------------------------------------------------
# Haiku
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_flax_and_haiku_layers_agree(impl):
  x, y = inputs(), inputs(KV_LEN, KV_EMBED, seed=2)
  q_seg, kv_seg = segments(Q_LEN, 7), segments(KV_LEN, 8)
  fields = dict(num_kv_heads=2, causal=True, window=(4, 2), out_features=16)
  flax_layer = fl.MultiHeadAttention(num_heads=HEADS, impl=impl, **fields)
  params = init_params(flax_layer, x, y, segment_ids=q_seg, kv_segment_ids=kv_seg)
  haiku_fn = hk.without_apply_rng(hk.transform(
      lambda x, y: flh.MultiHeadAttention(HEADS, impl=impl, **fields)(
          x, y, segment_ids=q_seg, kv_segment_ids=kv_seg)))
  haiku_params = flh.params_from_flax(params)
  # Haiku's own init makes the same tree.
  assert jax.tree.map(jnp.shape, jax.eval_shape(haiku_fn.init, jax.random.key(0), x, y)) == jax.tree.map(
      jnp.shape, haiku_params)
  want = apply(flax_layer, params, x, y, segment_ids=q_seg, kv_segment_ids=kv_seg)
  np.testing.assert_allclose(haiku_fn.apply(haiku_params, x, y), want, **TOL)


def test_haiku_init_scale_matches_flax():
  """Kernels are drawn with fan-in = the input features (not embed * heads), as flax's DenseGeneral does."""
  x = inputs(features=64)
  fn = hk.transform(lambda x: flh.MultiHeadAttention(HEADS, num_kv_heads=1, head_dim=32)(x))
  params = jax.jit(fn.init)(jax.random.key(0), x)
  fan_in = dict(query=64, key=64, value=64, out=HEADS * 32)
  for name, fans in fan_in.items():
    std = float(params[f"multi_head_attention/{name}"]["kernel"].std())
    assert std == pytest.approx(fans ** -0.5, rel=0.15), name  # LeCun normal, as in flax


def test_haiku_missing_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "haiku", None)  # makes `import haiku` fail
  monkeypatch.delitem(sys.modules, "flash_layers.haiku")
  monkeypatch.delitem(sys.modules, "flash_layers.layers.haiku", raising=False)  # where the import is
  with pytest.raises(ImportError, match=r"pip install flash-layers\[haiku\]"):
    importlib.import_module("flash_layers.haiku")


# ----------------------------------------------------------------------------
# Metadata and bad fields
# ----------------------------------------------------------------------------

def test_logical_axis_names():
  x, y = inputs(), inputs(KV_LEN, KV_EMBED)
  variables = jax.eval_shape(fl.MultiHeadAttention(num_heads=HEADS, num_kv_heads=2).init, jax.random.key(0),
                             x, y)
  specs = nn.get_partition_spec(variables)["params"]
  P = jax.sharding.PartitionSpec
  assert specs["query"] == {"kernel": P("embed", "heads", "head_dim"), "bias": P("heads", "head_dim")}
  for name in ("key", "value"):
    assert specs[name] == {"kernel": P("embed", "kv_heads", "head_dim"),
                           "bias": P("kv_heads", "head_dim")}
  assert specs["out"] == {"kernel": P("heads", "head_dim", "embed"), "bias": P("embed")}
  shapes = jax.tree.map(jnp.shape, nn.meta.unbox(variables))["params"]
  assert shapes["key"]["kernel"] == (KV_EMBED, 2, EMBED // HEADS)


def _haiku_call(x, **fields):
  init = hk.transform(lambda x: flh.MultiHeadAttention(**fields)(x)).init
  return jax.eval_shape(init, jax.random.key(0), x)


@pytest.mark.parametrize("make", ["flax", "nnx", "haiku"])
def test_bad_fields_raise_clear_errors(make):
  x = inputs()

  def build(**fields):
    if make == "flax":
      layer = fl.MultiHeadAttention(**fields)
      return jax.eval_shape(layer.init, jax.random.key(0), x)
    if make == "nnx":
      return jax.eval_shape(lambda: NnxLayer(**fields).build(x)(x))
    return _haiku_call(x, **fields)

  with pytest.raises(ValueError, match=r"impl must be one of .*'reference'.*got 'fast'"):
    build(num_heads=HEADS, impl="fast")
  with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
    build(num_heads=HEADS, num_kv_heads=3)
  with pytest.raises(ValueError, match="num_heads must be a positive int"):
    build(num_heads=0)
  with pytest.raises(ValueError, match="head_dim must be a positive int"):
    build(num_heads=HEADS, head_dim=-2)
  with pytest.raises(ValueError, match=r"features of inputs_q \(32\) must be a multiple of num_heads \(5\)"):
    build(num_heads=5)
  with pytest.raises(ValueError, match="dropout_rate"):
    build(num_heads=HEADS, dropout_rate=1.5)
  with pytest.raises(TypeError, match="causal"):
    build(num_heads=HEADS, causal="yes")
  with pytest.raises(ValueError, match="window"):
    build(num_heads=HEADS, window=(-1, 2))
  with pytest.raises(ValueError, match=r"alibi must be a bool or float slopes \[num_heads\]=\(4,\)"):
    build(num_heads=HEADS, alibi=(0.5, 0.25))
  build(num_heads=5, head_dim=8)  # an explicit head_dim need not divide the features


def test_bad_fields_fail_at_construction():
  """Field errors surface when the layer is built, before any input is seen."""
  with pytest.raises(ValueError, match="impl must be one of"):
    fl.MultiHeadAttention(num_heads=HEADS, impl="fast")
  with pytest.raises(ValueError, match="num_kv_heads"):
    fl.MultiHeadAttention(num_heads=HEADS, num_kv_heads=3)
  with pytest.raises(ValueError, match="in_features must be a positive int"):
    flnnx.MultiHeadAttention(HEADS, 0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads"):
    flnnx.MultiHeadAttention(HEADS, EMBED, num_kv_heads=3, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_raise_clear_errors(kind):
  layer = make_layer(kind, num_heads=HEADS, impl="reference")
  params = jax.eval_shape(fl.MultiHeadAttention(num_heads=HEADS).init, jax.random.key(0), inputs())
  check = lambda *args, **kwargs: jax.eval_shape(layer.apply, params, *args, **kwargs)
  with pytest.raises(ValueError, match=r"inputs_q must have shape \[batch\.\.\., length, features\]"):
    check(jnp.ones((EMBED,)))  # [length, features] is flax's unbatched form, and taken
  with pytest.raises(ValueError, match="batch sizes differ"):
    check(inputs(), jnp.ones((BATCH + 1, KV_LEN, EMBED)))
  with pytest.raises(ValueError, match="kv_segment_ids"):
    check(inputs(), inputs(KV_LEN), segment_ids=segments(Q_LEN, 0))


def test_layer_under_a_mesh_with_logical_rules():
  """Params boxed on their final shapes: init and apply work under a mesh and the default rules."""
  layer = fl.MultiHeadAttention(num_heads=4, num_kv_heads=2, impl="reference")
  x = jax.random.normal(jax.random.key(0), (2, 16, 32))
  mesh = fl.make_mesh()
  with jax.set_mesh(mesh), nn.logical_axis_rules(fl.LOGICAL_RULES):
    variables = layer.init(jax.random.key(1), x)
    out = layer.apply(variables, x)
  expected = layer.apply(variables, x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)
  specs = nn.get_partition_spec(variables)["params"]
  assert tuple(specs["key"]["kernel"]) == fl.layers.KV_KERNEL_AXES


def test_nnx_layer_partition_specs_and_mesh():
  """The NNX layer's params carry the linen layer's logical names; it builds and runs under a mesh."""
  x = jax.random.normal(jax.random.key(0), (2, 16, 32))
  model = flnnx.MultiHeadAttention(4, 32, num_kv_heads=2, impl="reference", rngs=nnx.Rngs(0))
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  P = jax.sharding.PartitionSpec
  assert specs["query"]["kernel"].get_value() == P(*fl.layers.QUERY_KERNEL_AXES)
  assert specs["key"]["bias"].get_value() == P(*fl.layers.KV_KERNEL_AXES[1:])
  assert specs["out"]["kernel"].get_value() == P(*fl.layers.OUT_KERNEL_AXES)
  expected = model(x)
  with jax.set_mesh(fl.make_mesh()), nn.logical_axis_rules(fl.LOGICAL_RULES):
    # Under the rules the names map to mesh axes, as for the linen layer.
    mapped = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    linen_vars = jax.eval_shape(fl.MultiHeadAttention(num_heads=4, num_kv_heads=2).init, jax.random.key(0), x)
    linen_specs = nn.get_partition_spec(linen_vars)["params"]
    for name in ("query", "key", "value", "out"):
      for param in ("kernel", "bias"):
        assert mapped[name][param].get_value() == nn.logical_to_mesh_axes(linen_specs[name][param])
    inside = flnnx.MultiHeadAttention(4, 32, num_kv_heads=2, impl="reference", rngs=nnx.Rngs(0))
    out = inside(x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_nnx_weights_round_trip_with_linen():
  """linen params -> nnx state -> linen params, same outputs both ways; nnx's own init -> linen too."""
  x, y = inputs(), inputs(KV_LEN, KV_EMBED, seed=2)
  fields = dict(num_heads=HEADS, num_kv_heads=2, head_dim_v=6, out_features=20, impl="reference")
  linen_layer = fl.MultiHeadAttention(**fields)
  params = init_params(linen_layer, x, y)
  model = NnxLayer(**fields).build(x, y, params)
  np.testing.assert_allclose(nnx_call(model, x, y), apply(linen_layer, params, x, y), **TOL)
  back = flnnx.params_to_linen(model)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  # The other way: an NNX layer's own weights serve the linen layer.
  fresh = NnxLayer(**fields).build(x, y)
  np.testing.assert_allclose(apply(linen_layer, flnnx.params_to_linen(fresh), x, y), nnx_call(fresh, x, y),
                             **TOL)
  with pytest.raises(ValueError, match="inputs_kv has 32 features; this layer was built for 24"):
    model(x, x)


# ----------------------------------------------------------------------------
# Dropout and ALiBi, every layer, against a float64 NumPy oracle
# ----------------------------------------------------------------------------

def oracle_layer(params, x, y, *, num_kv_heads, slopes=None, keep=None, rate=0.0, causal=False):
  """The layer in float64 NumPy: projections, softmax(q.k / sqrt(d) - slope * |i - j|), dropout by `keep`."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.meta.unbox(params)["params"])
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  proj = lambda z, name: np.einsum("btf,fhd->bthd", z, p[name]["kernel"]) + p[name]["bias"]
  q, k, v = proj(x, "query"), proj(y, "key"), proj(y, "value")
  group = q.shape[2] // num_kv_heads
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
  if slopes is not None:
    s = s - np.asarray(slopes, np.float64)[:, None, None] * np.abs(i - j)
  if causal:
    s = np.where(j <= i, s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w = w / w.sum(-1, keepdims=True)
  if keep is not None:
    w = w * np.asarray(keep) / (1 - rate)
  out = np.einsum("bhts,bshd->bthd", w, v)
  return np.einsum("bthd,hde->bte", out, p["out"]["kernel"]) + p["out"]["bias"]


SLOPES = np.array([0.5, 0.25, 0.8, 0.05], np.float32)  # not the standard ones: the field is used as given


def _dropout_call(kind, fields, params, x, y, rng, deterministic):
  """(layer output, the dropout key the layer's attention got)."""
  if kind == "linen":
    layer = fl.MultiHeadAttention(num_heads=HEADS, **fields)
    out = layer.apply(params, x, y, deterministic=deterministic, rngs={"dropout": rng})
    # The layer's first make_rng("dropout"): the same call in the same scope draws the same key.
    return out, layer.apply(params, method=lambda m: m.make_rng("dropout"), rngs={"dropout": rng})
  if kind == "nnx":
    model = NnxLayer(num_heads=HEADS, **fields).build(x, y, params)
    return model(x, y, deterministic=deterministic, rngs=rng), rng
  fn = hk.transform(lambda x, y: flh.MultiHeadAttention(HEADS, **fields)(x, y, deterministic=deterministic))
  key = hk.transform(hk.next_rng_key).apply({}, rng)  # the first key of this rng, as the layer draws
  return fn.apply(flh.params_from_flax(params), rng, x, y), key


@pytest.mark.parametrize("kind", ["linen", "nnx", "haiku"])
def test_dropout_and_alibi_match_the_oracle(kind):
  x, y = inputs(), inputs(KV_LEN, seed=2)
  rate = 0.3
  fields = dict(num_kv_heads=2, dropout_rate=rate, alibi=SLOPES, impl="xla_chunked")
  params = init_params(fl.MultiHeadAttention(num_heads=HEADS, num_kv_heads=2), x, y)
  got, key = _dropout_call(kind, fields, params, x, y, jax.random.key(7), deterministic=False)
  keep = fl.dropout_mask(key, batch=BATCH, num_heads=HEADS, q_len=Q_LEN, kv_len=KV_LEN, rate=rate)
  assert 0.5 < float(np.mean(keep)) < 0.9  # the mask drops some, keeps most
  want = oracle_layer(params, x, y, num_kv_heads=2, slopes=SLOPES, keep=keep, rate=rate)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  other, _ = _dropout_call(kind, fields, params, x, y, jax.random.key(8), deterministic=False)
  assert not np.allclose(other, got, atol=1e-3)  # another key, another mask
  # deterministic: no dropout, whatever the rng.
  quiet, _ = _dropout_call(kind, fields, params, x, y, jax.random.key(7), deterministic=True)
  np.testing.assert_allclose(quiet, oracle_layer(params, x, y, num_kv_heads=2, slopes=SLOPES),
                             rtol=1e-4, atol=1e-4)


def test_alibi_true_is_the_standard_slopes():
  x = inputs()
  params = init_params(fl.MultiHeadAttention(num_heads=HEADS), x)
  layer = fl.MultiHeadAttention(num_heads=HEADS, causal=True, alibi=True, impl="reference")
  want = oracle_layer(params, x, x, num_kv_heads=HEADS, slopes=fl.alibi_slopes(HEADS), causal=True)
  np.testing.assert_allclose(apply(layer, params, x), want, rtol=1e-4, atol=1e-4)


def test_nnx_dropout_with_rngs_train_and_eval():
  """The layer keeps its nnx.Rngs: each training call draws a new mask; eval() turns dropout off."""
  x = inputs()
  params = init_params(fl.MultiHeadAttention(num_heads=HEADS), x)
  model = flnnx.MultiHeadAttention(HEADS, EMBED, dropout_rate=0.5, impl="reference",
                                   rngs=nnx.Rngs(params=0, dropout=3))
  nnx.update(model, nnx.State(flnnx.params_from_linen(params)))
  plain = apply(fl.MultiHeadAttention(num_heads=HEADS, impl="reference"), params, x)
  np.testing.assert_allclose(model(x), plain, **TOL)  # deterministic by default, as the linen call
  model.train()
  first, second = model(x), model(x)
  assert not np.allclose(first, second, atol=1e-3) and not np.allclose(first, plain, atol=1e-3)
  model.eval()
  np.testing.assert_allclose(model(x), plain, **TOL)
  no_rngs = flnnx.MultiHeadAttention(HEADS, EMBED, dropout_rate=0.5, rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match="needs dropout keys"):
    no_rngs(x, deterministic=False)


# ----------------------------------------------------------------------------
# The three layers have the same fields
# ----------------------------------------------------------------------------

def test_nnx_and_haiku_layers_take_every_linen_field():
  linen = {f.name for f in dataclasses.fields(fl.MultiHeadAttention)} - {"parent", "name"}
  own = {"nnx": {"in_features", "in_kv_features", "deterministic", "rngs", "keep_rngs"}, "haiku": {"name"}}
  # Haiku has no mesh field: shard Haiku programs with jax.set_mesh around the call. Nor decode and the
  # cache's fields: Haiku has no cache collection (its state is explicit; docs/layers.md, "Decoding").
  # flax's MultiHeadDotProductAttention fields are linen's and NNX's: Haiku has no flax module to match.
  flax_fields = {"qkv_features", "broadcast_dropout", "deterministic", "normalize_qk", "out_kernel_init",
                 "out_bias_init", "force_fp32_for_softmax"}
  # logical_axis_names picks linen's boxes (nn.LogicallyPartitioned) or plain arrays: NNX params carry the
  # names as metadata whatever it says, Haiku params carry none.
  missing_ok = {"nnx": {"logical_axis_names"},
                "haiku": {"mesh", "decode", "cache_layout", "cache", "num_pages", "page_size",
                          "kv_cache_dtype", "logical_axis_names"} | flax_fields}
  for kind, cls in (("nnx", flnnx.MultiHeadAttention), ("haiku", flh.MultiHeadAttention)):
    params = set(inspect.signature(cls.__init__).parameters) - {"self"}
    assert params == (linen - missing_ok[kind]) | own[kind], kind


def test_rotary_and_global_tokens_agree_across_linen_nnx_and_haiku():
  x = inputs()
  seg = segments(Q_LEN, 5)
  positions = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(Q_LEN))], jnp.int32)
  fields = dict(num_kv_heads=2, window=(2, 2), global_tokens=1, rope_theta=50.0, impl="xla_chunked")
  linen = fl.MultiHeadAttention(num_heads=HEADS, **fields)
  params = init_params(linen, x, segment_ids=seg)
  want = apply(linen, params, x, segment_ids=seg, positions=positions)
  got_nnx = NnxLayer(num_heads=HEADS, **fields).apply(params, x, segment_ids=seg, positions=positions)
  np.testing.assert_allclose(got_nnx, want, **TOL)
  haiku_fn = hk.without_apply_rng(hk.transform(
      lambda x: flh.MultiHeadAttention(HEADS, **fields)(x, segment_ids=seg, positions=positions)))
  np.testing.assert_allclose(haiku_fn.apply(flh.params_from_flax(params), x), want, **TOL)
  # Each field matters: without the rotation or the global token the output differs.
  for off in (dict(rope_theta=None), dict(global_tokens=0)):
    other = fl.MultiHeadAttention(num_heads=HEADS, **{**fields, **off})
    kwargs = dict(positions=positions) if off.get("rope_theta", 1) is not None else {}
    assert not np.allclose(apply(other, params, x, segment_ids=seg, **kwargs), want, atol=1e-3)
  with pytest.raises(ValueError, match="set rope_theta"):
    flnnx.MultiHeadAttention(HEADS, EMBED, rngs=nnx.Rngs(0))(x, positions=positions)
