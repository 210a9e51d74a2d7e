"""One test per private or version-dependent upstream API flash_layers relies on.

Each test names what the code uses and where, and checks it the way the code uses it (signature,
fields, behaviour), so a jax/flax upgrade that changes one fails here, by name, instead of in a
user's run. Where the code already falls back between names (jax 0.10 vs 0.11), the test asks
that one of the names it tries exists, not which one.
"""

from __future__ import annotations

import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash_layers import lowering, validate
from flash_layers.impls import jax_splash
from flash_layers.parallel import mesh as mesh_lib
from flash_layers.testing import strict


def _splash_kernel():
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
  return splash_attention_kernel


def _binds(fn, *args, **kwargs):
  """The call the code makes binds to `fn`'s signature (a renamed or added required argument fails)."""
  inspect.signature(fn).bind(*args, **kwargs)


# ----------------------------------------------------------------------------
# jax_splash (impls/jax_splash.py): splash attention's private backward kernels and internals
# ----------------------------------------------------------------------------

_BWD_COMMON = dict(is_mqa=False, mask_value=-1.0, attn_logits_soft_cap=None, q_layout=None,
                   k_layout=None, v_layout=None, mask_function=None, interpret=True)


def test_splash_attention_bwd_dkv_signature():
  """_splash_bwd calls kernel._splash_attention_bwd_dkv(q, k, v, segment_ids, sinks=None, lse,
  d_out, di, bq=, bkv=, bkv_compute=, mask_info=, use_fused_bwd_kernel=, **common)."""
  fn = _splash_kernel()._splash_attention_bwd_dkv
  params = list(inspect.signature(fn).parameters)
  assert params[:8] == ["q", "k", "v", "segment_ids", "sinks", "logsumexp", "do", "di"]
  _binds(fn, *([None] * 8), bq=128, bkv=128, bkv_compute=128, mask_info=None,
         use_fused_bwd_kernel=False, **_BWD_COMMON)


def test_splash_attention_bwd_dq_signature():
  """_splash_bwd calls kernel._splash_attention_bwd_dq(q, k, v, segment_ids, sinks=None, lse,
  d_out, di, bq=, bkv=, mask_info=, **common) when the dkv kernel does not fuse dq."""
  fn = _splash_kernel()._splash_attention_bwd_dq
  params = list(inspect.signature(fn).parameters)
  assert params[:8] == ["q", "k", "v", "segment_ids", "sinks", "logsumexp", "do", "di"]
  _binds(fn, *([None] * 8), bq=128, bkv=128, mask_info=None, **_BWD_COMMON)


def test_splash_block_sizes_and_segment_ids_fields():
  """splash_block_sizes builds splash's BlockSizes by these names; _splash_bwd reads its layouts
  and use_fused_bwd_kernel; _segments builds SegmentIds(q=, kv=); DEFAULT_MASK_VALUE is a float."""
  kernel = _splash_kernel()
  sizes = kernel.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                            block_kv_dkv=128, block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
  for name in ("q_layout", "k_layout", "v_layout", "use_fused_bwd_kernel"):
    assert hasattr(sizes, name), name
  ids = kernel.SegmentIds(q=np.zeros(4), kv=np.ones(4))
  assert (ids.q.sum(), ids.kv.sum()) == (0, 4)
  assert isinstance(kernel.DEFAULT_MASK_VALUE, float) and kernel.DEFAULT_MASK_VALUE < -1e30


def test_splash_kernel_object_and_mask_info():
  """_kernel builds make_splash_mha(MultiHeadMask([our Mask subclass]), save_residuals=True, ...);
  _splash_bwd reads .kwargs["mask_function"], .dkv_mask_info and .dq_mask_info, and _collapse
  MaskInfo.partial_mask_blocks with NamedTuple._replace; the forward returns (out, (lse,))."""
  q_len = kv_len = 256
  spec = jax.ShapeDtypeStruct((1, q_len, 1, 128), jnp.float32)
  request, _ = validate.prepare(spec, spec, spec, causal=True)
  call = jax_splash._SplashCall(
      request=request, rule=jax_splash._Rule(offset=0, causal=True, window=None, kv_len=None),
      shape=(q_len, kv_len), block_sizes=jax_splash.splash_block_sizes(request), interpret=True)
  run = jax_splash._kernel(call)
  assert "mask_function" in run.kwargs
  for info in (run.dkv_mask_info, run.dq_mask_info):
    assert info is not None and hasattr(info, "partial_mask_blocks")
    collapsed = jax_splash._collapse(info)
    assert collapsed.partial_mask_blocks is None or collapsed.partial_mask_blocks.ndim == 3
  q = jax.ShapeDtypeStruct((1, q_len, 128), jnp.float32)
  out, residuals = jax.eval_shape(lambda q: run(q, q, q), q)
  assert out.shape == (1, q_len, 128)
  (lse,) = residuals
  assert lse.shape == (1, q_len)


# ----------------------------------------------------------------------------
# parallel/mesh.py and lowering.py: meshes
# ----------------------------------------------------------------------------

def test_jax_src_mesh_thread_resources():
  """current_mesh reads jax._src.mesh.thread_resources.env.physical_mesh for a legacy `with mesh:`."""
  from jax._src import mesh as jax_mesh

  assert jax_mesh.thread_resources.env.physical_mesh.empty
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  if not hasattr(mesh, "__enter__"):
    pytest.skip("this jax has no `with mesh:` (the fallback is then never reached)")
  with mesh:
    assert jax_mesh.thread_resources.env.physical_mesh == mesh
    assert mesh_lib.current_mesh() == mesh
  assert mesh_lib.current_mesh() is None


