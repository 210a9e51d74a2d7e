"""The paged path's conformance suite: every paged impl against the float64 oracle, forward.

Adding a paged impl or an interpret platform is one line in CASES; a feature a case refuses by
design is listed in REFUSED, and the suite asserts the refusal names it. Each configuration in
CONFIGS is a ragged batch over a pool whose page table is shuffled (pages of different sequences
interleave, spare pages hold garbage): sequences of 0 and 1 tokens, exactly a page, a full table,
prefill chunks at an offset and decoding queries in one call, padding rows past the active
sequences, GQA and MQA, windows, softcap, sinks, head_dim_v != head_dim, both pool layouts.

Tolerances, relative to the oracle's magnitude (p |v| per row): float32 F32_TOL; bfloat16
BF16_TOL. Quantized pages: tight against the oracle on the dequantized pages (the impl's own
rounding), and against the float oracle within the bound docs/contract.md derives
(`quantization_bound`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers.contract import paged
from flash_layers.testing import reference64

CASES = [("reference", None), ("xla_chunked", None), ("flash_pallas", "tpu"), ("flash_pallas", "gpu")]

# Features a case refuses by design -> the suite expects UnsupportedError naming it.
REFUSED: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("flash_pallas", "tpu"): ("mask_mod", "float8"),
}

F32_TOL = 2e-5
BF16_TOL = 3e-2


@dataclasses.dataclass(frozen=True)
class Config:
  seqs: tuple[tuple[int, int], ...]  # (kv_len after the call, new tokens) per sequence
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 64
  head_dim_v: int | None = None
  page_size: int = 16
  pages_per_seq: int = 4
  padding_rows: int = 0
  num_seqs: int | None = None  # active sequences (None: all)
  layout: str = "flax"
  causal: bool = True
  window: tuple[int, int] | None = None
  softcap: float | None = None
  sinks: bool = False
  mask_mod: str | None = None

  def features(self) -> tuple[str, ...]:
    return (("mask_mod",) if self.mask_mod else ())


def _prefix_lm(b, h, q_idx, kv_idx):  # keys 0..7 are a bidirectional prefix, the rest causal
  return (kv_idx <= q_idx) | (kv_idx < 8)


MASK_MODS = {"prefix_lm": _prefix_lm}

CONFIGS = {
    # lengths 0, 1, a page boundary (16), a full table (64), a prefill chunk at an offset, a decode
    "ragged_gqa": Config(seqs=((0, 0), (1, 1), (16, 16), (37, 1), (64, 64), (40, 9)), heads=8,
                         kv_heads=2, padding_rows=3),
    "mqa_window_softcap": Config(seqs=((50, 1), (33, 5), (64, 2)), heads=4, kv_heads=1, window=(20, 0),
                                 softcap=5.0),
    "sinks_dv_padding": Config(seqs=((20, 3), (5, 5), (9, 1)), head_dim_v=32, sinks=True, num_seqs=2,
                               padding_rows=2),
    "non_causal": Config(seqs=((30, 2), (17, 1), (48, 16)), causal=False, window=(6, 3)),
    "heads_first": Config(seqs=((1, 1), (16, 16), (45, 4)), layout="heads_first", heads=8, kv_heads=2,
                          window=(12, 0)),
    "mask_mod": Config(seqs=((20, 6), (12, 12)), mask_mod="prefix_lm"),
}
BF16_CONFIGS = ("ragged_gqa", "mqa_window_softcap")


def make_batch(cfg: Config, dtype=np.float32, seed: int = 0):
  """A random ragged batch: q, pages (the pool's spare pages hold garbage) and a shuffled page table."""
  rng = np.random.default_rng(seed)
  n_seqs = len(cfg.seqs)
  num_pages = n_seqs * cfg.pages_per_seq + 3
  dv = cfg.head_dim_v or cfg.head_dim
  shape_k = paged.pool_shape(cfg.layout, num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)
  shape_v = paged.pool_shape(cfg.layout, num_pages, cfg.page_size, cfg.kv_heads, dv)
  k_pages = rng.standard_normal(shape_k).astype(dtype)
  v_pages = rng.standard_normal(shape_v).astype(dtype)
  table = rng.permutation(num_pages)[: n_seqs * cfg.pages_per_seq].reshape(n_seqs, cfg.pages_per_seq)
  kv_lens = np.array([kv for kv, _ in cfg.seqs], np.int32)
  cu = np.concatenate([[0], np.cumsum([n for _, n in cfg.seqs])]).astype(np.int32)
  tokens = int(cu[-1]) + cfg.padding_rows
  q = rng.standard_normal((tokens, cfg.heads, cfg.head_dim)).astype(dtype)
  sinks = rng.standard_normal(cfg.heads).astype(np.float32) if cfg.sinks else None
  return dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=table.astype(np.int32), kv_lens=kv_lens,
              cu_q_lens=cu, sinks=sinks)


