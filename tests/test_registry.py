"""impls/registry.py: registration admits only impls that satisfy `base.Impl` and declare their
capabilities truthfully; the shipped impls pass; callers' queries answer from the declarations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import dispatch, validate
from flash_layers.impls import REGISTRY, registry
from flash_layers.impls.base import CAPABILITIES
from flash_layers.impls.flash_pallas import _FAMILY_CALLS, KernelFamily, _family


class _Good:
  name = "good"
  capabilities = frozenset({"attention_backward"})

  def unsupported(self, request, platform):
    return None

  def kernel(self, request, platform):
    return "xla"

  def attend(self, q, k, v, *, request, args):
    return q, None

  def attention_backward(self, q, k, v, lse, delta, d_out, *, request, args):
    return q, k, v


def _variant(**members):
  """A subclass of _Good with `members` replaced (None deletes a method)."""
  cls = type("Variant", (_Good,), {k: v for k, v in members.items() if v is not None})
  for k, v in members.items():
    if v is None:
      setattr(cls, k, property(lambda self: None))  # present but not callable
  return cls()


def test_a_well_formed_impl_registers_and_answers_queries():
  reg = registry.Registry()
  reg.register(_Good())
  assert reg.names() == ("good",)
  assert reg.impl_has("good", "attention_backward") and not reg.impl_has("good", "block_stats")
  assert reg.impls_with("attention_backward") == ("good",) and reg.impls_with("grid_steps") == ()
  assert reg.method("good", "attention_backward") is not None
  assert reg.method("good", "block_stats") is None
  with pytest.raises(registry.RegistrationError, match="already registered"):
    reg.register(_Good())
  with pytest.raises(ValueError, match="capability must be one of"):
    reg.impls_with("backward")
  with pytest.raises(ValueError, match="impl must be one of"):
    reg.get("nope")


@pytest.mark.parametrize("impl, message", [
    (_variant(name=""), "non-empty str `name`"),
    (_variant(attend=None), r"has no method attend\(_, _, _, request=..., args=...\)"),
    (_variant(attend=lambda self, q, k, v: None), "cannot be called as attend"),  # no request/args
    (_variant(kernel=lambda self, request: "xla"), "cannot be called as kernel"),
    (_variant(capabilities={"attention_backward", 3}), "frozenset of names"),
    (_variant(capabilities=None), "needs `capabilities`"),
], ids=["no-name", "no-attend", "attend-signature", "kernel-signature", "capability-type",
        "no-capabilities"])
def test_a_malformed_impl_is_refused(impl, message):
  with pytest.raises(registry.RegistrationError, match=message):
    registry.Registry().register(impl)


@pytest.mark.parametrize("impl, message", [
    # declares a method capability it does not implement
    (_variant(capabilities=frozenset({"attention_backward", "block_stats"})),
     "has no method block_stats"),
    # implements it with the wrong signature (dispatch passes request/args by keyword)
    (_variant(attention_backward=lambda self, q, k, v, lse, delta, d_out: None),
     "cannot be called as attention_backward"),
    # an unknown name
    (_variant(capabilities=frozenset({"attention_backward", "fused_backward"})),
     "unknown capabilities"),
    # defines a capability's method without declaring it
    (_variant(capabilities=frozenset()), "defines attention_backward.. but does not declare"),
], ids=["missing-method", "wrong-signature", "unknown", "undeclared"])
def test_a_false_capability_claim_is_refused(impl, message):
  with pytest.raises(registry.RegistrationError, match=message):
    registry.Registry().register(impl)


def test_every_shipped_impl_passes_registration():
  fresh = registry.Registry()
  for impl in REGISTRY.values():
    fresh.register(impl)
  assert fresh.names() == fl.IMPLS == ("flash_pallas", "xla_native", "xla_chunked", "xla_dense",
                                      "reference", "jax_splash")
  for capability in CAPABILITIES:  # the package's queries answer from the declarations
    assert registry.impls_with(capability) == tuple(
        n for n in fl.IMPLS if capability in REGISTRY[n].capabilities)
  # ring attention's backward needs one: these have their own, the rest use xla_dense's
  assert registry.impls_with("attention_backward") == ("flash_pallas", "xla_chunked", "xla_dense")
  assert "jax_splash" not in registry.impls_with("traced_offsets")


def test_both_kernel_families_satisfy_the_protocol():
  members = {m for m in vars(KernelFamily) if not m.startswith("_")}
  assert members == set(_FAMILY_CALLS)
  for name in ("tpu", "gpu"):
    module = _family(name)
    for function, call in _FAMILY_CALLS.items():
      registry.check_callable(name, module, function, call)
  with pytest.raises(registry.RegistrationError, match="has no method grid_steps"):
    registry.check_callable("family", object(), "grid_steps", _FAMILY_CALLS["grid_steps"])


def test_traced_offsets_claims_hold():
  """Every impl declaring "traced_offsets" runs a causal call whose offsets are traced and
  matches the reference with the same offsets as Python ints."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 16, 1, 8)), jnp.float32) for _ in range(3))
  request, _ = validate.prepare(q, k, v, causal=True)
  # NumPy: query i sits at position 8 + i, key j at 4 + j; causal: key position <= query position.
  logits = np.einsum("qd,kd->qk", np.float64(q[0, :, 0]), np.float64(k[0, :, 0])) / np.sqrt(8)
  logits = np.where(4 + np.arange(16)[None, :] <= 8 + np.arange(16)[:, None], logits, -np.inf)
  p = np.exp(logits - logits.max(1, keepdims=True))
  expected = ((p / p.sum(1, keepdims=True)) @ np.float64(v[0, :, 0]))[None, :, None, :]

  for name in registry.impls_with("traced_offsets"):
    @jax.jit
    def run(q_offset, kv_offset, name=name):
      args = validate.prepare(q, k, v, causal=True, q_offset=q_offset, kv_offset=kv_offset)[1]
      return dispatch.attend(q, k, v, impl=name, request=request, args=args)[0]

    np.testing.assert_allclose(run(jnp.int32(8), jnp.int32(4)), expected, atol=2e-5, err_msg=name)