def test_abstract_mesh_attributes():
  """current_mesh, lowering.manual_device_count and the TPU family's generation read
  jax.sharding.get_abstract_mesh() and its .empty, .axis_names, .shape, .abstract_device and
  .manual_axes (or .axis_types) — each looked up with a silent default."""
  assert callable(jax.sharding.get_abstract_mesh)
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  # As training/sharding.py enters a mesh: jax.set_mesh, else the legacy `with mesh:`.
  with jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else mesh:
    abstract = jax.sharding.get_abstract_mesh()
    assert not abstract.empty and abstract.axis_names == ("data",) and dict(abstract.shape) == {"data": 1}
    assert hasattr(abstract, "abstract_device")
    assert hasattr(abstract, "manual_axes") or hasattr(abstract, "axis_types")
    assert lowering.manual_device_count() == 1


@pytest.mark.parametrize("where,names", [
    ("parallel/sharded.py: shard_map", [("jax", "shard_map"), ("jax.experimental.shard_map", "shard_map")]),
    ("parallel/sharded.py: reshard", [("jax.sharding", "reshard"), ("jax", "reshard")]),
    ("parallel/mesh.py: AxisType", [("jax.sharding", "AxisType")]),
    ("flash_pallas/tpu_common.py: compiler params", [("jax.experimental.pallas.tpu", "CompilerParams"),
                                                      ("jax.experimental.pallas.tpu", "TPUCompilerParams")]),
    ("flash_pallas/tpu_common.py: interpret params", [("jax.experimental.pallas.tpu", "InterpretParams")]),
    ("flash_pallas/gpu_fwd.py: compiler params", [("jax.experimental.pallas.triton", "CompilerParams")]),
])
def test_a_name_each_fallback_chain_tries_exists(where, names):
  """The code tries these names in turn (getattr with a default); at least one must exist."""
  import importlib

  found = [f"{module}.{name}" for module, name in names
           if hasattr(_import_or_none(importlib, module), name)]
  assert found, f"{where}: none of {names} exists in jax {jax.__version__}"


def _import_or_none(importlib, module):
  try:
    return importlib.import_module(module)
  except ImportError:
    return None


def test_jax_core_tracer_and_shaped_array():
  """masks.block_stats and the TPU family test isinstance(x, jax.core.Tracer); lowering.py's
  primitive returns jax.core.ShapedArray."""
  seen = []
  jax.jit(lambda x: seen.append(isinstance(x, jax.core.Tracer)) or x)(jnp.ones(2))
  assert seen == [True] and not isinstance(jnp.ones(2), jax.core.Tracer)
  assert jax.core.ShapedArray((2,), jnp.float32).shape == (2,)


# ----------------------------------------------------------------------------
# lowering.py: a primitive whose lowering raises, and platform_dependent's branch pruning
# ----------------------------------------------------------------------------

def test_platform_dependent_lowers_only_the_lowering_platforms_branch():
  """flash_pallas's wrong-family branches (lowering.fails_when_lowered, a jax.extend.core.Primitive
  with an mlir.register_lowering rule) rely on jax.lax.platform_dependent dropping the branches of
  other platforms when lowering for one, and on the rule's ValueError reaching the caller as is."""
  def fn(x):
    fail = lambda x: lowering.fails_when_lowered("cuda branch lowered", [x], x)[0]
    return jax.lax.platform_dependent(x, cuda=fail, default=lambda x: x + 1)

  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  traced = jax.jit(fn).trace(x)
  traced.lower(lowering_platforms=("cpu",))
  with pytest.raises(ValueError, match="^cuda branch lowered$"):
    traced.lower(lowering_platforms=("cuda",))


# ----------------------------------------------------------------------------
# testing/strict.py: the strict tier's two hooks into jax's TPU interpreter
# ----------------------------------------------------------------------------

def test_strict_tier_race_hook():
  """watch_races subclasses interpret_pallas_call.RaceDetectionState (module attribute, replaced
  for the block), wraps check_read/check_write reading buffer_key and rnge by name, and watches the
  races_found attribute the detector sets."""
  module = importlib.import_module(strict._INTERPRETER_MODULE)
  state = module.RaceDetectionState
  for name in ("check_read", "check_write"):
    params = inspect.signature(getattr(state, name)).parameters
    assert {"buffer_key", "rnge"} <= set(params), (name, list(params))
  with strict.watch_races() as races:
    assert module.RaceDetectionState is not state and issubclass(module.RaceDetectionState, state)
  assert module.RaceDetectionState is state and list(races) == []
  assert "races_found" in inspect.getsource(state)


def test_strict_tier_compile_once_hook():
  """interpreting() swaps thread_map._run_jaxpr(jaxpr, consts, *args), each simulated core's
  runner, for one that compiles each distinct program once; without it the tier only runs slower,
  so its absence must fail here instead."""
  module = importlib.import_module(strict._THREAD_MAP_MODULE)
  _binds(module._run_jaxpr, "jaxpr", "consts", 1, 2)
  with strict._compile_once():
    assert module._run_jaxpr is strict._run_compiled_once
  assert module._run_jaxpr is not strict._run_compiled_once
