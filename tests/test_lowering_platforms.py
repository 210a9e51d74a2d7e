"""The platform a call is lowered for decides what runs: the auto choice (ROCm included) and the
flash_pallas kernel family, whose block_sizes of the wrong family raise, by name.

flash_pallas runs its TPU kernels on a TPU (and interpreted on a CPU) and its GPU kernels on CUDA
or ROCm. `fl.BlockSizes` tiles the first, `fl.GpuBlockSizes` the second; the other family's sizes
used to be ignored silently. Which family a call runs is decided by the platform it is lowered
for, so an AOT compile for CUDA from this CPU host takes GPU sizes (tests/test_gpu_lowering.py
compiles them) and refuses TPU ones.
"""

import jax
import jax.numpy as jnp
import pytest

import flash_layers as fl
from flash_layers import auto, validate

Q = jax.ShapeDtypeStruct((1, 16, 2, 16), jnp.float32)


def _qkv():
  q = jax.random.normal(jax.random.key(0), Q.shape, Q.dtype)
  return q, q, q


def _assert_names_both_families(err, given, expected):
  message = str(err.value)
  for word in ("block_sizes", f"flash_layers.{given}", f"flash_layers.{expected}"):
    assert word in message, f"{word!r} not in {message!r}"


def test_gpu_sizes_on_a_cpu_call_raise():
  """Lowered for the CPU, flash_pallas runs the TPU kernels interpreted: GPU tiles do not fit."""
  with pytest.raises(ValueError) as err:
    fl.attention(*_qkv(), impl="flash_pallas", block_sizes=fl.GpuBlockSizes())
  _assert_names_both_families(err, "GpuBlockSizes", "BlockSizes")
  assert "TPU" in str(err.value) and "CPU" in str(err.value)


def test_the_gradient_raises_too():
  """A loss linear in the output needs no forward value; its gradient must not lower to zeros."""
  loss = lambda q, k, v: fl.attention(q, k, v, impl="flash_pallas", block_sizes=fl.GpuBlockSizes()).sum()
  with pytest.raises(ValueError, match="block_sizes"):
    jax.grad(loss)(*_qkv())


@pytest.mark.parametrize("family,sizes", [("gpu", fl.BlockSizes(128, 128)), ("tpu", fl.GpuBlockSizes())])
def test_interpret_as_the_other_family_raises(family, sizes):
  with fl.interpret_as(family), pytest.raises(ValueError) as err:
    fl.attention(*_qkv(), impl="flash_pallas", block_sizes=sizes)
  expected = "GpuBlockSizes" if family == "gpu" else "BlockSizes"
  _assert_names_both_families(err, type(sizes).__name__, expected)
  assert f"interpret_as('{family}')" in str(err.value)


def test_explain_raises_what_the_call_would():
  with pytest.raises(ValueError) as err:
    fl.explain(Q, Q, Q, impl="flash_pallas", block_sizes=fl.GpuBlockSizes())
  _assert_names_both_families(err, "GpuBlockSizes", "BlockSizes")


def test_the_lowering_platform_decides_the_family():
  """Lowering for CUDA from this CPU host: TPU tiles raise, GPU tiles lower (tracing alone,
  which visits every platform's branch, raises for neither)."""
  def call(sizes):
    return jax.jit(lambda q, k, v: fl.attention(q, k, v, impl="flash_pallas", block_sizes=sizes))

  traced = call(fl.BlockSizes(128, 128)).trace(Q, Q, Q)
  with pytest.raises(ValueError) as err:
    traced.lower(lowering_platforms=("cuda",))
  _assert_names_both_families(err, "BlockSizes", "GpuBlockSizes")
  assert "lowered for cuda" in str(err.value)
  # The same sizes lowered for the CPU are the TPU family's: no error.
  traced.lower(lowering_platforms=("cpu",))
  with pytest.raises(ValueError, match="GpuBlockSizes"):
    call(fl.GpuBlockSizes()).trace(Q, Q, Q).lower(lowering_platforms=("cpu",))


def test_jax_splash_refuses_gpu_sizes():
  with pytest.raises(ValueError, match="block_sizes for impl='jax_splash'"):
    fl.attention(*_qkv(), impl="jax_splash", block_sizes=fl.GpuBlockSizes())


@pytest.mark.parametrize("impl,sizes,takes", [
    ("flash_pallas", fl.CpuBlockSizes(block_q=64), "BlockSizes or GpuBlockSizes"),
    ("xla_chunked", fl.BlockSizes(128, 128), "CpuBlockSizes"),
    ("xla_dense", fl.GpuBlockSizes(), "CpuBlockSizes"),
    ("reference", fl.CpuBlockSizes(), "no block sizes"),
    ("xla_native", fl.BlockSizes(128, 128), "no block sizes"),
])
def test_an_explicit_impl_refuses_sizes_it_would_ignore(impl, sizes, takes):
  """Sizes of a class the chosen impl never reads raise (they were silently dropped)."""
  for entry in (fl.attention, fl.explain):
    with pytest.raises(ValueError) as err:
      entry(*_qkv(), impl=impl, block_sizes=sizes)
    message = str(err.value)
    assert f"block_sizes for impl={impl!r} must be {takes}" in message, message
    assert type(sizes).__name__ in message


# ----------------------------------------------------------------------------
# The auto choice per lowering platform
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("platform", ["rocm", "cuda", "cpu"])
def test_auto_lowers_the_choice_explain_reports_for_that_platform(platform):
  """A ROCm lowering used to get the CPU branch (xla_dense) while the ROCm rule picks another impl.
  A dense bias keeps flash_pallas out, so no Triton compiler is needed to lower for a GPU."""
  bias = jax.ShapeDtypeStruct((1, 1, Q.shape[1], Q.shape[1]), jnp.float32)
  request, _ = validate.prepare(Q, Q, Q, bias=bias)
  chosen, _ = auto.resolve("auto", request, platform)
  text = (jax.jit(lambda q, b: fl.attention(q, q, q, bias=b)).trace(Q, bias)
          .lower(lowering_platforms=(platform,)).as_text(debug_info=True))
  lowered = {name for name in fl.IMPLS if f"flash_layers.{name}" in text}
  assert lowered == {chosen}
  if platform == "rocm":
    assert chosen != auto.resolve("auto", request, "cpu")[0]  # else the test proves nothing