def rules(cfg: Config) -> dict:
  return dict(layout=cfg.layout, causal=cfg.causal, window=cfg.window, softcap=cfg.softcap,
              mask_mod=MASK_MODS.get(cfg.mask_mod))


def oracle(cfg: Config, batch: dict, k_pages=None, v_pages=None, k_scales=None, v_scales=None):
  num_seqs = cfg.num_seqs if cfg.num_seqs is not None else len(cfg.seqs)
  out, magnitude = reference64.paged_attention(
      batch["q"].astype(np.float64), batch["k_pages"] if k_pages is None else k_pages,
      batch["v_pages"] if v_pages is None else v_pages, batch["page_table"], batch["kv_lens"],
      batch["cu_q_lens"], num_seqs=num_seqs, k_scales=k_scales, v_scales=v_scales, sinks=batch["sinks"],
      **rules(cfg))
  return out, magnitude


def run(impl: str, platform: str | None, cfg: Config, batch: dict, **pages):
  context = fl.interpret_as(platform) if platform else contextlib.nullcontext()
  with context:
    out = fl.paged_attention(
        jnp.asarray(batch["q"]), jnp.asarray(pages.get("k_pages", batch["k_pages"])),
        jnp.asarray(pages.get("v_pages", batch["v_pages"])), page_table=batch["page_table"],
        kv_lens=batch["kv_lens"], cu_q_lens=batch["cu_q_lens"], num_seqs=cfg.num_seqs,
        k_scales=pages.get("k_scales"), v_scales=pages.get("v_scales"),
        sinks=None if batch["sinks"] is None else jnp.asarray(batch["sinks"]), impl=impl, **rules(cfg))
  return np.asarray(out.astype(jnp.float32), np.float64)


def relative_error(out, expected, magnitude) -> float:
  return float((np.abs(out - expected) / (magnitude[..., None] + 1e-6)).max(initial=0.0))


def _refused(case, cfg: Config) -> str | None:
  return next((f for f in cfg.features() if f in REFUSED.get(case, ())), None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}" if c[1] else c[0])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_matches_oracle(case, name):
  cfg = CONFIGS[name]
  batch = make_batch(cfg)
  refused = _refused(case, cfg)
  if refused:
    with pytest.raises(fl.UnsupportedError, match=refused.replace("_", ".")):
      run(*case, cfg, batch)
    return
  expected, magnitude = oracle(cfg, batch)
  out = run(*case, cfg, batch)
  assert relative_error(out, expected, magnitude) <= F32_TOL
  active_rows = int(batch["cu_q_lens"][cfg.num_seqs if cfg.num_seqs is not None else len(cfg.seqs)])
  assert not out[active_rows:].any()  # padding rows are zeros


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}" if c[1] else c[0])
@pytest.mark.parametrize("name", BF16_CONFIGS)
def test_bfloat16_matches_oracle(case, name):
  cfg = CONFIGS[name]
  batch = make_batch(cfg, dtype=np.float32)
  bf16 = {k: (v.astype(jnp.bfloat16) if k in ("q", "k_pages", "v_pages") else v) for k, v in batch.items()}
  as_f32 = {k: (np.asarray(jnp.asarray(v).astype(jnp.float32)) if k in ("q", "k_pages", "v_pages") else v)
            for k, v in bf16.items()}
  expected, magnitude = oracle(cfg, as_f32)
  out = run(*case, cfg, bf16)
  assert relative_error(out, expected, magnitude) <= BF16_TOL


