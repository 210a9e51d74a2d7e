"""The GPU (Triton) paged-attention kernel, `flash_pallas/gpu_paged.py`.

Run in Pallas interpret mode (`fl.interpret_as("gpu")`) through `fl.paged_attention(impl="flash_pallas")`
against the float64 oracle (`reference64.paged_attention`), and lowered to Triton for CUDA on this CPU
host (as tests/test_gpu_lowering.py).

Errors are measured as tests/test_conformance.py measures them: per output row, the worst
|kernel - oracle| over head_dim_v divided by the oracle's magnitude of that row (the size of the terms
summed, p . max|v|), so a row that cancels to ~0 is not judged relative to ~0. Limits: float32 within
`F32_TOL`; bfloat16 within twice the error of the `reference` impl run in bfloat16 on the same inputs
plus `BF16_FLOOR` (test_conformance's rule); quantized pages within `F32_TOL` of the oracle on the
dequantized pages, and within `quantization_bound` (derived in its docstring) of the oracle on the
float pages they were made from.

The batches are ragged (sequences of 0, 1 and a page's worth of keys, a full table, prefill chunks
beside decoding tokens), their page tables shuffled, and they carry padding: rows past
cu_q_lens[num_seqs], sequences past num_seqs with junk lengths, table entries past a sequence's last
page pointing outside the pool. In the float32 batches every pool slot no visible key lives in is NaN
(pages no active sequence holds, slots past a sequence's length in its last page), so a kernel that
read one would show it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_gpu_lowering as gpu_lowering

import flash_layers as fl
from flash_layers import lowering
from flash_layers.contract import paged
from flash_layers.impls import UnsupportedError
from flash_layers.impls.flash_pallas import gpu_paged
from flash_layers.impls.paged import PAGED_REGISTRY
from flash_layers.testing import reference64

F32_TOL = 1e-5
BF16_FLOOR = 2e-3
PAGE = 16


def make_batch(seed, q_lens, kv_lens, *, heads=8, kv_heads=2, d=32, dv=None, page_size=PAGE, pages_per_seq=4,
               inactive=1, inactive_rows=2, pad_rows=3, spare_pages=3, dtype=np.float32, poison=True):
  """A ragged batch: `q_lens` / `kv_lens` of the active sequences, `inactive` junk sequences after them
  (num_seqs < max_seqs) claiming `inactive_rows` rows each, `pad_rows` more rows of q past them (all
  past cu_q_lens[num_seqs]: padding), the sequences' pages shuffled over the pool."""
  rng = np.random.default_rng(seed)
  n, max_seqs = len(q_lens), len(q_lens) + inactive
  dv = dv or d
  ends = np.cumsum(q_lens)
  cu = np.concatenate([[0], ends, ends[-1] + inactive_rows * np.arange(1, inactive + 1)])
  tokens = int(cu[-1]) + pad_rows
  lens = np.concatenate([kv_lens, np.full(inactive, 7)]).astype(np.int32)
  held = [-(-int(x) // page_size) for x in kv_lens]
  num_pages = sum(held) + spare_pages
  order = rng.permutation(num_pages)
  table = np.full((max_seqs, pages_per_seq), -1, np.int32)  # past a sequence's pages: never read
  table[n:] = num_pages + 5
  for s, count in enumerate(held):
    table[s, :count], order = order[:count], order[count:]
  k = rng.standard_normal((num_pages, page_size, kv_heads, d))
  v = rng.standard_normal((num_pages, page_size, kv_heads, dv))
  if poison:  # every slot that holds no key of an active sequence
    real = np.zeros((num_pages, page_size), bool)
    for s in range(n):
      j = np.arange(kv_lens[s])
      real[table[s, j // page_size], j % page_size] = True
    k[~real], v[~real] = np.nan, np.nan
  return dict(q=rng.standard_normal((tokens, heads, d)).astype(dtype), k_pages=k.astype(dtype),
              v_pages=v.astype(dtype), page_table=table, kv_lens=lens, cu_q_lens=cu.astype(np.int32),
              num_seqs=n)


def attend(batch, impl="flash_pallas", **kwargs):
  """fl.paged_attention on `batch`, the GPU family interpreted; float64 NumPy."""
  with fl.interpret_as("gpu"):
    out = fl.paged_attention(batch["q"], batch["k_pages"], batch["v_pages"], impl=impl,
                             **{k: batch[k] for k in ("page_table", "kv_lens", "cu_q_lens", "num_seqs")},
                             **kwargs)
  return np.asarray(out.astype(jnp.float32), np.float64)


def oracle(batch, **kwargs):
  """(out, magnitude) of the float64 oracle on `batch`."""
  return reference64.paged_attention(
      batch["q"].astype(np.float32), batch["k_pages"], batch["v_pages"], batch["page_table"],
      batch["kv_lens"], batch["cu_q_lens"], num_seqs=batch["num_seqs"], **kwargs)


def row_errors(out, expected, magnitude):
  """Per (row, head): the worst error over head_dim_v relative to the oracle's magnitude (0 where the
  row sees nothing and the kernel gives 0)."""
  assert np.all(np.isfinite(out)), "non-finite outputs"
  return np.abs(out - expected).max(-1) / np.maximum(magnitude, 1e-30)


def check_padding(batch, out):
  """Rows past cu_q_lens[num_seqs] are zeros."""
  assert np.all(out[batch["cu_q_lens"][batch["num_seqs"]]:] == 0)


# (q_lens, kv_lens) of the active sequences. Key counts 0, 1, a page (16), a full table (4 pages: 64);
# prefill chunks (20, 16, 5 new tokens) beside decoding tokens (q_len 1) and empty ones.
RAGGED = ([5, 1, 0, 20, 1, 16, 0], [37, 1, 0, 64, 16, 16, 9])
# A decoding step: at most one token per sequence and no more rows than sequences (16-row tiles).
DECODE = dict(q_lens=[1, 1, 1, 0, 1, 1], kv_lens=[37, 1, 64, 5, 16, 17], inactive_rows=0, pad_rows=1)

CASES = {
    # name: (make_batch arguments, paged_attention arguments)
    "gqa4_causal": (dict(heads=8, kv_heads=2), dict()),
    "gqa8_decode": (dict(heads=16, kv_heads=2, **DECODE), dict()),
    "mqa_window_heads_first": (dict(heads=4, kv_heads=1), dict(window=(9, 0), layout="heads_first")),
    "gqa4_window_not_causal": (dict(heads=8, kv_heads=2), dict(window=(6, 3), causal=False)),
    # head_dim_v != head_dim, neither a power of two; pages of 12 tokens (no block of keys is one page)
    # and a GQA group of 3 (63-row tiles, padded to 64)
    "softcap_d48_dv24_page12_group3": (dict(heads=6, kv_heads=2, d=48, dv=24, page_size=12, pages_per_seq=6),
                                       dict(softcap=5.0, scale=0.3)),
    # rows that see nothing (zeros out, -inf lse); every block masked
    "mask_mod": (dict(heads=8, kv_heads=2), dict(mask_mod=lambda b, h, q, k: (q + k + h + b) % 4 != 0)),
}


def _heads_first(batch):
  return {**batch, "k_pages": np.moveaxis(batch["k_pages"], 2, 0),
          "v_pages": np.moveaxis(batch["v_pages"], 2, 0)}


@pytest.mark.parametrize("name", CASES)
def test_ragged_batches_match_the_oracle_in_float32(name):
  shape, kwargs = CASES[name]
  batch = make_batch(0, **{"q_lens": RAGGED[0], "kv_lens": RAGGED[1], **shape})
  if kwargs.get("layout") == "heads_first":
    batch = _heads_first(batch)
  out = attend(batch, **kwargs)
  expected, magnitude = oracle(batch, **kwargs)
  errors = row_errors(out, expected, magnitude)
  assert errors.max() <= F32_TOL, (name, errors.max())
  check_padding(batch, out)
  if "mask_mod" in kwargs:  # some rows see no key at all: the kernel gives them zeros, as the oracle
    assert np.any(magnitude[: batch["cu_q_lens"][batch["num_seqs"]]] == 0)


def test_sinks_merge_with_the_kernel_lse():
  """Sinks join the softmax through the kernel's lse (fl.paged_attention merges them): a wrong lse
  would show in every row."""
  batch = make_batch(1, *RAGGED)
  sinks = np.linspace(-1.0, 2.0, 8).astype(np.float32)
  out = attend(batch, sinks=sinks, window=(20, 0))
  expected, magnitude = oracle(batch, sinks=sinks, window=(20, 0))
  assert row_errors(out, expected, magnitude).max() <= F32_TOL
  check_padding(batch, out)


def test_out_and_lse_against_the_reference_impl_and_no_retrace():
  """The kernel's (out, lse) beside the reference impl's, padding rows 0 and -inf; one jitted function
  serves two batches of the same shapes (the plan is built from traced arrays)."""
  traces = []

  def run(impl):
    def f(q, k, v, table, lens, cu, n):
      traces.append(impl)
      spec = paged.check(q, k, v, page_table=table, kv_lens=lens, cu_q_lens=cu, num_seqs=n, k_scales=None,
                         v_scales=None, sinks=None, layout="flax", causal=True, window=None, softcap=None,
                         scale=None, mask_mod=None)
      arrays = dict(page_table=table, kv_lens=lens, cu_q_lens=cu, num_seqs=n, k_scales=None, v_scales=None)
      return PAGED_REGISTRY[impl].attend(q, k, v, spec=spec, arrays=arrays)
    return jax.jit(f)

  kernel, reference = run("flash_pallas"), run("reference")
  # Two batches of the same shapes (48 rows of q, 14 pages), different lengths and tables.
  second = dict(q_lens=[3, 1, 1, 2, 14, 1, 1], kv_lens=[3, 40, 2, 64, 30, 1, 17], pad_rows=23, spare_pages=0)
  for seed, shape in enumerate([dict(q_lens=RAGGED[0], kv_lens=RAGGED[1]), second]):
    batch = make_batch(seed, **shape, poison=False)
    args = [batch[k] for k in ("q", "k_pages", "v_pages", "page_table", "kv_lens", "cu_q_lens")]
    with fl.interpret_as("gpu"):
      out, lse = kernel(*args, np.int32(batch["num_seqs"]))
    ref_out, ref_lse = reference(*args, np.int32(batch["num_seqs"]))
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(np.where(np.isfinite(lse), lse, 0), np.where(np.isfinite(ref_lse), ref_lse, 0),
                               atol=1e-5)
    pad = batch["cu_q_lens"][batch["num_seqs"]]
    assert np.all(np.asarray(out)[pad:] == 0) and np.all(np.isneginf(np.asarray(lse)[pad:]))
  assert traces.count("flash_pallas") == 1


def test_bfloat16_within_twice_the_reference_impl_error():
  batch = make_batch(2, *RAGGED, dtype=jnp.bfloat16, poison=False)
  kwargs = dict(softcap=20.0)
  expected, magnitude = oracle(batch, **kwargs)
  kernel = row_errors(attend(batch, **kwargs), expected, magnitude).max()
  reference = row_errors(attend(batch, impl="reference", **kwargs), expected, magnitude).max()
  assert kernel <= 2 * reference + BF16_FLOOR, (kernel, reference)


def quantization_bound(batch, k_float, kind: str, scale: float):
  """Per (row, head): a bound on |out(quantized pages) - out(float pages)| / magnitude(float pages).

  `paged.quantize` rounds each key and value element with error at most eps * absmax of its token-head
  (int8: eps = 1/254, half a step of absmax / 127), or, for e4m3, |x| / 16 (3 mantissa bits) plus
  absmax / 448 * 2**-10 below its normal range: at most eps * absmax with eps = 1/16 + 2**-10 / 448.
  Keys: each logit moves by at most delta = scale * max_j sum_d |q_d| err(k_jd) (err: the element bound
  above; the softcap only shrinks differences), so each probability by a factor within
  [exp(-2 delta), exp(2 delta)] (sinks, unmoved, only help): |p'_j - p_j| <= (exp(2 delta) - 1) p_j.
  Values: |v'_jd - v_jd| <= eps * absmax_j. So for every output element
  |sum_j p'_j v'_jd - sum_j p_j v_jd| <= (exp(2 delta) - 1) M + exp(2 delta) eps M, where
  M = sum_j p_j absmax_j is the oracle's magnitude of the row: relative to it the bound is
  exp(2 delta) (1 + eps) - 1. delta takes the max over all of the sequence's keys (a superset of the
  visible ones).
  """
  eps = 1 / 254 if kind == "int8" else 1 / 16 + 2.0**-10 / 448
  q, table, lens, cu = (batch[k] for k in ("q", "page_table", "kv_lens", "cu_q_lens"))
  page_size, kvh = k_float.shape[1], k_float.shape[2]
  group = q.shape[1] // kvh
  bound = np.zeros(q.shape[:2])
  for s in range(batch["num_seqs"]):
    j = np.arange(lens[s])
    keys = np.asarray(k_float, np.float64)[table[s, j // page_size], j % page_size]  # [len, kvh, d]
    absmax = np.abs(keys).max(-1, keepdims=True)
    err = np.broadcast_to(absmax / 254, keys.shape) if kind == "int8" else \
        np.abs(keys) / 16 + absmax / 448 * 2.0**-10
    rows = np.abs(q[cu[s]:cu[s + 1]].astype(np.float64)).reshape(-1, kvh, group, q.shape[-1])
    if len(j) and len(rows):
      delta = scale * np.einsum("jkd,rkgd->rkgj", err, rows).max(-1).reshape(len(rows), -1)
      bound[cu[s]:cu[s + 1]] = np.exp(2 * delta) * (1 + eps) - 1
  return bound


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", paged.QUANTIZED_DTYPES)
def test_quantized_pages(kind, q_dtype):
  """int8 / e4m3 pages with per token-head scales (`fl.quantize_kv`): the kernel equals the oracle on the
  dequantized pages (float32 q: float32 rounding only; bfloat16 q, whose kernel multiplies in bfloat16:
  the bfloat16 rule against the reference impl), and is within `quantization_bound` of the output of
  the float pages they were made from."""
  batch = make_batch(3, *RAGGED, poison=False, dtype=np.float32)
  batch["q"] = batch["q"].astype(q_dtype)
  k_float, v_float = batch["k_pages"], batch["v_pages"]
  (kq, ks), (vq, vs) = fl.quantize_kv(k_float, kind), fl.quantize_kv(v_float, kind)
  quantized = {**batch, "k_pages": kq, "v_pages": vq}
  out = attend(quantized, k_scales=ks, v_scales=vs)
  dequantized, magnitude = oracle(quantized, k_scales=np.asarray(ks), v_scales=np.asarray(vs))
  error = row_errors(out, dequantized, magnitude).max()
  tol = F32_TOL
  if q_dtype == "bfloat16":
    reference = attend(quantized, impl="reference", k_scales=ks, v_scales=vs)
    tol = 2 * row_errors(reference, dequantized, magnitude).max() + BF16_FLOOR
  assert error <= tol, (error, tol)
  check_padding(batch, out)
  expected, magnitude = oracle(batch)
  errors = row_errors(out, expected, magnitude)
  bound = quantization_bound(batch, k_float, kind, scale=1 / np.sqrt(batch["q"].shape[-1]))
  assert np.all(errors <= bound + tol), (errors.max(), (errors / np.maximum(bound, 1e-30)).max())


def test_unsupported_features_are_named():
  spec = dict(num_tokens=4, max_seqs=2, num_heads=4, num_kv_heads=2, head_dim=32, head_dim_v=32, num_pages=8,
              page_size=PAGE, pages_per_seq=4, layout="flax", dtype="float32", kv_dtype="float32")
  refusal = lambda **change: gpu_paged.unsupported(paged.PagedSpec(**{**spec, **change}))  # noqa: E731
  assert refusal() is None
  assert "head_dim 512" in refusal(head_dim=512)
  assert "page dtype float8_e5m2" in refusal(kv_dtype="float8_e5m2")
  assert "query heads per kv head" in refusal(num_heads=512, num_kv_heads=2)
  batch = make_batch(0, [1, 2], [3, 4], d=512, poison=False)
  with fl.interpret_as("gpu"), pytest.raises(UnsupportedError, match="head_dim 512"):
    fl.paged_attention(batch["q"], batch["k_pages"], batch["v_pages"], impl="flash_pallas",
                       **{k: batch[k] for k in ("page_table", "kv_lens", "cu_q_lens", "num_seqs")})


def test_explain_names_the_triton_kernel_and_its_programs():
  batch = make_batch(0, *RAGGED, poison=False)
  explained = fl.explain_paged(batch["q"], batch["k_pages"], batch["v_pages"], impl="flash_pallas",
                               platform="cuda", **{k: batch[k] for k in ("page_table", "kv_lens", "cu_q_lens",
                                                                         "num_seqs")})
  assert explained.kernel == "pallas-gpu paged (Triton)"  # the pool is read as given: no transpose
  # The tiles holding tokens, per kv head: 16 tokens a tile at GQA 4:1 (64 rows), so the 20-token chunk
  # takes two and the other four sequences with new tokens one each.
  assert explained.grid_points == (1 + 1 + 2 + 1 + 1) * 2


# ----------------------------------------------------------------------------
# Lowered to Triton for CUDA, on this CPU host
# ----------------------------------------------------------------------------



def _lower_for_cuda(q_dtype, kv_dtype, *, tokens=48, heads=16, kvh=4, d=128, dv=None, page_size=PAGE,
                    pages=64, max_seqs=6, **kwargs) -> str:
  """The text of a paged call on these shapes lowered for CUDA (batch arrays traced).
  `lowered_only_for("cuda")` traces the CUDA branch alone: the TPU family's module is not needed."""
  if not gpu_lowering._can_lower_triton_for_cuda():
    pytest.skip("this jaxlib lowers Triton for CUDA only with its CUDA plugin")
  specs = [jax.ShapeDtypeStruct((tokens, heads, d), q_dtype),
           jax.ShapeDtypeStruct((pages, page_size, kvh, d), kv_dtype),
           jax.ShapeDtypeStruct((pages, page_size, kvh, dv or d), kv_dtype),
           jax.ShapeDtypeStruct((max_seqs, 8), jnp.int32), jax.ShapeDtypeStruct((max_seqs,), jnp.int32),
           jax.ShapeDtypeStruct((max_seqs + 1,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)]
  if kv_dtype in paged.QUANTIZED_DTYPES:
    specs += [jax.ShapeDtypeStruct((pages, page_size, kvh), jnp.float32)] * 2

  def f(q, k, v, table, lens, cu, n, *scales):
    quant = dict(zip(("k_scales", "v_scales"), scales, strict=False))
    return fl.paged_attention(q, k, v, page_table=table, kv_lens=lens, cu_q_lens=cu, num_seqs=n,
                              impl="flash_pallas", **kwargs, **quant)

  with lowering.lowered_only_for("cuda"):
    text = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert len(gpu_lowering.TRITON_CALL.findall(text)) == 1
  assert gpu_lowering.KERNEL_NAME.findall(text) == ["flash_pallas_gpu_paged"]
  return text


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [("float32", "float32"), ("bfloat16", "bfloat16"),
                                                   ("bfloat16", "int8"), ("bfloat16", "float8_e4m3fn"),
                                                   ("float32", "int8"), ("float32", "float8_e4m3fn")])
def test_lowers_to_our_triton_kernel(q_dtype, kv_dtype):
  """f32, bf16, int8 and e4m3 pages through Pallas Triton: GQA 4:1 in 64-row tiles, head_dim 128, a
  window and a softcap. A bfloat16 q tile and accumulator fit 4 warps; float32's take 8 (`num_warps`)."""
  text = _lower_for_cuda(q_dtype, kv_dtype, window=(100, 0), softcap=30.0)
  assert gpu_lowering.NUM_WARPS.findall(text) == [{"float32": "8", "bfloat16": "4"}[q_dtype]]


# name: (shapes and paged_attention arguments, warps)
OTHER_SHAPES = {
    "d48_dv24_page12_group3": (dict(heads=6, kvh=2, d=48, dv=24, page_size=12, softcap=5.0), 4),
    "decode_gqa8": (dict(tokens=6, heads=32, kvh=4), 4),
    "d256_mqa_not_causal_window": (dict(heads=8, kvh=1, d=256, causal=False, window=(5, 7)), 8),
    "mask_mod": (dict(d=64, mask_mod=lambda b, h, q, k: (q - k + b + h) % 4 != 3), 4),
}


@pytest.mark.parametrize("name", OTHER_SHAPES)
def test_other_shapes_and_a_mask_mod_lower_too(name):
  """Head dims and pages of no power of two, a GQA group of 3, a decoding batch (16-row tiles), 256-wide
  heads (8 warps), a mask_mod traced into the kernel."""
  kwargs, warps = OTHER_SHAPES[name]
  text = _lower_for_cuda("bfloat16", "bfloat16", **kwargs)
  assert gpu_lowering.NUM_WARPS.findall(text) == [str(warps)]
