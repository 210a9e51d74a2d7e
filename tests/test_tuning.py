"""The autotuner and its cache (flash_layers/tuning): selection, validation, the cache and "auto"."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import validate
from flash_layers.impls import REGISTRY
from flash_layers.testing import reference64
from flash_layers.tuning import cache, candidates, tuner
from flash_layers.tuning.candidates import Candidate
from flash_layers.tuning.tuner import Measured

SHAPE = (1, 16, 2, 8)  # [batch, length, heads, head_dim]: every test here compiles at this size


def _qkv(shape=SHAPE, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, shape, jnp.float32) for k in keys)


def _request(shape=SHAPE, **kwargs):
  q = jax.ShapeDtypeStruct(shape, jnp.float32)
  return validate.prepare(q, q, q, **kwargs)[0]


class FakeTimer:
  """Returns the next preset time for each timed candidate (in the order they are timed)."""

  def __init__(self, seconds):
    self.seconds, self.calls = list(seconds), 0

  def __call__(self, run, repeats):
    self.calls += 1
    return [self.seconds.pop(0)] * repeats


CHUNKED_8 = Candidate("xla_chunked", fl.CpuBlockSizes(block_q=8, block_kv=8))
CHUNKED_16 = Candidate("xla_chunked", fl.CpuBlockSizes(block_q=16, block_kv=16))


# ----------------------------------------------------------------------------
# Selection (no compiles)
# ----------------------------------------------------------------------------

def test_choose_takes_the_fastest_that_passed_and_keeps_the_default_within_min_gain():
  default = Measured(Candidate("xla_dense"), True, seconds=(1.0, 1.1))
  faster = Measured(CHUNKED_8, True, seconds=(0.5,))
  rejected = Measured(CHUNKED_16, False, "conformance: relative error 0.5 > 0.0002")
  assert tuner.choose([default, faster, rejected]) == (faster, default)
  # 2% faster is within min_gain (3%): the default stays
  slightly = Measured(CHUNKED_8, True, seconds=(0.98,))
  assert tuner.choose([default, slightly], min_gain=0.03) == (default, default)
  assert tuner.choose([default, slightly], min_gain=0.0)[0] is slightly
  # a rejected candidate is never chosen, even with the smallest time on record
  bogus = Measured(CHUNKED_16, False, "conformance", seconds=(0.01,))
  assert tuner.choose([default, bogus])[0] is default
  assert tuner.choose([rejected]) == (None, None)


def test_cpu_candidates_start_with_the_untuned_choice_and_stay_within_auto():
  short = candidates.for_call("auto", _request((2, 512, 4, 8)), "cpu")
  assert short[0] == Candidate("xla_dense")  # what auto runs untuned below CPU_CHUNKED_MIN_KV_LEN
  long = candidates.for_call("auto", _request((1, 2048, 2, 8)), "cpu")
  assert long[0] == Candidate("xla_chunked")
  assert {c.impl for c in short + long} == {"xla_dense", "xla_chunked"}
  tiles = [REGISTRY["xla_chunked"].chunk_shape(dataclasses.replace(_request((1, 2048, 2, 8)),
                                                                   block_sizes=c.block_sizes))
           for c in long if c.impl == "xla_chunked" and (c.block_sizes is None or c.block_sizes.block_q)]
  assert len(tiles) == len(set(tiles))  # no two candidates run the same chunks
  # xla_dense's logits over the memory cap: not a candidate ("auto" keeps memory linear there)
  huge = _request((8, 4096, 16, 8))
  assert {c.impl for c in candidates.for_call("auto", huge, "cpu")} == {"xla_chunked"}
  assert candidates.for_call("reference", huge, "cpu") == []


# ----------------------------------------------------------------------------
# Tuning end to end (small compiles)
# ----------------------------------------------------------------------------

def test_autotune_times_validates_stores_and_reuses(tmp_path):
  q, k, v = _qkv()
  timer = FakeTimer([3e-3, 1e-3, 2e-3])  # xla_dense, chunked 8x8, chunked 16x16
  cands = [Candidate("xla_dense"), CHUNKED_8, CHUNKED_16]
  request = _request(causal=True)
  result = tuner.tune_request(request, candidate_list=cands, timer=timer, repeats=1, cache_dir=tmp_path,
                              mode="eval")
  assert (result.impl, result.block_sizes) == ("xla_chunked", fl.CpuBlockSizes(8, 8))
  assert result.seconds == 1e-3 and result.default_seconds == 3e-3
  assert all(m.ok and m.max_error < tuner.TOLERANCE["float32"] for m in result.measured)
  stored = json.loads(next(tmp_path.glob("*.json")).read_text())
  assert stored["device_kind"] == cache.device_kind()
  entry = stored["entries"][cache.bucket_key("auto", request)]
  assert entry["impl"] == "xla_chunked" and entry["block_sizes"]["block_q"] == 8

  # A second autotune of the same bucket reads the cache and times nothing.
  again = fl.autotune(q, k, v, causal=True, cache_dir=tmp_path, timer=timer, mode="eval")
  assert again.source == cache.SOURCE_CACHE and timer.calls == 3
  assert (again.impl, again.block_sizes) == ("xla_chunked", fl.CpuBlockSizes(8, 8))


def _off_by_one_percent(attend):
  """An impl's attend with its output off by 1%: far outside the contract's tolerance."""
  def wrong(q, k, v, *, request, args):
    out, lse = attend(q, k, v, request=request, args=args)
    return out * 1.01, lse
  return wrong


def test_a_candidate_failing_conformance_is_never_timed_or_chosen(monkeypatch, tmp_path):
  dense = REGISTRY["xla_dense"]
  monkeypatch.setattr(dense, "attend", _off_by_one_percent(dense.attend))
  timer = FakeTimer([5e-3])  # only the one candidate that passes is timed
  result = tuner.tune_request(_request(), candidate_list=[Candidate("xla_dense"), CHUNKED_8], timer=timer,
                              repeats=1, cache_dir=tmp_path, mode="eval")
  wrong, ok = result.measured
  assert not wrong.ok and wrong.error.startswith("conformance") and wrong.max_error > 5e-3
  assert ok.ok and (result.impl, result.block_sizes) == ("xla_chunked", CHUNKED_8.block_sizes)
  assert timer.calls == 1


def test_block_sizes_autotune_tunes_once_then_hits_the_cache(monkeypatch):
  monkeypatch.setattr(candidates, "for_call",
                      lambda impl, request, platform: [Candidate("xla_chunked"), CHUNKED_8])
  q, k, v = _qkv(seed=3)
  seg = jnp.array([[1] * 10 + [2] * 6])
  out = fl.attention(q, k, v, impl="xla_chunked", segment_ids=seg, block_sizes="autotune")
  visible = reference64.mask(1, 16, 16, segment_ids=np.asarray(seg))[:, None]
  np.testing.assert_allclose(out, reference64.attention(q, k, v, visible)["out"], atol=2e-5)
  explained = fl.explain(q, k, v, impl="xla_chunked", segment_ids=seg, block_sizes="autotune")
  assert explained.tuning == cache.SOURCE_CACHE and "tuned (cache hit)" in str(explained)

  def no_tuning(*args, **kwargs):
    raise AssertionError("tuned again despite the cache")
  monkeypatch.setattr(tuner, "tune_request", no_tuning)
  again = fl.attention(q, k, v, impl="xla_chunked", segment_ids=seg, block_sizes="autotune")
  np.testing.assert_allclose(again, out, atol=1e-6)


# ----------------------------------------------------------------------------
# The cache as "auto" and explain read it (no tuning)
# ----------------------------------------------------------------------------

def _write_table(directory, entries):
  directory.mkdir(parents=True, exist_ok=True)
  cache.file_for(directory, cache.device_kind()).write_text(json.dumps(
      {"device_kind": cache.device_kind(), "entries": entries}))


def _entry(impl, sizes=None):
  return {"impl": impl, "block_sizes": cache.encode_block_sizes(sizes), "seconds": 1e-3,
          "default_seconds": 2e-3, "mode": "train"}


def test_shipped_table_then_user_cache_then_default(monkeypatch, tmp_path):
  q, k, v = _qkv()
  request = _request(causal=True)
  key = cache.bucket_key("auto", request)
  assert fl.explain(q, k, v, causal=True).tuning == cache.SOURCE_DEFAULT

  shipped = tmp_path / "shipped"
  _write_table(shipped, {key: _entry("xla_chunked", fl.CpuBlockSizes(8, 8))})
  monkeypatch.setattr(cache, "SHIPPED_DIR", shipped)
  monkeypatch.setenv(cache.ENV_SHIPPED, "1")
  explained = fl.explain(q, k, v, causal=True)
  assert (explained.impl, explained.tuning) == ("xla_chunked", cache.SOURCE_SHIPPED)
  # the tuned 8-token chunks run: 2x2 chunk pairs of which causal visits 3 (per head)
  assert (explained.blocks_visited, explained.blocks_total) == (3 * 2, 4 * 2)
  out = fl.attention(q, k, v, causal=True)
  expected = reference64.attention(q, k, v, reference64.mask(1, 16, 16, causal=True)[:, None])["out"]
  np.testing.assert_allclose(out, expected, atol=2e-5)

  user = tmp_path / "user"
  _write_table(user, {key: _entry("xla_dense")})
  monkeypatch.setenv(cache.ENV_DIR, str(user))
  explained = fl.explain(q, k, v, causal=True)
  assert (explained.impl, explained.tuning) == ("xla_dense", cache.SOURCE_CACHE)
  with cache.disabled():
    assert fl.explain(q, k, v, causal=True).tuning == cache.SOURCE_DEFAULT


@pytest.mark.parametrize("impl", ["reference", "flash_pallas", "no_such_impl"])
def test_auto_never_takes_an_entry_outside_its_own_choices(monkeypatch, tmp_path, impl):
  q, k, v = _qkv()
  _write_table(tmp_path, {cache.bucket_key("auto", _request()): _entry(impl)})
  monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
  explained = fl.explain(q, k, v)
  assert (explained.impl, explained.tuning) == ("xla_dense", cache.SOURCE_DEFAULT)


def test_bucket_key_shares_rounded_shapes_and_splits_features():
  key = lambda length: cache.bucket_key("auto", _request((1, length, 2, 8)))  # noqa: E731
  assert key(500) == key(512) != key(513)
  assert cache.bucket_key("auto", _request()) != cache.bucket_key("auto", _request(causal=True))
  assert cache.bucket_key("auto", _request()) != cache.bucket_key("xla_chunked", _request())


def test_bad_block_sizes_string_names_the_argument():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="block_sizes must be .*'autotune'; got 'fastest'"):
    fl.attention(q, k, v, block_sizes="fastest")
  with pytest.raises(ValueError, match="CpuBlockSizes.block_q must be a positive multiple of 8"):
    fl.CpuBlockSizes(block_q=12)
  with pytest.raises(ValueError, match="mode must be one of"):
    tuner.tune_request(_request(), mode="fast")


def test_user_dir_follows_argument_env_and_xdg(monkeypatch, tmp_path):
  assert cache.user_dir(tmp_path) == tmp_path
  monkeypatch.delenv(cache.ENV_DIR)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cache.user_dir() == tmp_path / "xdg" / "flash_layers" / "tuning"


# ----------------------------------------------------------------------------
# The CLI's pieces: recording a step's calls (traced, never run), tuning each bucket once
# ----------------------------------------------------------------------------

def test_recorded_calls_split_train_and_eval_buckets_and_tune_each_once(monkeypatch, tmp_path):
  from benchmarks import autotune as cli

  q = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
  seg = jnp.ones(SHAPE[:2], jnp.int32)

  def layer(q, k, v, rate):  # an explicit impl: "auto" would also trace the TPU and GPU kernels
    return fl.attention(q, k, v, impl="xla_dense", segment_ids=seg, dropout_rate=rate,
                        dropout_rng=jax.random.key(0))

  with cli.recorded_calls() as train:
    jax.eval_shape(jax.grad(lambda q: layer(q, q, q, 0.1).sum()), q)
  with cli.recorded_calls() as evaluate:
    jax.eval_shape(lambda q: layer(q, q, q, 0.0), q)
  ((train_impl, train_request),), ((_, eval_request),) = train, evaluate
  assert train_impl == "xla_dense" and train_request.has_dropout and not eval_request.has_dropout
  assert cache.bucket_key("xla_dense", train_request) != cache.bucket_key("xla_dense", eval_request)

  tuned = []
  monkeypatch.setattr(tuner, "tune_request", lambda request, **kw: tuned.append((request, kw["mode"])) or
                      tuner.TuningResult("xla_dense", None, "tuned", cache.bucket_key("xla_dense", request)))
  rows = cli.tune_calls(train * 2, "train", cache_dir=tmp_path, log=lambda _: None)
  assert tuned == [(train_request, "train")] and len(rows) == 1  # one bucket, tuned once
