"""`attention()` / `explain()`: every bad input is a clear error naming the argument; explain and auto."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl

B, T, H, D = 2, 16, 4, 32


def qkv(b=B, t=T, s=None, h=H, kvh=None, d=D, dv=None, dtype=jnp.float32):
  s = t if s is None else s
  kvh = h if kvh is None else kvh
  dv = d if dv is None else dv
  q = jnp.ones((b, t, h, d), dtype)
  k = jnp.ones((b, s, kvh, d), dtype)
  v = jnp.ones((b, s, kvh, dv), dtype)
  return q, k, v


def seg(b=B, t=T, dtype=jnp.int32):
  return jnp.ones((b, t), dtype)


FLASH_LAYERS_DIR = os.path.dirname(fl.__file__)


def assert_raised_by_us(excinfo):
  """The error comes from our validation, not from deep inside JAX."""
  entry = excinfo.traceback[-1]
  assert str(entry.path).startswith(FLASH_LAYERS_DIR), f"raised from {entry.path}"
  assert "/jax/" not in str(entry.path)


# (id, arguments, expected error type, words the message must contain)
BAD_INPUTS = [
    ("query_rank", lambda: (jnp.ones((B, T, D)),) + qkv()[1:], {}, ValueError, ["query", "rank 4"]),
    ("key_rank", lambda: (qkv()[0], jnp.ones((B, T, H, D, 1)), qkv()[2]), {}, ValueError, ["key", "rank"]),
    ("value_rank", lambda: qkv()[:2] + (jnp.ones((T, H, D)),), {}, ValueError, ["value", "rank"]),
    ("query_not_array", lambda: ([[1.0]],) + qkv()[1:], {}, TypeError, ["query", "array"]),
    ("batch_mismatch", lambda: (qkv()[0],) + qkv(b=3)[1:], {}, ValueError, ["batch", "query 2", "key 3"]),
    ("value_batch_mismatch", lambda: qkv()[:2] + (qkv(b=1)[2],), {}, ValueError, ["batch", "value 1"]),
    ("kv_length_mismatch", lambda: qkv()[:2] + (qkv(s=9)[2],), {}, ValueError,
     ["key", "value", "kv_len"]),
    ("head_dim_mismatch", lambda: (qkv(d=64)[0],) + qkv()[1:], {}, ValueError, ["head_dim", "64", "32"]),
    ("kv_heads_mismatch", lambda: (qkv()[0], qkv(kvh=2)[1], qkv(kvh=4)[2]), {}, ValueError,
     ["kv heads", "key 2", "value 4"]),
    ("heads_not_divisible", lambda: (qkv(h=3)[0],) + qkv(kvh=2)[1:], {}, ValueError,
     ["heads", "(3)", "(2)"]),
    ("int_inputs", lambda: qkv(dtype=jnp.int32), {}, TypeError, ["query", "floating", "int32"]),
    ("mixed_dtypes", lambda: (qkv(dtype=jnp.bfloat16)[0],) + qkv()[1:], {}, TypeError,
     ["query", "key", "dtype", "bfloat16"]),
    ("segment_ids_float", qkv, {"segment_ids": seg(dtype=jnp.float32)}, TypeError,
     ["segment_ids", "integer", "float32"]),
    ("segment_ids_not_array", qkv, {"segment_ids": [[1] * T] * B}, TypeError, ["segment_ids"]),
    ("segment_ids_shape", qkv, {"segment_ids": seg(t=T + 1)}, ValueError,
     ["segment_ids", f"({B}, {T})", f"({B}, {T + 1})"]),
    ("segment_ids_rank", qkv, {"segment_ids": jnp.ones((B, T, 1), jnp.int32)}, ValueError,
     ["segment_ids", "[batch, length]"]),
    ("kv_segment_ids_shape", lambda: qkv(s=24), {"segment_ids": seg(), "kv_segment_ids": seg(t=T)},
     ValueError, ["kv_segment_ids", f"({B}, 24)"]),
    ("kv_segment_ids_float", lambda: qkv(s=24),
     {"segment_ids": seg(), "kv_segment_ids": seg(t=24, dtype=jnp.float16)}, TypeError,
     ["kv_segment_ids", "integer"]),
    ("cross_attention_without_kv_segment_ids", lambda: qkv(s=24), {"segment_ids": seg()}, ValueError,
     ["kv_segment_ids", "q_len=16", "kv_len=24"]),
    ("kv_segment_ids_alone", qkv, {"kv_segment_ids": seg()}, ValueError, ["kv_segment_ids", "segment_ids"]),
    ("window_negative", qkv, {"window": -1}, ValueError, ["window", ">= 0", "-1"]),
    ("window_negative_right", qkv, {"window": (3, -2)}, ValueError, ["window", "right", "-2"]),
    ("window_three_values", qkv, {"window": (1, 2, 3)}, TypeError, ["window", "(1, 2, 3)"]),
    ("window_string", qkv, {"window": "wide"}, TypeError, ["window", "'wide'"]),
    ("window_float", qkv, {"window": (1.5, 2)}, TypeError, ["window", "left", "1.5"]),
    ("window_bool", qkv, {"window": True}, TypeError, ["window", "True"]),
    ("softcap_zero", qkv, {"softcap": 0.0}, ValueError, ["softcap", "positive"]),
    ("softcap_negative", qkv, {"softcap": -5}, ValueError, ["softcap", "-5"]),
    ("softcap_nan", qkv, {"softcap": float("nan")}, ValueError, ["softcap"]),
    ("softcap_string", qkv, {"softcap": "1.0"}, TypeError, ["softcap"]),
    ("scale_zero", qkv, {"scale": 0}, ValueError, ["scale"]),
    ("scale_array", qkv, {"scale": jnp.ones(3)}, TypeError, ["scale"]),
    ("causal_not_bool", qkv, {"causal": "yes"}, TypeError, ["causal", "'yes'"]),
]


@pytest.mark.parametrize("make_args,kwargs,error,words", [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("entry", [fl.attention, fl.explain], ids=["attention", "explain"])
def test_bad_input_names_the_argument(entry, make_args, kwargs, error, words):
  with pytest.raises(error) as excinfo:
    entry(*make_args(), **kwargs)
  message = str(excinfo.value)
  for word in words:
    assert word in message, f"{word!r} not in {message!r}"
  # A TypeError/ValueError, never UnsupportedError: the input is wrong, not the impl.
  assert not isinstance(excinfo.value, fl.UnsupportedError)
  assert_raised_by_us(excinfo)


@pytest.mark.parametrize("entry", [fl.attention, fl.explain], ids=["attention", "explain"])
@pytest.mark.parametrize("impl", ["flash", "Reference", "", None, "xla"])
def test_unknown_impl_lists_the_valid_names(entry, impl):
  with pytest.raises(ValueError) as excinfo:
    entry(*qkv(), impl=impl)
  message = str(excinfo.value)
  assert "impl" in message
  for name in (*fl.IMPLS, "auto"):
    assert repr(name) in message
  assert_raised_by_us(excinfo)


def test_impls_are_the_contract():
  assert fl.IMPLS == ("flash_pallas", "xla_native", "xla_chunked", "xla_dense", "reference", "jax_splash")
  assert issubclass(fl.UnsupportedError, ValueError)


@pytest.mark.parametrize("entry", [fl.attention, fl.explain], ids=["attention", "explain"])
@pytest.mark.parametrize("kwargs,make,feature", [
    ({"softcap": 30.0}, qkv, "softcap"),
    ({}, lambda: qkv(dv=16), "head_dim_v"),
], ids=["softcap", "head_dim_v"])
def test_explicit_impl_that_cannot_serve_raises(entry, kwargs, make, feature):
  with pytest.raises(fl.UnsupportedError) as excinfo:
    entry(*make(), impl="xla_native", **kwargs)
  message = str(excinfo.value)
  assert "xla_native" in message and feature in message
  # It names the impls that can serve the request (both of these support everything).
  assert "xla_chunked" in message and "reference" in message
  # Auto serves the same request with another impl instead of raising.
  assert fl.explain(*make(), **kwargs).impl != "xla_native"


def test_explicit_impl_never_falls_back():
  """The same request runs on the impls named as able."""
  q, k, v = qkv(dv=16)
  for impl in ("xla_chunked", "reference"):
    assert fl.attention(q, k, v, impl=impl).shape == (B, T, H, 16)
    assert fl.explain(q, k, v, impl=impl).impl == impl


# ----------------------------------------------------------------------------
# explain()
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["auto", "reference", "xla_native", "xla_chunked"])
def test_explain_fields_and_one_line(impl):
  q, k, v = qkv(t=1024)
  e = fl.explain(q, k, v, impl=impl, causal=True)
  assert e.impl in fl.IMPLS
  if impl != "auto":
    assert e.impl == impl
    assert "explicit" in e.reason
  assert isinstance(e.kernel, str) and e.kernel
  assert isinstance(e.reason, str) and e.reason and "\n" not in e.reason
  text = str(e)
  assert "\n" not in text
  assert e.impl in text and e.kernel in text and e.reason in text
  if e.blocks_visited is None:
    assert e.blocks_total is None
  else:
    assert isinstance(e.blocks_visited, int) and isinstance(e.blocks_total, int)
    assert f"{e.blocks_visited}/{e.blocks_total}" in text


def test_explain_counts_chunked_blocks():
  """xla_chunked reports the chunk pairs it visits: 512-token chunks, causal over 2048 tokens
  visits the 10 lower-triangle pairs of 16, for each batch row and head."""
  q, k, v = qkv(t=2048, h=2, b=1)
  full = fl.explain(q, k, v, impl="xla_chunked")
  assert (full.blocks_visited, full.blocks_total) == (32, 32)
  causal = fl.explain(q, k, v, impl="xla_chunked", causal=True)
  assert (causal.blocks_visited, causal.blocks_total) == (2 * 10, 32)
  # Two documents of 1024 tokens: only the two diagonal 2x2 quarters are visited.
  ids = jnp.asarray(np.repeat([[1, 2]], 1024, axis=1), jnp.int32)
  packed = fl.explain(q, k, v, impl="xla_chunked", segment_ids=ids)
  assert (packed.blocks_visited, packed.blocks_total) == (2 * 8, 32)
  assert fl.explain(q, k, v, impl="reference").blocks_visited is None


def test_explain_takes_shape_structs():
  q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv(t=4096))
  e = fl.explain(q, k, v, causal=True)
  # On the CPU, auto picks xla_chunked for long inputs; causal skips the upper triangle.
  assert e.impl == "xla_chunked"
  assert e.blocks_visited < e.blocks_total


@pytest.mark.parametrize("impl", ["flash_pallas", "xla_chunked", "auto"])
def test_explain_takes_shape_structs_for_a_decode_with_segment_ids(impl):
  # A decode-shaped request (a few queries against a cache with per-row lengths): with arrays the
  # tiles read are counted from the segment ids; with only their shapes they are unknown (None),
  # and explain still names the impl and its configuration.
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 2, 4, 64)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 1024, 2, 64)), jnp.float32)
  q_seg = jnp.ones((2, 2), jnp.int32)
  kv_seg = jnp.where(jnp.arange(1024)[None] < jnp.array([[1024], [300]]), 1, -1).astype(jnp.int32)
  kwargs = {"impl": impl, "causal": True, "q_offset": 1022}
  concrete = fl.explain(q, k, k, segment_ids=q_seg, kv_segment_ids=kv_seg, **kwargs)
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, k, q_seg, kv_seg)]
  abstract = fl.explain(*shapes[:3], segment_ids=shapes[3], kv_segment_ids=shapes[4], **kwargs)
  assert abstract.impl == concrete.impl and abstract.impl == (impl if impl != "auto" else concrete.impl)
  if impl == "flash_pallas":
    assert abstract.blocks_visited is None and concrete.blocks_visited < concrete.blocks_total


def test_auto_logs_its_choice_once_per_signature(caplog):
  # Shapes used nowhere else, so no other test has logged this signature already.
  q, k, v = qkv(b=1, t=23, h=3, d=24)
  with caplog.at_level(logging.INFO, logger="flash_layers"):
    fl.attention(q, k, v)
    fl.attention(q, k, v)
    jax.jit(fl.attention)(q, k, v)
    first = [r for r in caplog.records if r.name == "flash_layers"]
    fl.attention(q, k, v, causal=True)  # a new signature
    second = [r for r in caplog.records if r.name == "flash_layers"]
  assert len(first) == 1 and first[0].levelno == logging.INFO
  chosen = fl.explain(q, k, v).impl
  assert chosen in first[0].getMessage() and "q=23" in first[0].getMessage()
  assert len(second) == 2 and "causal" in second[1].getMessage()
