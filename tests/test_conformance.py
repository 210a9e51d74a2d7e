"""The conformance suite: every impl, forward and gradients, against float64 NumPy.

Adding an impl or an interpret platform is one line in CASES. An impl that
refuses a feature by design lists it in REFUSED; the suite then asserts that
the request raises UnsupportedError naming the feature (never a silent skip).

Each named configuration in CONFIGS exercises a few features at the smallest
size that needs them; together they cover lengths 1/7/128/200/333/1024, q_len !=
kv_len, batch 1 and 3, every (heads, kv heads) pair with heads in 1/2/4/8,
head_dim 32/64/80/128/256 and head_dim_v != head_dim, causal, packed segment ids
with padding, windows, softcap, rows that see no key, a custom scale, dropout (rates
0.1 and 0.5, also broadcast; the oracle gets the keep mask from `fl.dropout_mask`),
ALiBi and a dense bias (with its gradient). Every configuration runs for every case
in float32; bfloat16 runs on BF16_CONFIGS, a subset in which every feature above
appears at least once (the interpreted kernels make each run cost seconds).

Tolerances. float32: the worst error, relative to the float64 magnitude of the
terms summed (reference64), is at most F32_TOL. bfloat16: the impl's error against float64
is at most twice the error of the `reference` impl run in bfloat16 on the same
inputs, plus BF16_FLOOR (both measured the same way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import zlib
from collections.abc import Callable
from typing import Any

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiering

import flash_layers as fl
from flash_layers import lowering
from flash_layers.testing import reference64

# (impl, interpret platform or None). One line per impl or interpret platform.
CASES = [
    ("reference", None),
    ("xla_native", None),
    ("xla_chunked", None),
    ("xla_dense", None),
    ("flash_pallas", "tpu"),
    ("flash_pallas", "gpu"),
    ("jax_splash", "tpu"),
]

# Features a case refuses by design (docs/contract.md feature table) -> the suite expects UnsupportedError.
REFUSED = {
    ("xla_native", None): ("softcap", "head_dim_v", "dropout", "score_mod"),
    ("flash_pallas", "tpu"): ("dense bias",),
    ("flash_pallas", "gpu"): ("dense bias",),
    ("jax_splash", "tpu"): ("dropout", "alibi", "dense bias", "global tokens", "mask_mod", "score_mod"),
}

# Cases that run a subset of CONFIGS (each an interpreted kernel of seconds per configuration, so
# the suite stays inside the CI budget): the listed configurations plus every one that uses a
# feature the case refuses (those only check the refusal). jax_splash's subset exercises what it
# serves: padding of both lengths, several blocks, q_len != kv_len both ways, GQA/MQA, batch,
# head_dim 80 and head_dim_v != head_dim, causal, windows, packed segments, rows that see no key
# (from segments and from the static mask), softcap and a custom scale.
SUBSETS = {
    ("jax_splash", "tpu"): (
        "len7_mqa", "len333_causal_h8_kv2", "len1024_causal_packed", "len200_batch3_packed",
        "cross_200_to_7", "cross_causal_128_to_333", "d80", "dv128_d32_causal_gqa",
        "orphan_rows_cross_causal", "window_empty_rows_cross", "window_asymmetric",
        "causal_window_packed_batch3", "softcap_causal_gqa_packed", "scale_small"),
}

# The configurations also run in bfloat16: together they hold every feature of CONFIGS
# (test_configs_cover_the_contract checks it).
BF16_CONFIGS = (
    "len7_mqa", "len128_causal_d64", "len333_causal_h8_kv2", "len1024_causal_packed",
    "cross_causal_128_to_333", "cross_packed_batch3", "h8_kv4_packed", "d80", "d128_causal", "d256",
    "dv128_d32_causal_gqa", "orphan_rows_cross_causal", "causal_window_packed_batch3",
    "window_empty_rows_cross", "softcap_causal_gqa_packed", "scale_large_causal",
    "global_causal_window_packed_batch3", "global_cross_packed", "dropout05_packed_gqa_batch2",
    "dropout05_broadcast_batch2", "alibi_h6_kv2_dropout_softcap_window",
    "bias_full_dropout_causal_batch2", "bias_shared_cross_packed_alibi", "sinks_orphans_causal_gqa_batch2",
    "mod_t5_prefix_gqa_batch2", "mod_documents_cross_batch2", "decode_ragged_causal_8k_q4_mqa",
    "mod_prefix_lm_gqa_batch2", "mod_softcap_as_score_mod_causal")

# Our interpreted kernels (seconds per configuration) run bfloat16 on fewer of them, which still
# hold every feature they serve: tails, several blocks, GQA/MQA, batch, cross lengths, packed
# segments, rows that see no key, windows, global tokens, head_dim 80 and head_dim_v != head_dim,
# softcap, ALiBi, dropout (broadcast and not), a mask_mod with an operand and a score_mod whose
# table takes gradients.
INTERPRETED_BF16 = (
    "len7_mqa", "len333_causal_h8_kv2", "cross_packed_batch3", "d80", "dv128_d32_causal_gqa",
    "orphan_rows_cross_causal", "causal_window_packed_batch3", "softcap_causal_gqa_packed",
    "global_cross_packed", "dropout05_broadcast_batch2", "alibi_h6_kv2_dropout_softcap_window",
    "sinks_orphans_causal_gqa_batch2", "decode_ragged_causal_8k_q4_mqa", "mod_t5_prefix_gqa_batch2",
    "mod_softcap_as_score_mod_causal")

F32_TOL = 1e-5
BF16_FLOOR = 2e-3
GRADS = ("dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Config:
  """One attention problem. ``segments``: None, "packed" (random packed documents, then
  padding with id 0), "orphans" (packed, plus a document in the queries that no key
  belongs to, so its rows see nothing) or "ragged" (a KV cache: each row's keys valid up to its
  own length, id 1, then unwritten slots, id -1, as `flash_layers.layers.kv_cache` marks them; lengths
  full, random, 0 and short). ``input_scale`` multiplies q and k (large logits
  make the softcap bite)."""

  name: str
  q_len: int = 16
  kv_len: int | None = None  # None: q_len
  batch: int = 1
  heads: int = 2
  kv_heads: int | None = None  # None: heads
  head_dim: int = 32
  head_dim_v: int | None = None  # None: head_dim
  causal: bool = False
  window: int | tuple[int, int] | None = None
  segments: str | None = None
  softcap: float | None = None
  scale: float | None = None
  input_scale: float = 1.0
  dropout: float = 0.0
  dropout_broadcast: bool = False
  alibi: bool = False
  bias: tuple[bool, bool, bool, bool] | None = None  # which of [b, h, t, s] the bias has (else 1)
  global_tokens: int = 0
  sinks: bool = False  # a random float32 [heads] of sink logits (differentiated too)
  mods: str | None = None  # a key of MOD_SCENARIOS: mask_mod / score_mod with their operands
  q_offset: int = 0  # global position of query 0 (a decoding step: kv_len - q_len)

  @property
  def s(self) -> int:
    return self.q_len if self.kv_len is None else self.kv_len

  @property
  def kvh(self) -> int:
    return self.heads if self.kv_heads is None else self.kv_heads

  @property
  def dv(self) -> int:
    return self.head_dim if self.head_dim_v is None else self.head_dim_v

  def features(self) -> set[str]:
    used = set()
    if self.softcap is not None:
      used.add("softcap")
    if self.dv != self.head_dim:
      used.add("head_dim_v")
    if self.dropout:
      used.add("dropout")
    if self.bias is not None:
      used.add("dense bias")
    if self.alibi:
      used.add("alibi")
    if self.global_tokens:
      used.add("global tokens")
    if self.sinks:
      used.add("sinks")
    if self.mods is not None:
      scenario = MOD_SCENARIOS[self.mods]
      used |= {name for name, fn in (("mask_mod", scenario.mask_mod), ("score_mod", scenario.score_mod))
               if fn is not None}
      if scenario.grads is not None:  # a score_mod whose floating-point operands take gradients
        used.add("score_mod operand gradients")
    return used


# ----------------------------------------------------------------------------
# mask_mod / score_mod scenarios: the jnp mods the impls run, and the same rules written again in
# NumPy for the float64 oracle (its mask, its score function with dy/dx, the operands' gradients
# from its dL/dy), so a mod the impls mis-apply cannot pass by being evaluated the same way twice.
# ----------------------------------------------------------------------------

T5_RADIUS = 8  # relative positions clipped to [-8, 8]: 17 buckets per head
MOD_CAP = 4.0  # the softcap written as a score_mod


def _t5_bias(score, b, h, q_idx, kv_idx, table, *_):
  return score + table[h, jnp.clip(q_idx - kv_idx, -T5_RADIUS, T5_RADIUS) + T5_RADIUS]


def _cap(score, b, h, q_idx, kv_idx, *_):
  return MOD_CAP * jnp.tanh(score / MOD_CAP)


def _positions(cfg):
  return np.arange(cfg.q_len)[:, None], np.arange(cfg.s)[None, :]


def _np_prefix_lm(cfg, prefix):  # bool [b, 1, t, s]
  i, j = _positions(cfg)
  return ((j <= i)[None] | (j[None] < np.asarray(prefix)[:, None, None]))[:, None]


def _np_t5_score(cfg, table):
  i, j = _positions(cfg)
  bias = np.asarray(table, np.float64)[:, np.clip(i - j, -T5_RADIUS, T5_RADIUS) + T5_RADIUS]  # [h, t, s]
  return lambda x: (x + bias[None], np.ones_like(x))


def _np_t5_grad(cfg, table, dscore, magnitude):
  """d table [h, buckets] = the sum of dL/dy over the (b, t, s) in each bucket, per head."""
  i, j = _positions(cfg)
  bucket = np.broadcast_to(np.clip(i - j, -T5_RADIUS, T5_RADIUS) + T5_RADIUS, dscore.shape[2:])
  grad, mag = np.zeros(table.shape), np.zeros(table.shape)
  for h in range(table.shape[0]):
    np.add.at(grad[h], bucket, dscore[:, h].sum(0))
    np.add.at(mag[h], bucket, np.abs(magnitude[:, h]).sum(0))
  return grad, mag.max()


def _np_cap(cfg):
  def f(x):
    t = np.tanh(x / MOD_CAP)
    return MOD_CAP * t, 1.0 - t * t
  return f


@dataclasses.dataclass(frozen=True)
class ModScenario:
  """mask_mod/score_mod, their operands, and the oracle's NumPy versions."""

  mask_mod: Any = None
  score_mod: Any = None
  operands: Callable = lambda cfg, rng: ()  # -> tuple of NumPy arrays
  visible: Callable | None = None  # (cfg, operands) -> bool broadcastable to [b, h, t, s]
  score: Callable | None = None  # (cfg, operands) -> x -> (y, dy/dx), float64
  grads: Callable | None = None  # (cfg, operands, dscore, magnitude) -> {operand index: (grad, magnitude)}