def quantization_bound(batch: dict, cfg: Config, dtype: str, num_seqs: int) -> np.ndarray:
  """docs/contract.md's bound on |out(quantized) - out(float)| per row and head.

  Keys: each element's error is at most e_k = a / 254 (int8; a = the token-head's absmax) or
  |k| / 16 + a / 448 * 2**-10 (e4m3), so a logit moves by at most delta = scale * sum_i |q_i| e_k,i
  and every softmax weight by a factor within exp(+-2 delta): the output moves by at most
  (exp(2 max delta) - 1) max|v|, plus the values' own error (max over keys of e_v).
  """
  q = np.asarray(batch["q"], np.float64)
  kp = paged.to_flax(jnp.asarray(batch["k_pages"]), cfg.layout)
  vp = paged.to_flax(jnp.asarray(batch["v_pages"]), cfg.layout)
  kp, vp = np.asarray(kp, np.float64), np.asarray(vp, np.float64)

  def element_error(x):
    a = np.abs(x).max(-1, keepdims=True)
    return np.broadcast_to(a / 254, x.shape) if dtype == "int8" else np.abs(x) / 16 + a / 448 * 2.0**-10

  ek, ev = element_error(kp), element_error(vp)
  scale = 1 / np.sqrt(cfg.head_dim)
  group = cfg.heads // cfg.kv_heads
  bound = np.zeros(q.shape[:2])
  table, lens, cu = batch["page_table"], batch["kv_lens"], batch["cu_q_lens"]
  for s in range(num_seqs):
    j = np.arange(lens[s])
    keys_err, values = ek[table[s, j // cfg.page_size], j % cfg.page_size], vp[table[s, j // cfg.page_size],
                                                                                 j % cfg.page_size]
    values_err = ev[table[s, j // cfg.page_size], j % cfg.page_size]
    for row in range(cu[s], cu[s + 1]):
      for h in range(cfg.heads):
        delta = scale * (np.abs(q[row, h]) * keys_err[:, h // group]).sum(-1).max(initial=0.0)
        bound[row, h] = ((np.exp(2 * delta) - 1) * np.abs(values[:, h // group]).max(initial=0.0)
                         + values_err[:, h // group].max(initial=0.0))
  return bound


QUANT_CASES = [(case, dtype) for case in CASES for dtype in ("int8", "float8_e4m3fn")]


@pytest.mark.parametrize("case,dtype", QUANT_CASES, ids=lambda x: x if isinstance(x, str) else "-".join(
    str(p) for p in x if p))
@pytest.mark.parametrize("name", ("ragged_gqa", "heads_first"))
def test_quantized_pages(case, dtype, name):
  cfg = dataclasses.replace(CONFIGS[name], page_size=32, pages_per_seq=2)
  batch = make_batch(cfg, seed=1)
  kq, ks = fl.quantize_kv(jnp.asarray(batch["k_pages"]), dtype)
  vq, vs = fl.quantize_kv(jnp.asarray(batch["v_pages"]), dtype)
  pages = dict(k_pages=kq, v_pages=vq, k_scales=ks, v_scales=vs)
  refused = "float8" if dtype != "int8" and "float8" in REFUSED.get(case, ()) else None
  if refused:
    with pytest.raises(fl.UnsupportedError, match=refused):
      run(*case, cfg, batch, **pages)
    return
  out = run(*case, cfg, batch, **pages)
  deq_k, deq_v = (np.asarray(paged.dequantize(x, s)) for x, s in ((kq, ks), (vq, vs)))
  expected, magnitude = oracle(cfg, batch, deq_k, deq_v)
  assert relative_error(out, expected, magnitude) <= F32_TOL  # the impl's own rounding: as float32
  exact, _ = oracle(cfg, batch)
  num_seqs = len(cfg.seqs)
  bound = quantization_bound(batch, cfg, dtype, num_seqs)
  err = np.abs(out - exact).max(-1)
  assert (err <= bound + 1e-5).all(), float((err - bound).max())
  assert err.max() > 0  # the pages really were quantized


def test_quantize_round_trip_error():
  x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 16, 2, 64)), jnp.float32)
  for dtype, per_element in (("int8", lambda a, x: a / 254), ("float8_e4m3fn", lambda a, x: np.abs(x) / 16
                                                                + a / 448 * 2.0**-10)):
    values, scales = fl.quantize_kv(x, dtype)
    assert values.dtype == jnp.dtype(dtype) and scales.shape == x.shape[:-1]
    back = np.asarray(paged.dequantize(values, scales))
    a = np.abs(np.asarray(x)).max(-1, keepdims=True)
    assert (np.abs(back - np.asarray(x)) <= per_element(a, np.asarray(x)) * (1 + 1e-6)).all()


def test_pages_touched_and_explain():
  cfg = Config(seqs=((64, 1), (40, 9), (0, 0), (17, 17)), window=(20, 0), padding_rows=2)
  batch = make_batch(cfg)
  e = fl.explain_paged(jnp.asarray(batch["q"]), jnp.asarray(batch["k_pages"]), jnp.asarray(batch["v_pages"]),
                       page_table=batch["page_table"], kv_lens=batch["kv_lens"], cu_q_lens=batch["cu_q_lens"],
                       window=(20, 0), platform="cpu")
  # seq 0: query 63 sees 43..63 -> pages 2, 3; seq 1: queries 31..39 see 11..39 -> pages 0, 1, 2;
  # seq 3: queries 0..16 see 0..16 -> pages 0, 1.
  assert (e.pages_touched, e.pages_in_tables) == (7, 4 + 3 + 0 + 2)
  assert e.impl == "xla_chunked" and "pages touched 7 of 9" in str(e)
  tpu = fl.explain_paged(jnp.asarray(batch["q"]), jnp.asarray(batch["k_pages"]),
                         jnp.asarray(batch["v_pages"]), page_table=batch["page_table"],
                         kv_lens=batch["kv_lens"], cu_q_lens=batch["cu_q_lens"], window=(20, 0),
                         platform="tpu")
  assert tpu.impl == "flash_pallas" and "pallas-tpu paged" in tpu.kernel


@pytest.mark.parametrize("impl", ["xla_native", "xla_dense", "jax_splash"])
def test_impls_without_a_paged_path_refuse_by_name(impl):
  batch = make_batch(Config(seqs=((3, 1),)))
  with pytest.raises(fl.UnsupportedError, match=f"{impl}.*does not serve paged attention"):
    fl.paged_attention(batch["q"], batch["k_pages"], batch["v_pages"], page_table=batch["page_table"],
                       kv_lens=batch["kv_lens"], cu_q_lens=batch["cu_q_lens"], impl=impl)


@pytest.mark.parametrize("change,match", [
    (dict(kv_lens=np.array([0], np.int32)), "kv_lens.*less than sequence 0's 1 new tokens"),
    (dict(kv_lens=np.array([99], np.int32)), "kv_lens must be in \\[0, pages_per_seq"),
    (dict(cu_q_lens=np.array([0, 9], np.int32)), "cu_q_lens must start at 0"),
    (dict(page_table=np.full((1, 4), 99, np.int32)), "page_table\\[0\\] names pages outside"),
    (dict(cu_q_lens=np.array([0, 1, 2], np.int32)), "cu_q_lens must be int \\[2\\]"),
    (dict(layout="rows"), "layout must be one of"),
    (dict(impl="fast"), "impl must be one of"),
    (dict(k_scales=np.ones((15, 16, 2), np.float32)), "k_scales is for quantized pages"),
    (dict(num_seqs=2), "num_seqs must be in \\[0, 1\\]"),
])
def test_bad_arguments_are_named(change, match):
  batch = make_batch(Config(seqs=((3, 1),)))
  args = dict(page_table=batch["page_table"], kv_lens=batch["kv_lens"], cu_q_lens=batch["cu_q_lens"])
  args.update(change)
  with pytest.raises((ValueError, TypeError), match=match):
    fl.paged_attention(batch["q"], batch["k_pages"], batch["v_pages"], **args)


def test_int8_pages_without_scales_are_refused():
  batch = make_batch(Config(seqs=((3, 1),)))
  kq, _ = fl.quantize_kv(jnp.asarray(batch["k_pages"]))
  with pytest.raises(ValueError, match="int8 pages need k_scales"):
    fl.paged_attention(batch["q"], kq, kq, page_table=batch["page_table"], kv_lens=batch["kv_lens"],
                       cu_q_lens=batch["cu_q_lens"])


def test_traced_batch_compiles_once():
  """A serving loop's changing lengths are traced values: one compile serves every step."""
  import jax
  cfg = Config(seqs=((5, 1), (9, 3)), padding_rows=4)
  batch = make_batch(cfg)
  traces = []

  @jax.jit
  def step(q, kv_lens, cu, num_seqs):
    traces.append(1)
    return fl.paged_attention(q, jnp.asarray(batch["k_pages"]), jnp.asarray(batch["v_pages"]),
                              page_table=batch["page_table"], kv_lens=kv_lens, cu_q_lens=cu,
                              num_seqs=num_seqs)

  for lens, cu, n in (((5, 9), (0, 1, 4), 2), ((6, 10), (0, 1, 2), 2), ((7, 0), (0, 1, 1), 1)):
    lens, cu = np.array(lens, np.int32), np.array(cu, np.int32)
    out = np.asarray(step(jnp.asarray(batch["q"]), lens, cu, n))
    expected, _ = reference64.paged_attention(batch["q"], batch["k_pages"], batch["v_pages"],
                                              batch["page_table"], lens, cu, num_seqs=n)
    np.testing.assert_allclose(out, expected, atol=2e-5)
  assert len(traces) == 1


@pytest.mark.parametrize("name", ["ragged_gqa", "mqa_window_softcap", "non_causal"])
def test_xla_chunked_walks_pages_chunk_by_chunk(name, monkeypatch):
  """One page per loop step: the while_loop's bounds and the online softmax across chunks."""
  from flash_layers.impls.paged import xla_chunked
  monkeypatch.setattr(xla_chunked, "CHUNK_KEYS", 16)
  cfg = CONFIGS[name]
  batch = make_batch(cfg, seed=2)
  expected, magnitude = oracle(cfg, batch)
  assert relative_error(run("xla_chunked", None, cfg, batch), expected, magnitude) <= F32_TOL
