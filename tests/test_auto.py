"""One "auto" rule: the autotuner's untuned baseline is what "auto" runs, on every platform.

The tuner builds its candidate list from `auto.resolve` (tuning/candidates.py), so there is no second
copy of the rule to drift (the issue: a CPU decoding shape's baseline was xla_chunked while auto runs
xla_dense). The table covers prefill, decoding with a few queries, long kv, masks and features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash_layers import auto, validate
from flash_layers.impls import registry
from flash_layers.tuning import candidates

PLATFORMS = ("cpu", "tpu", "cuda", "rocm")


def _request(b=1, t=256, s=None, h=4, kvh=None, d=64, dtype=jnp.float32, **kwargs):
  """A validated Request for abstract q, k, v of these shapes (nothing is allocated)."""
  s, kvh = s or t, kvh or h
  q = jax.ShapeDtypeStruct((b, t, h, d), dtype)
  kv = jax.ShapeDtypeStruct((b, s, kvh, d), dtype)
  return validate.prepare(q, kv, kv, **kwargs)[0]


def _requests() -> dict[str, object]:
  key = jax.random.key(0)
  return {
      "prefill": _request(b=2, t=512, causal=True),
      "prefill long": _request(t=2048, h=2, causal=True),
      "decode 1 query, long kv": _request(b=2, t=1, s=4096, h=8, kvh=2),
      "decode 8 queries, GQA": _request(t=8, s=8192, h=8, kvh=2, causal=True, q_offset=8184),
      "decode 16 queries, short kv": _request(t=16, s=512),
      "decode with dropout": _request(t=1, s=2048, dropout_rate=0.1, dropout_rng=key),
      "cross attention, long kv": _request(t=256, s=4096),
      "segments": _request(b=2, t=1024, segment_ids=jax.ShapeDtypeStruct((2, 1024), jnp.int32)),
      "sliding window": _request(t=2048, h=2, causal=True, window=(128, 0)),
      "dense mask": _request(t=256, dense_mask=np.tril(np.ones((256, 256), bool))),
      "dropout": _request(t=1024, causal=True, dropout_rate=0.1, dropout_rng=key),
      "alibi": _request(t=512, causal=True, alibi_slopes=np.linspace(0.1, 1.0, 4, dtype=np.float32)),
      "bias": _request(t=256, bias=jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.float32)),
      "bf16 softcap, head_dim 256": _request(t=1024, d=256, dtype=jnp.bfloat16, softcap=30.0, causal=True),
      "huge logits": _request(b=8, t=4096, h=16, d=8),
  }


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", list(_requests()))
def test_the_tuners_baseline_is_autos_choice(name, platform):
  request = _requests()[name]
  chosen = auto.resolve(auto.AUTO, request, platform)[0]
  assert candidates.baseline(auto.AUTO, request, platform) == chosen
  cands = candidates.for_call(auto.AUTO, request, platform)
  if cands:  # the first candidate is the default: auto's choice with its own block sizes
    assert (cands[0].impl, cands[0].block_sizes) == (chosen, None), [c.describe() for c in cands]
    assert {c.impl for c in cands} <= set(auto.tunable(request, platform))


def test_the_table_covers_enough_requests():
  assert len(_requests()) >= 12


def test_cpu_decoding_baseline_is_xla_dense():
  """The drift the issue names: a CPU decoding shape with a long cache runs xla_dense, and is tuned
  from there (before, the tuner's own copy of the rule started from xla_chunked)."""
  request = _requests()["decode 1 query, long kv"]
  assert request.kv_len >= auto.CPU_CHUNKED_MIN_KV_LEN
  assert auto.resolve(auto.AUTO, request, "cpu")[0] == "xla_dense"
  assert candidates.for_call(auto.AUTO, request, "cpu")[0] == candidates.Candidate("xla_dense")


def test_dropout_capability_matches_what_impls_serve():
  plain, dropped = _request(t=256), _request(t=256, dropout_rate=0.1, dropout_rng=jax.random.key(0))
  for name in registry.names():
    impl = registry.get(name)
    for platform in PLATFORMS:
      if impl.unsupported(plain, platform) is None:
        assert (impl.unsupported(dropped, platform) is None) == registry.impl_has(name, "dropout"), (
            name, platform)


def test_decoding_is_asked_of_the_registry():
  decoding, prefill = _requests()["decode 1 query, long kv"], _requests()["prefill"]
  assert registry.impls_with("decode_unserved")
  for name in registry.impls_with("decode_unserved"):
    unserved = registry.method(name, "decode_unserved")
    assert unserved(decoding, "tpu") is None
    assert unserved(prefill, "tpu") is not None