def _prefixes(cfg, rng):
  return rng.integers(0, cfg.s + 1, size=cfg.batch).astype(np.int32)


def _t5_table(cfg, rng):
  return (rng.standard_normal((cfg.heads, 2 * T5_RADIUS + 1)) * 2).astype(np.float32)


def _block_table(cfg, rng):
  return rng.random((-(-cfg.q_len // 8), -(-cfg.s // 8))) < 0.5


def _documents(cfg, rng):
  return (_packed_ids(rng, cfg.batch, cfg.q_len, 3, pad=5), _packed_ids(rng, cfg.batch, cfg.s, 3, pad=3))


MOD_SCENARIOS = {
    "prefix_lm": ModScenario(
        mask_mod=fl.masks.prefix_lm(operand=0), operands=lambda cfg, rng: (_prefixes(cfg, rng),),
        visible=lambda cfg, ops: _np_prefix_lm(cfg, ops[0])),
    "chunked_causal": ModScenario(
        mask_mod=fl.masks.chunked_causal(24),
        visible=lambda cfg, ops: ((lambda i, j: (j <= i) & (i // 24 == j // 24))(*_positions(cfg)))),
    "block_table": ModScenario(
        mask_mod=fl.masks.block_table(0, 8, 8), operands=lambda cfg, rng: (_block_table(cfg, rng),),
        visible=lambda cfg, ops: (lambda i, j: ops[0][i // 8, j // 8])(*_positions(cfg))),
    "documents": ModScenario(
        mask_mod=fl.masks.document(0, 1), operands=_documents,
        visible=lambda cfg, ops: (ops[0][:, :, None] == ops[1][:, None, :])[:, None]),
    "t5_bias": ModScenario(
        score_mod=_t5_bias, operands=lambda cfg, rng: (_t5_table(cfg, rng),),
        score=lambda cfg, ops: _np_t5_score(cfg, ops[0]),
        grads=lambda cfg, ops, d, m: {0: _np_t5_grad(cfg, ops[0], d, m)}),
    "t5_prefix": ModScenario(
        mask_mod=fl.masks.prefix_lm(operand=1), score_mod=_t5_bias,
        operands=lambda cfg, rng: (_t5_table(cfg, rng), _prefixes(cfg, rng)),
        visible=lambda cfg, ops: _np_prefix_lm(cfg, ops[1]),
        score=lambda cfg, ops: _np_t5_score(cfg, ops[0]),
        grads=lambda cfg, ops, d, m: {0: _np_t5_grad(cfg, ops[0], d, m)}),
    "cap": ModScenario(score_mod=_cap, score=lambda cfg, ops: _np_cap(cfg)),
}


CONFIGS = [
    # Lengths (none a multiple of a block size but 128 and 1024), batch, q_len != kv_len.
    Config("len1", q_len=1, heads=1),
    Config("len1_causal_packed", q_len=1, causal=True, segments="packed"),
    Config("len7_mqa", q_len=7, heads=2, kv_heads=1),
    Config("len128_causal_d64", q_len=128, causal=True, head_dim=64),
    Config("len200_batch3_packed", q_len=200, batch=3, heads=4, kv_heads=1, segments="packed"),
    Config("len333_causal_h8_kv2", q_len=333, heads=8, kv_heads=2, causal=True),
    Config("len1024_causal_packed", q_len=1024, heads=1, head_dim=64, causal=True, segments="packed"),
    Config("cross_7_to_128", q_len=7, kv_len=128, heads=4, kv_heads=2),
    Config("cross_200_to_7", q_len=200, kv_len=7),
    Config("cross_causal_128_to_333", q_len=128, kv_len=333, causal=True),
    Config("cross_packed_batch3", q_len=128, kv_len=200, batch=3, segments="packed"),
    # Heads: every dividing kv-head count for 1/2/4/8 heads (1/1, 2/1 and 8/2 are above).
    Config("h2_kv2_batch3", q_len=33, batch=3, heads=2, kv_heads=2),
    Config("h4_kv4", q_len=40, heads=4, kv_heads=4),
    Config("h4_kv1_causal", q_len=40, heads=4, kv_heads=1, causal=True),
    Config("h8_kv1", q_len=24, heads=8, kv_heads=1),
    Config("h8_kv4_packed", q_len=48, heads=8, kv_heads=4, segments="packed"),
    Config("h8_kv8", q_len=24, heads=8, kv_heads=8),
    # Head dims, and head_dim_v != head_dim.
    Config("d80", q_len=50, head_dim=80),
    Config("d128_causal", q_len=64, head_dim=128, causal=True),
    # Token-major GQA: flash_pallas on TPU runs the group's query heads in one forward q tile.
    Config("d128_causal_gqa", q_len=200, heads=4, kv_heads=2, head_dim=128, causal=True),
    Config("d256", q_len=40, heads=1, head_dim=256),
    Config("dv32_d64", q_len=48, head_dim=64, head_dim_v=32),
    Config("dv128_d32_causal_gqa", q_len=48, heads=4, kv_heads=2, head_dim_v=128, causal=True),
    # Segments.
    Config("packed_batch3_causal", q_len=128, batch=3, causal=True, segments="packed"),
    Config("orphan_rows", q_len=64, batch=2, segments="orphans"),
    Config("orphan_rows_cross_causal", q_len=64, kv_len=90, batch=2, causal=True, segments="orphans"),
    # Windows.
    Config("window_0_0", q_len=128, window=(0, 0)),
    Config("window_int", q_len=128, window=9),
    Config("window_asymmetric", q_len=200, window=(17, 5)),
    Config("causal_window", q_len=333, heads=1, causal=True, window=(64, 0)),
    Config("causal_window_packed_batch3", q_len=200, batch=3, causal=True, window=(32, 0),
           segments="packed"),
    Config("window_empty_rows_cross", q_len=200, kv_len=128, window=(0, 0)),
    # Softcap and scale.
    Config("softcap", q_len=64, softcap=2.0, input_scale=3.0),
    Config("softcap_causal_gqa_packed", q_len=96, heads=4, kv_heads=2, causal=True, softcap=5.0,
           input_scale=2.0, segments="packed"),
    # Global tokens (Longformer): the window waived for each document's first tokens.
    Config("global_window", q_len=200, window=9, global_tokens=2),
    Config("global_causal_window_packed_batch3", q_len=128, batch=3, causal=True, window=(16, 0),
           global_tokens=1, segments="packed"),
    Config("global_window_packed_gqa", q_len=96, heads=4, kv_heads=2, window=5, global_tokens=3,
           segments="packed"),
    Config("global_cross_packed", q_len=64, kv_len=100, batch=2, window=(7, 7), global_tokens=2,
           segments="packed"),
    Config("global_cross_causal", q_len=40, kv_len=130, heads=2, kv_heads=1, causal=True, window=(4, 0),
           global_tokens=1),
    Config("scale_small", q_len=64, scale=0.05),
    Config("scale_large_causal", q_len=64, causal=True, scale=0.5),
    # Dropout (tiny: the Pallas kernels run interpreted), ALiBi, dense bias.
    Config("dropout01_causal", q_len=64, causal=True, dropout=0.1),
    Config("dropout05_packed_gqa_batch2", q_len=48, batch=2, heads=4, kv_heads=2, segments="packed",
           dropout=0.5),
    Config("dropout05_window_cross", q_len=40, kv_len=56, window=(5, 9), dropout=0.5),
    Config("dropout01_cross_causal_mqa_orphans", q_len=24, kv_len=40, heads=4, kv_heads=1, causal=True,
           batch=2, segments="orphans", dropout=0.1),
    Config("dropout05_broadcast_batch2", q_len=32, batch=2, dropout=0.5, dropout_broadcast=True),
    Config("alibi_h6_kv2_dropout_softcap_window", q_len=40, heads=6, kv_heads=2, window=(8, 3), softcap=3.0,
           input_scale=2.0, alibi=True, dropout=0.1),
    Config("bias_full_dropout_causal_batch2", q_len=24, batch=2, causal=True, dropout=0.5,
           bias=(True, True, True, True)),
    Config("bias_shared_cross_packed_alibi", q_len=24, kv_len=40, heads=4, kv_heads=2, segments="packed",
           alibi=True, bias=(False, False, True, True)),
    # Attention sinks: rows that see no key (they keep 0), GQA, batch; with dropout, ALiBi, a
    # softcap and a window on cross lengths; with a dense bias.
    Config("sinks_orphans_causal_gqa_batch2", q_len=72, batch=2, heads=4, kv_heads=2, causal=True,
           segments="orphans", sinks=True),
    Config("sinks_dropout_alibi_softcap_window_cross", q_len=40, kv_len=56, heads=2, window=(8, 3),
           softcap=3.0, input_scale=2.0, alibi=True, dropout=0.1, sinks=True),
    Config("sinks_bias_packed", q_len=48, heads=2, segments="packed", bias=(False, True, True, True),
           sinks=True),
    # mask_mod / score_mod (MOD_SCENARIOS): prefix-LM with per-row prefixes, chunked causal (also
    # over several of xla_chunked's chunks), a block-sparse table, random documents, a T5 relative
    # bias table (its gradient checked) with a prefix-LM mask, softcap written as a score_mod; with
    # GQA, batch, cross lengths, sinks, and the built-in causal, window, ALiBi, softcap and dropout.
    Config("mod_prefix_lm_gqa_batch2", q_len=72, batch=2, heads=4, kv_heads=2, mods="prefix_lm"),
    Config("mod_chunked_causal_sinks", q_len=70, heads=2, mods="chunked_causal", sinks=True),
    Config("mod_chunked_causal_1100", q_len=1100, heads=1, mods="chunked_causal"),
    Config("mod_block_table_cross_window", q_len=40, kv_len=56, mods="block_table", window=(30, 10)),
    Config("mod_documents_cross_batch2", q_len=48, kv_len=64, batch=2, mods="documents"),
    Config("mod_t5_prefix_gqa_batch2", q_len=64, batch=2, heads=4, kv_heads=2, mods="t5_prefix"),
    Config("mod_t5_softcap_dropout_alibi", q_len=40, heads=2, mods="t5_bias", softcap=3.0, alibi=True,
           dropout=0.1, input_scale=2.0),
    Config("mod_softcap_as_score_mod_causal", q_len=50, heads=2, causal=True, mods="cap", input_scale=2.0),
    # Decoding: a few queries against a long cache with per-row valid lengths (full, random, 0, short),
    # the queries at the cache's end (q_offset). flash_pallas serves these with its split-KV decode
    # kernels (flash_pallas/decode.py): GQA groups packed into one tile, splits merged by logsumexp.
    Config("decode_ragged_8k_gqa", q_len=1, kv_len=8192, batch=3, heads=8, kv_heads=2, head_dim=64,
           segments="ragged"),
    Config("decode_ragged_causal_8k_q4_mqa", q_len=4, kv_len=8192, batch=4, heads=4, kv_heads=1,
           head_dim=128, causal=True, q_offset=8188, segments="ragged"),
    Config("decode_16q_causal_window_softcap_dv", q_len=16, kv_len=3000, heads=2, causal=True,
           window=(1000, 0), q_offset=2984, softcap=4.0, input_scale=2.0, head_dim_v=64),
    # The same path at the smallest size that still splits (2 splits of 128 keys on the TPU family, 18
    # of 64 on the GPU family): what the default tier runs (the 8k cases are its second tier).
    Config("decode_ragged_causal_1k_gqa", q_len=2, kv_len=1100, batch=3, heads=4, kv_heads=2, head_dim=64,
           causal=True, q_offset=1098, segments="ragged"),
]
CONFIG_BY_NAME = {c.name: c for c in CONFIGS}


# ----------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------

def _packed_ids(rng, batch, length, num_docs, pad):
  """Per row: documents 1..num_docs in order, each of random length, then `pad` zeros."""
  ids = np.zeros((batch, length), np.int32)
  real = max(length - pad, 0)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, real), size=min(num_docs - 1, max(real - 1, 0)),
                              replace=False)) if real > 1 else np.array([], int)
    ids[row, :real] = 1 + np.searchsorted(cuts, np.arange(real), side="right")
  return ids


def _segment_kwargs(cfg: Config, rng) -> dict:
  if cfg.segments is None:
    return {}
  if cfg.segments == "ragged":
    lengths = [cfg.s, int(rng.integers(1, cfg.s)), 0, int(rng.integers(1, 9))][:cfg.batch]
    kv_ids = np.where(np.arange(cfg.s)[None, :] < np.array(lengths)[:, None], 1, -1).astype(np.int32)
    return {"segment_ids": np.ones((cfg.batch, cfg.q_len), np.int32), "kv_segment_ids": kv_ids}
  num_docs = int(rng.integers(1, 5))
  q_ids = _packed_ids(rng, cfg.batch, cfg.q_len, num_docs, pad=int(rng.integers(0, cfg.q_len // 4 + 1)))
  if cfg.s == cfg.q_len:
    kv_ids = q_ids.copy()
  else:
    kv_ids = _packed_ids(rng, cfg.batch, cfg.s, num_docs, pad=int(rng.integers(0, cfg.s // 4 + 1)))
  if cfg.segments == "orphans":
    # The last quarter of the queries belongs to a document no key is in.
    q_ids[:, cfg.q_len - max(cfg.q_len // 4, 1):] = 99
  if cfg.s == cfg.q_len and cfg.segments == "packed":
    return {"segment_ids": q_ids}
  return {"segment_ids": q_ids, "kv_segment_ids": kv_ids}


@dataclasses.dataclass
class Problem:
  cfg: Config
  dtype: str
  seed: int | None  # None: derived from the config's name
  inputs: tuple  # q, k, v, dout as numpy arrays already rounded to `dtype` (held in float32)
  seg: dict  # numpy int32 segment ids
  expected: dict  # float64 out, lse, dq, dk, dv (dbias), visible_rows
  bias: np.ndarray | None = None  # float32, rank 4
  sinks: np.ndarray | None = None  # float32 [heads]
  mod_operands: tuple = ()  # NumPy arrays (ModScenario.operands)

  @property
  def kwargs(self) -> dict:
    cfg = self.cfg
    kwargs = {"causal": cfg.causal, "window": cfg.window, "softcap": cfg.softcap, "scale": cfg.scale,
              "global_tokens": cfg.global_tokens}
    if cfg.q_offset:
      kwargs["q_offset"] = cfg.q_offset
    if cfg.dropout:
      kwargs.update(dropout_rate=cfg.dropout, dropout_rng=dropout_key(cfg, self.seed),
                    dropout_broadcast=cfg.dropout_broadcast)
    if cfg.alibi:
      kwargs["alibi_slopes"] = fl.alibi_slopes(cfg.heads)
    if cfg.mods is not None:
      scenario = MOD_SCENARIOS[cfg.mods]
      kwargs.update(mask_mod=scenario.mask_mod, score_mod=scenario.score_mod)
    return kwargs


def dropout_key(cfg: Config, seed: int | None):
  return jax.random.key(zlib.crc32(cfg.name.encode()) if seed is None else seed)


@functools.cache
def make_problem(cfg: Config, dtype: str, seed: int | None = None) -> Problem:
  rng = np.random.default_rng(zlib.crc32(cfg.name.encode()) if seed is None else seed)
  b, t, s, h, kvh, d, dv = cfg.batch, cfg.q_len, cfg.s, cfg.heads, cfg.kvh, cfg.head_dim, cfg.dv
  shapes = [(b, t, h, d), (b, s, kvh, d), (b, s, kvh, dv), (b, t, h, dv)]
  arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
  arrays[0] *= cfg.input_scale
  arrays[1] *= cfg.input_scale
  # Round to the test dtype first, so float64 sees exactly the values the impl sees.
  arrays = tuple(np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in arrays)
  seg = _segment_kwargs(cfg, rng)
  visible = reference64.mask(b, t, s, causal=cfg.causal, window=cfg.window, q_offset=cfg.q_offset,
                             global_tokens=cfg.global_tokens, **seg)[:, None]
  q, k, v, dout = arrays
  bias = None
  if cfg.bias is not None:
    shape = tuple(n if has else 1 for n, has in zip((b, h, t, s), cfg.bias, strict=True))
    bias = rng.standard_normal(shape).astype(np.float32)
  keep = None
  if cfg.dropout:
    keep = np.asarray(fl.dropout_mask(dropout_key(cfg, seed), batch=b, num_heads=h, q_len=t, kv_len=s,
                                      rate=cfg.dropout, broadcast=cfg.dropout_broadcast))
  sinks = rng.standard_normal(h).astype(np.float32) + 1.0 if cfg.sinks else None
  scenario = MOD_SCENARIOS.get(cfg.mods, ModScenario())
  ops = scenario.operands(cfg, rng)
  if scenario.visible is not None:
    visible = visible & scenario.visible(cfg, ops)
  expected = reference64.attention(
      q, k, v, visible, scale=cfg.scale, softcap=cfg.softcap, bias=bias,
      alibi_slopes=np.asarray(fl.alibi_slopes(h)) if cfg.alibi else None, keep=keep, rate=cfg.dropout,
      dout=dout, sinks=sinks, score_mod=None if scenario.score is None else scenario.score(cfg, ops))
  if scenario.grads is not None:
    for i, (grad, magnitude) in scenario.grads(cfg, ops, expected["dscore"],
                                                expected["magnitude"]["dscore_elements"]).items():
      expected[f"dmod{i}"], expected["magnitude"][f"dmod{i}"] = grad, magnitude
  return Problem(cfg, dtype, seed, arrays, seg, expected, bias, sinks, ops)


def _interpret(platform, tpu_params=None):
  if not platform:
    return contextlib.nullcontext()
  return fl.interpret_as(platform, params=tpu_params if platform == "tpu" else None)


def run_case(case, problem: Problem, tpu_params=None) -> dict:
  """Forward and dq, dk, dv of `case` on `problem`, in one compiled function.

  tpu_params: how an interpreted TPU case is interpreted (`fl.interpret_as`'s params): None, the
  TPU-semantics interpreter, or "plain" (numerics only; see the second tier's rule above test_conforms).
  """
  impl, platform = case
  kwargs = problem.kwargs

  floats = [jnp.issubdtype(x.dtype, jnp.floating) for x in problem.mod_operands]

  def fwd_bwd(q, k, v, dout, seg, bias, sinks, float_ops, other_ops):
    def f(q, k, v, bias, sinks, float_ops):
      it_f, it_o = iter(float_ops), iter(other_ops)
      ops = tuple(next(it_f) if is_float else next(it_o) for is_float in floats)
      return fl.attention(q, k, v, impl=impl, **seg, **kwargs, bias=bias, sinks=sinks,
                          mod_operands=ops or None)

    out, vjp = jax.vjp(f, q, k, v, bias, sinks, float_ops)
    dq, dk, dv, dbias, dsinks, d_float = vjp(dout)
    result = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    float_indices = [i for i, is_float in enumerate(floats) if is_float]
    for i, d in zip(float_indices, d_float, strict=True):
      result[f"dmod{i}"] = d
    if bias is not None:
      result["dbias"] = dbias
    if sinks is not None:
      result["dsinks"] = dsinks
    return result

  arrays = [jnp.asarray(a, problem.dtype) for a in problem.inputs]
  seg = {name: jnp.asarray(ids) for name, ids in problem.seg.items()}
  bias = None if problem.bias is None else jnp.asarray(problem.bias)
  sinks = None if problem.sinks is None else jnp.asarray(problem.sinks)
  float_ops = tuple(jnp.asarray(x) for x, f in zip(problem.mod_operands, floats, strict=True) if f)
  other_ops = tuple(jnp.asarray(x) for x, f in zip(problem.mod_operands, floats, strict=True) if not f)
  with _interpret(platform, tpu_params):
    result = jax.jit(fwd_bwd)(*arrays, seg, bias, sinks, float_ops, other_ops)
  return {name: np.asarray(x.astype(jnp.float32), np.float64) for name, x in result.items()}


def relative_errors(actual: dict, expected: dict) -> dict[str, tuple[float, tuple]]:
  """Per tensor: (worst |actual - expected| / its float64 magnitude, index of the worst element).

  The magnitude (see reference64) is the size of the terms summed, so an
  output that cancels to ~0 is not judged relative to ~0.
  """
  errors = {}
  for name in ("out", *GRADS, *(n for n in actual if n in ("dbias", "dsinks") or n.startswith("dmod"))):
    expect, magnitude = expected[name], expected["magnitude"][name]
    if name == "dbias":  # the oracle's [b, h, t, s], summed over the bias's broadcast axes
      axes = tuple(i for i in range(4) if actual[name].shape[i] == 1 and expect.shape[i] != 1)
      magnitude *= np.prod([expect.shape[i] for i in axes])
      expect = expect.sum(axis=axes, keepdims=True)
    diff = np.abs(actual[name] - expect)
    if not np.all(np.isfinite(actual[name])):
      errors[name] = (np.inf, tuple(int(i) for i in np.argwhere(~np.isfinite(actual[name]))[0]))
      continue
    worst = np.unravel_index(np.argmax(diff), diff.shape)
    errors[name] = (float(diff[worst] / max(magnitude, 1e-30)),
                    tuple(int(i) for i in worst))
  return errors


@functools.cache
def _reference_bf16_errors(cfg: Config, seed: int | None) -> dict:
  problem = make_problem(cfg, "bfloat16", seed)
  return relative_errors(run_case(("reference", None), problem), problem.expected)


def check_case(case, problem: Problem, tpu_params=None):
  """Run `case` on `problem` and assert it conforms (or refuses, if REFUSED says so)."""
  refused = problem.cfg.features() & set(REFUSED.get(case, ()))
  if refused:
    with pytest.raises(fl.UnsupportedError, match="|".join(sorted(refused))):
      run_case(case, problem, tpu_params)
    return
  actual = run_case(case, problem, tpu_params)
  errors = relative_errors(actual, problem.expected)
  if problem.dtype == "float32":
    limits = {name: F32_TOL for name in errors}
  else:
    ref = _reference_bf16_errors(problem.cfg, problem.seed)
    limits = {name: 2 * ref[name][0] + BF16_FLOOR for name in errors}
  failed = {name: err for name, err in errors.items() if not err[0] <= limits[name]}
  report = ", ".join(f"{name} {err:.2e} at {idx} (limit {limits[name]:.2e})"
                     for name, (err, idx) in errors.items())
  assert not failed, f"{case} {problem.cfg.name} {problem.dtype}: {report}"

  # Rows that see no key: exactly zero output and zero dq, never NaN.
  empty = ~problem.expected["visible_rows"]  # [b, h, t]
  if empty.any():
    empty_btn = np.transpose(empty, (0, 2, 1))  # [b, t, h]
    assert np.all(actual["out"][empty_btn] == 0), f"{case}: rows with no visible key must be 0"
    assert np.all(actual["dq"][empty_btn] == 0), f"{case}: rows with no visible key need dq = 0"


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------

def _case_id(case):
  impl, platform = case
  return impl if platform is None else f"{impl}-{platform}"


def _runs(case, cfg: Config) -> bool:
  subset = SUBSETS.get(case)
  return subset is None or cfg.name in subset or bool(cfg.features() & set(REFUSED.get(case, ())))


def _bf16_configs(case) -> tuple[str, ...]:
  return INTERPRETED_BF16 if case[0] == "flash_pallas" else BF16_CONFIGS


# ----------------------------------------------------------------------------
# The default tier: per case and dtype, the cheapest configurations that together hold everything the
# full grid holds (tiering.cover). Every configuration still runs for every case in the second tier.
# The grid is not sampled at random: a case's configurations are bundles of features, and what a bug
# needs to show is one feature, or one of the interactions listed in _attributes (GQA x segment ids x
# several tiles, causal x window, cross lengths x causal, ...), on that case; so each case keeps each
# feature and each listed interaction at least once. Refusals raise before anything compiles: all kept.
#
# Interpreters: an interpreted TPU case of the default tier runs under the TPU-semantics interpreter
# (`pltpu.InterpretParams`: uninitialized buffers read as NaN, out-of-bounds reads raise), so every
# kernel path, each feature and each listed interaction, is checked for memory errors as well as numbers.
# Which buffer a kernel reads, and whether it wrote it first, is a property of its code path, not of
# the sizes; the second tier's configurations add sizes and combinations of paths the default tier
# holds, and check their numbers under the plain interpreter (`fl.interpret_as("tpu", params="plain")`:
# the same kernel bodies and numerics, without the simulated memory's io callbacks, several times
# faster on long grids). The strict tier (test_tpu_strict.py) adds races and megacore on its own walk.
# ----------------------------------------------------------------------------

def _attributes(cfg: Config, dtype: str = "float32") -> set:
  """What a configuration exercises: its features and the shape properties the kernels tile by. In
  bfloat16 (what changes is the casts around the same code) whether it spans one tile or several: the
  features in bfloat16 are each impl's second-tier cases."""
  heads = "mha" if cfg.kvh == cfg.heads else ("mqa" if cfg.kvh == 1 else "gqa")
  longest = max(cfg.q_len, cfg.s)
  tiles = "decode" if cfg.q_len <= 16 and cfg.s >= 1024 else ("one" if longest <= 128 else "many")
  if dtype == "bfloat16":  # the casts around the same code: one tile and several (the rest: second tier)
    return {("tiles", "one" if tiles == "one" else "many")}
  attrs = {("feature", f) for f in cfg.features()}
  attrs |= {("tiles", tiles), ("segments", cfg.segments)}
  window = None if cfg.window is None else ("symmetric" if isinstance(cfg.window, int) else "pair")
  head_dim = "lanes" if cfg.head_dim % 128 == 0 else ("odd" if cfg.head_dim % 32 else "small")
  attrs |= {
      ("heads", heads), ("head_dim", head_dim),
      ("head_dim_v", cfg.dv != cfg.head_dim), ("causal", cfg.causal), ("window", window),
      ("cross", "q<kv" if cfg.q_len < cfg.s else ("q>kv" if cfg.q_len > cfg.s else "self")),
      ("batch", cfg.batch > 1), ("scale", cfg.scale is not None), ("length 1", cfg.q_len == 1)}
  # Interactions kept together: a kernel's tiling meets its masking.
  if cfg.segments and tiles != "one":
    attrs.add(("segments x heads x tiles", cfg.segments == "packed" and heads != "mha"))
  if cfg.causal and cfg.window is not None:
    attrs.add(("causal x window", True))
  if cfg.causal and cfg.q_len != cfg.s:
    attrs.add(("causal x cross", True))
  if cfg.dropout:  # the keep mask's stream per (batch row, head): both > 1, not broadcast
    attrs.add(("dropout", cfg.dropout_broadcast, cfg.batch > 1 and cfg.heads > 1))
  return attrs


def _cost(cfg: Config) -> float:
  """What a configuration costs an interpreted kernel: a compile, then its (128 x 128) tiles."""
  return 1.0 + cfg.batch * cfg.heads * -(-cfg.q_len // 128) * -(-cfg.s // 128) / 64


@functools.cache
def default_tier(case, dtype: str) -> frozenset[str]:
  names = _bf16_configs(case) if dtype == "bfloat16" else [c.name for c in CONFIGS]
  configs = [CONFIG_BY_NAME[n] for n in names if _runs(case, CONFIG_BY_NAME[n])]
  refusals = [c for c in configs if c.features() & set(REFUSED.get(case, ()))]
  served = [c for c in configs if c not in refusals]
  return frozenset(c.name for c in refusals + tiering.cover(served, lambda c: _attributes(c, dtype), _cost))


@pytest.mark.parametrize(("case", "config", "dtype"), [
    tiering.param(case, cfg.name, dtype, id=f"{_case_id(case)}-{cfg.name}-{dtype}",
                  default=cfg.name in default_tier(case, dtype))
    for case in CASES for cfg in CONFIGS if _runs(case, cfg)
    for dtype in ("float32", "bfloat16") if dtype == "float32" or cfg.name in _bf16_configs(case)])
def test_conforms(case, config, dtype):
  tpu_params = None if config in default_tier(case, dtype) else lowering.PLAIN
  check_case(case, make_problem(CONFIG_BY_NAME[config], dtype), tpu_params=tpu_params)


def test_configs_cover_the_contract():
  """The list above really covers what its docstring promises."""
  lengths = {c.q_len for c in CONFIGS} | {c.s for c in CONFIGS}
  assert {1, 7, 128, 200, 333, 1024} <= lengths
  assert any(c.q_len != c.s for c in CONFIGS)
  assert {c.batch for c in CONFIGS} >= {1, 3}
  pairs = {(c.heads, c.kvh) for c in CONFIGS}
  assert {(h, kvh) for h in (1, 2, 4, 8) for kvh in range(1, h + 1) if h % kvh == 0} <= pairs
  assert {32, 64, 80, 128, 256} <= {c.head_dim for c in CONFIGS}
  assert any(c.dv != c.head_dim for c in CONFIGS)
  assert any(c.window == (0, 0) for c in CONFIGS)
  assert any(c.causal and c.window is not None for c in CONFIGS)
  assert {"packed", "orphans"} <= {c.segments for c in CONFIGS}
  assert any(c.softcap for c in CONFIGS) and any(c.scale for c in CONFIGS)
  dropout = [c for c in CONFIGS if c.dropout]
  assert {c.dropout for c in dropout} == {0.1, 0.5}
  assert all(any(pred(c) for c in dropout) for pred in (
      lambda c: c.causal, lambda c: c.segments, lambda c: c.window is not None,
      lambda c: c.kvh < c.heads, lambda c: c.q_len != c.s, lambda c: c.dropout_broadcast))
  assert any(c.alibi for c in CONFIGS) and any(c.bias for c in CONFIGS)
  globals_ = [c for c in CONFIGS if c.global_tokens]
  assert any(c.causal for c in globals_) and any(c.segments for c in globals_)
  assert any(c.q_len != c.s for c in globals_) and any(c.heads != c.kvh for c in globals_)
  # Rows with no visible key occur (the zero-output check runs on them).
  assert any(not make_problem(c, "float32").expected["visible_rows"].all() for c in CONFIGS)
  # The bfloat16 subset holds every feature the whole list holds.
  bf16 = [CONFIG_BY_NAME[name] for name in BF16_CONFIGS]
  assert set().union(*(c.features() for c in bf16)) == set().union(*(c.features() for c in CONFIGS))
  assert {c.segments for c in bf16} == {c.segments for c in CONFIGS}
  assert {c.head_dim for c in bf16} == {c.head_dim for c in CONFIGS}
  assert {c.dropout for c in bf16} == {c.dropout for c in CONFIGS}
  assert any(c.q_len != c.s for c in bf16) and any(c.heads != c.kvh for c in bf16)
  assert all(any(pred(c) for c in bf16) for pred in (
      lambda c: c.causal, lambda c: c.window is not None, lambda c: c.scale, lambda c: c.q_len >= 1024,
      lambda c: c.dropout_broadcast, lambda c: c.batch > 1))
  interpreted = [CONFIG_BY_NAME[name] for name in INTERPRETED_BF16]
  assert set(INTERPRETED_BF16) <= set(BF16_CONFIGS)
  served = set().union(*(c.features() for c in CONFIGS)) - set(REFUSED[("flash_pallas", "tpu")])
  assert set().union(*(c.features() for c in interpreted)) == served
  assert {c.dropout_broadcast for c in interpreted} == {False, True}
  assert all(any(pred(c) for c in interpreted) for pred in (
      lambda c: c.causal, lambda c: c.window is not None, lambda c: c.global_tokens, lambda c: c.batch > 1,
      lambda c: c.q_len != c.s, lambda c: c.kvh == 1, lambda c: 1 < c.kvh < c.heads,
      lambda c: c.segments == "packed"))
  # A subset names real configurations, and with the refused ones it still covers each refusal.
  for case, subset in SUBSETS.items():
    assert set(subset) <= set(CONFIG_BY_NAME), case
    assert all(any(f in c.features() for c in CONFIGS if _runs(case, c)) for f in REFUSED.get(case, ()))


@st.composite
def random_configs(draw):
  heads = draw(st.sampled_from([1, 2, 4]))
  kv_heads = draw(st.sampled_from([n for n in (1, 2, 4) if heads % n == 0]))
  q_len = draw(st.integers(1, 70))
  kv_len = draw(st.one_of(st.just(q_len), st.integers(1, 70)))
  window = draw(st.one_of(st.none(), st.integers(0, 20),
                          st.tuples(st.integers(0, 20), st.integers(0, 20))))
  head_dim = draw(st.sampled_from([32, 64]))
  return Config(
      "hypothesis", q_len=q_len, kv_len=kv_len, batch=draw(st.integers(1, 2)), heads=heads,
      kv_heads=kv_heads, head_dim=head_dim,
      head_dim_v=draw(st.sampled_from([head_dim, head_dim, 32])), causal=draw(st.booleans()),
      window=window, segments=draw(st.sampled_from([None, "packed", "orphans"])),
      softcap=draw(st.sampled_from([None, None, 4.0])),
      scale=draw(st.sampled_from([None, None, 0.3])), input_scale=1.5, sinks=draw(st.booleans()),
      mods=draw(st.sampled_from([None, None, *sorted(MOD_SCENARIOS)])))


@pytest.mark.parametrize("case", [c for c in CASES if c not in SUBSETS and c[1] is None], ids=_case_id)
@hypothesis.settings(max_examples=10, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(cfg=random_configs(), seed=st.integers(0, 2**31 - 1))
def test_conforms_on_random_configs(case, cfg, seed):
  problem = make_problem(cfg, "float32", seed)
  check_case(case, problem)


@pytest.mark.parametrize("case", [c for c in CASES if c in SUBSETS or c[1] is not None],
                         ids=_case_id)
@hypothesis.settings(max_examples=5, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(cfg=random_configs(), seed=st.integers(0, 2**31 - 1))
def test_interpreted_cases_on_random_configs(case, cfg, seed):
  """The interpreted kernels (and subset cases) on a few random configurations (fewer examples:
  each one compiles and interprets a kernel)."""
  problem = make_problem(cfg, "float32", seed)
  check_case(case, problem)
