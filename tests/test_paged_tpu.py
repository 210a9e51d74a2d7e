"""The TPU (Mosaic) paged-attention kernel (flash_layers/impls/flash_pallas/tpu_paged.py).

Interpreted (`fl.interpret_as("tpu")`, through `fl.paged_attention(impl="flash_pallas")`) against the
float64 oracle `reference64.paged_attention`, on one ragged batch that holds every shape a serving step
has: a prefill chunk at the start of a prompt, decoding tokens at lengths 1, exactly two pages and three
pages + 1, an empty sequence, a 9-token chunk at the end of a full page table, and padding (q rows past
the active sequences, page_table rows of inactive sequences). The page table is shuffled; its entries
past a sequence's last page name pages outside the pool, and the pool's unused pages and the tails of
last pages hold NaN (scales of int8 pages likewise): none may be read into the result.

Errors are relative to the oracle's magnitude (the largest p.|v| of a row), as tests/test_conformance.py
measures them: float32 (and int8 pages against the oracle on the dequantized pages) within F32_TOL;
bfloat16 within twice the error of the `reference` impl in bfloat16 plus BF16_FLOOR.

Also: the strict interpreter (two cores, random order of the kv heads, eager DMAs, the race detector)
on the kernel's hand-made double buffering; the grid points the interpreter's recorder sees against
`grid_points` and an independent NumPy count; the refusals; and AOT compiles for v5e, v5p and v6e.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import flash_layers as fl  # noqa: E402
from flash_layers import lowering  # noqa: E402
from flash_layers.contract import paged  # noqa: E402
from flash_layers.impls.flash_pallas import paged_plan, tpu_paged  # noqa: E402
from flash_layers.testing import reference64, strict  # noqa: E402

F32_TOL = 1e-5
BF16_FLOOR = 2e-3
MAX_KV = 320  # keys a full page table holds (pages_per_seq * page_size)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 64
  head_dim_v: int | None = None
  dtype: str = "float32"
  int8: bool = False  # pages quantized by fl.quantize_kv
  page_size: int = 8
  causal: bool = True
  window: tuple[int, int] | None = None
  softcap: float | None = None
  sinks: bool = False
  layout: str = "heads_first"

  @property
  def dv(self) -> int:
    return self.head_dim if self.head_dim_v is None else self.head_dim_v

  @property
  def rules(self) -> dict:
    return {"causal": self.causal, "window": self.window, "softcap": self.softcap, "layout": self.layout}


CASES = [
    Case("f32_gqa4_causal", heads=8, kv_heads=2),
    Case("f32_mqa_window_softcap_sinks_flax_layout", heads=4, kv_heads=1, window=(20, 0), softcap=2.0,
         sinks=True, layout="flax"),
    Case("f32_bidirectional_window_dv32_page16", head_dim_v=32, causal=False, window=(24, 6), page_size=16),
    Case("bf16_gqa4_window_d128_page16", heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", window=(40, 0),
         page_size=16),
    Case("int8_f32_gqa", int8=True, page_size=32),
    Case("int8_bf16_mqa_softcap_sinks", heads=4, kv_heads=1, dtype="bfloat16", int8=True, page_size=32,
         softcap=3.0, sinks=True),
]


# (q_len, kv_len) of the active sequences (page_size ps): a prompt's first chunk, a decoding token at
# exactly two pages, an empty sequence, one of length 1, a chunk ending a full table, a token at 3 pages + 1.
def batch_lengths(ps: int) -> tuple[list[int], list[int]]:
  return [13, 1, 0, 1, 9, 1], [13, 2 * ps, 0, 1, MAX_KV, 3 * ps + 1]


MAX_SEQS = 8  # two inactive page_table rows
PADDING = 5   # q rows past the active tokens


@dataclasses.dataclass
class Batch:
  q: np.ndarray
  k: np.ndarray        # pages in the case's layout (int8 when quantized), NaN where unused
  v: np.ndarray
  k_scales: np.ndarray | None
  v_scales: np.ndarray | None
  clean: tuple         # (k, v, k_scales, v_scales) with zeros where unused: for the XLA reference
  table: np.ndarray
  kv_lens: np.ndarray
  cu: np.ndarray
  num_seqs: int
  sinks: np.ndarray | None

  def kwargs(self, case: Case, clean: bool = False) -> dict:
    k, v, ks, vs = self.clean if clean else (self.k, self.v, self.k_scales, self.v_scales)
    ks, vs = (None if x is None else jnp.asarray(x) for x in (ks, vs))
    return dict(q=jnp.asarray(self.q, case.dtype), k_pages=jnp.asarray(k), v_pages=jnp.asarray(v),
                k_scales=ks, v_scales=vs, page_table=self.table, kv_lens=self.kv_lens, cu_q_lens=self.cu,
                num_seqs=self.num_seqs,
                sinks=None if self.sinks is None else jnp.asarray(self.sinks), **case.rules)


def _unused(table, kv_lens, num_seqs, num_pages, ps):
  """bool [num_pages, ps]: the pool slots no active sequence holds a key in."""
  unused = np.ones((num_pages, ps), bool)
  for s in range(num_seqs):
    j = np.arange(kv_lens[s])
    unused[table[s, j // ps], j % ps] = False
  return unused


@functools.cache
def make_batch(case: Case, seed: int = 0) -> Batch:
  rng = np.random.default_rng(seed)
  ps = case.page_size
  pps = MAX_KV // ps
  q_lens, kv_lens = batch_lengths(ps)
  num_seqs = len(q_lens)
  num_pages = MAX_SEQS * pps + 3
  table = rng.permutation(num_pages)[: MAX_SEQS * pps].reshape(MAX_SEQS, pps).astype(np.int32)
  for s, n in enumerate(kv_lens):  # entries past a sequence's last page: outside the pool
    table[s, -(-n // ps):] = num_pages + 7
  kv_lens = np.array(kv_lens + [5, 3], np.int32)  # the inactive rows' lengths are junk too
  cu = np.concatenate([[0], np.cumsum(q_lens + [2, 2])]).astype(np.int32)
  tokens = int(cu[num_seqs]) + PADDING

  def rounded(shape):  # values the impl sees exactly (rounded to the case's dtype)
    x = rng.standard_normal(shape).astype(np.float32)
    return np.asarray(jnp.asarray(x, case.dtype).astype(jnp.float32))

  q = rounded((tokens, case.heads, case.head_dim))
  unused = _unused(table, kv_lens, num_seqs, num_pages, ps)[:, :, None, None]
  shapes = ((num_pages, ps, case.kv_heads, case.head_dim), (num_pages, ps, case.kv_heads, case.dv))
  k, v = (np.where(unused, np.float32(0), rounded(shape)) for shape in shapes)
  if case.int8:  # int8 has no NaN: the scales of unused slots carry it
    (k, ks), (v, vs) = (tuple(np.asarray(a) for a in fl.quantize_kv(jnp.asarray(x))) for x in (k, v))
    clean = [k, v, ks, vs]
    dirty = [k, v, *(np.where(unused[..., 0], np.nan, x).astype(np.float32) for x in (ks, vs))]
  else:
    clean = [np.asarray(jnp.asarray(x, case.dtype)) for x in (k, v)] + [None, None]
    dirty = [np.asarray(jnp.asarray(np.where(unused, np.nan, x), case.dtype)) for x in (k, v)] + [None, None]
  if case.layout == "heads_first":
    dirty, clean = ([None if x is None else np.moveaxis(x, 2, 0) for x in xs] for xs in (dirty, clean))
  sinks = rng.standard_normal(case.heads).astype(np.float32) + 1.0 if case.sinks else None
  return Batch(q, *dirty, tuple(clean), table, kv_lens, cu, num_seqs, sinks)


def _float(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def oracle(case: Case, batch: Batch):
  k, v, ks, vs = batch.clean
  return reference64.paged_attention(
      batch.q, _float(k), _float(v), batch.table, batch.kv_lens, batch.cu, num_seqs=batch.num_seqs,
      layout=case.layout, k_scales=ks, v_scales=vs, causal=case.causal, window=case.window,
      softcap=case.softcap, sinks=batch.sinks)


def relative_error(out, expected, magnitude) -> float:
  out = _float(out)
  assert np.all(np.isfinite(out)), "non-finite output"
  return float(np.abs(out - expected).max() / magnitude.max())


def run_kernel(case: Case, batch: Batch, params=None):
  with fl.interpret_as("tpu", params=params):
    return np.asarray(fl.paged_attention(impl="flash_pallas", **batch.kwargs(case)).astype(jnp.float32))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_the_float64_oracle(case, record_property):
  batch = make_batch(case)
  expected, magnitude = oracle(case, batch)
  out = run_kernel(case, batch)
  error = relative_error(out, expected, magnitude)
  limit = F32_TOL
  if case.dtype == "bfloat16":
    ref = fl.paged_attention(impl="reference", **batch.kwargs(case, clean=True))
    limit = 2 * relative_error(ref, expected, magnitude) + BF16_FLOOR
  record_property("relative_error", error)
  print(f"{case.name}: relative error {error:.2e} (limit {limit:.2e})")
  assert error <= limit, (error, limit)
  padding = np.arange(out.shape[0]) >= batch.cu[batch.num_seqs]
  assert padding.sum() == PADDING and np.all(out[padding] == 0)
  assert np.all(out[batch.cu[2]:batch.cu[3]] == 0)  # the empty sequence owns no rows


def test_a_jitted_step_takes_new_batches_without_retracing():
  """The plan is built from traced arrays: a second batch (other lengths, fewer sequences) runs the same
  compiled program."""
  case = CASES[0]
  first = make_batch(case)
  traces = []

  @jax.jit
  def step(q, k, v, table, lens, cu, n):
    traces.append(1)
    return fl.paged_attention(q, k, v, page_table=table, kv_lens=lens, cu_q_lens=cu, num_seqs=n,
                              impl="flash_pallas", **case.rules)

  lens = first.kv_lens.copy()
  lens[[0, 3]] = [40, 70]  # longer sequences, the same new tokens; then only 4 sequences active
  for kv_lens, n in ((first.kv_lens, first.num_seqs), (lens, 4)):
    table = first.table.copy()
    table[3, :9] = table[0, :9] = np.arange(9)  # pages of the clean pool's first rows
    second = dataclasses.replace(first, kv_lens=kv_lens, num_seqs=n, table=table)
    with fl.interpret_as("tpu"):
      out = step(jnp.asarray(first.q), *(jnp.asarray(x) for x in first.clean[:2]), table, kv_lens,
                 first.cu, jnp.int32(n))
    expected, magnitude = oracle(case, second)
    assert relative_error(out, expected, magnitude) <= F32_TOL
  assert len(traces) == 1


def test_the_cpu_lowering_runs_the_plain_interpreter():
  """Without interpret_as, a CPU lowering runs the kernel in Pallas' plain interpreter (no TPU-semantics
  callbacks), as the dispatcher's CPU branch does."""
  case = CASES[4]  # int8 pages: four DMA streams
  batch = make_batch(case)
  expected, magnitude = oracle(case, batch)
  with lowering.lowered_only_for("cpu"):
    out = fl.paged_attention(impl="flash_pallas", **batch.kwargs(case))
  assert relative_error(out, expected, magnitude) <= F32_TOL


# ----------------------------------------------------------------------------
# The strict interpreter: the hand-made double buffering across two cores
# ----------------------------------------------------------------------------

# (case, KEYS_PER_STEP): int8 pages and their scales (four DMA streams), GQA, up to two chunks of 8 pages per
# tile; float32 GQA with a window, two pages per step (up to 3 chunks per tile, the window skipping pages).
STRICT_CASES = [
    (Case("strict_int8_gqa_causal", heads=8, kv_heads=2, int8=True, page_size=32), tpu_paged.KEYS_PER_STEP),
    (Case("strict_f32_gqa_window", heads=8, kv_heads=2, window=(28, 0)), 16),
]


@pytest.mark.strict
@pytest.mark.parametrize("case, keys_per_step", STRICT_CASES, ids=[c.name for c, _ in STRICT_CASES])
def test_the_kernel_is_race_free_under_the_strict_interpreter(case, keys_per_step, monkeypatch):
  """Two simulated cores taking the kv heads in a random order (3 seeds), DMAs done when issued, the race
  detector on: the prefetch of step t + 1 into the other slot while step t computes is race-free."""
  monkeypatch.setattr(tpu_paged, "KEYS_PER_STEP", keys_per_step)
  batch = make_batch(case)
  spec, arrays = _spec(case, batch)
  call = tpu_paged.make_call(spec, interpret=True)
  _, plan = tpu_paged.plan(call, *(jnp.asarray(arrays[n]) for n in ("cu_q_lens", "kv_lens", "num_seqs")))
  chunks = np.bincount(np.asarray(plan.steps).reshape(-1, tpu_paged.STEP_WORDS)[: int(plan.count), 0])
  assert chunks.max() >= 2, chunks  # a tile's chunks follow each other through the two slots
  expected, magnitude = oracle(case, batch)
  for seed in (0, 1, 2):
    with strict.interpreting(seed) as races:
      out = run_kernel(case, batch, strict.params(seed))
    assert not races, f"seed {seed}: {races}"
    assert relative_error(out, expected, magnitude) <= F32_TOL, seed


# ----------------------------------------------------------------------------
# Grid points: the steps in use, counted three ways
# ----------------------------------------------------------------------------

def _spec(case: Case, batch: Batch):
  """The call's PagedSpec (as fl.paged_attention checks it) and its int32 arrays."""
  kwargs = batch.kwargs(case)
  spec = paged.check(kwargs.pop("q"), kwargs.pop("k_pages"), kwargs.pop("v_pages"), scale=None, mask_mod=None,
                     **kwargs)
  arrays = {"page_table": batch.table, "kv_lens": batch.kv_lens, "cu_q_lens": batch.cu,
            "num_seqs": np.int32(batch.num_seqs)}
  return spec, arrays


def numpy_grid_points(case: Case, batch: Batch, block_q: int, per_step: int) -> int:
  """kv_heads x the (q tile, chunk of per_step pages) pairs, from each tile's visible keys by brute force."""
  ps, steps = case.page_size, 0
  for s in range(batch.num_seqs):
    q_len, kv_len = int(batch.cu[s + 1] - batch.cu[s]), int(batch.kv_lens[s])
    for first in range(0, q_len, block_q):
      pos = kv_len - q_len + np.arange(first, min(first + block_q, q_len))[:, None]
      j = np.arange(kv_len)[None, :]
      ok = (j <= pos) if case.causal else np.ones_like(j <= pos)
      if case.window is not None:
        ok &= (j >= pos - case.window[0]) & (j <= pos + case.window[1])
      pages = np.unique(np.nonzero(ok.any(0))[0] // ps)
      assert pages.size and pages[-1] - pages[0] + 1 == pages.size  # one run of pages per tile
      steps += -(-pages.size // per_step)
  return case.kv_heads * max(steps, 1)


@pytest.mark.parametrize("window", [None, (12, 0)], ids=["causal", "causal_window"])
def test_executed_grid_points_are_the_visible_pages(window, monkeypatch):
  """Two pages per step (KEYS_PER_STEP 16 on pages of 8): the interpreter's recorder sees exactly
  `grid_points` (= explain_paged's), which is an independent NumPy count, well under the static grid."""
  monkeypatch.setattr(tpu_paged, "KEYS_PER_STEP", 16)
  case = Case("grid", window=window)
  batch = make_batch(case)
  spec, arrays = _spec(case, batch)
  call = tpu_paged.make_call(spec, interpret=True)
  assert call.pages_per_step == 2
  points = []

  def record(token, grid_point, core):
    points.append(tuple(int(c) for c in grid_point))
    return token

  out = run_kernel(case, batch, pltpu.InterpretParams(grid_point_recorder=record))
  expected, magnitude = oracle(case, batch)
  assert relative_error(out, expected, magnitude) <= F32_TOL
  counted = tpu_paged.grid_points(spec, arrays["page_table"], arrays["kv_lens"], arrays["cu_q_lens"],
                                  arrays["num_seqs"])
  static = case.kv_heads * tpu_paged.max_steps(call)
  with fl.interpret_as("tpu"):
    explained = fl.explain_paged(impl="flash_pallas", **batch.kwargs(case))
  print(f"window {window}: {len(points)} grid points executed, static grid {static}")
  assert len(points) == counted == explained.grid_points
  assert counted == numpy_grid_points(case, batch, call.block_q, call.pages_per_step)
  assert counted < static
  if window is not None:  # the window skips pages causal alone reads
    assert counted < tpu_paged.grid_points(dataclasses.replace(spec, window=None), *arrays.values())


def test_an_empty_batch_runs_one_empty_step():
  case = CASES[0]
  batch = dataclasses.replace(make_batch(case), num_seqs=0)
  spec, arrays = _spec(case, batch)
  assert tpu_paged.grid_points(spec, arrays["page_table"], arrays["kv_lens"], arrays["cu_q_lens"], 0) == \
      case.kv_heads
  assert np.all(run_kernel(case, batch) == 0)


def test_q_tiles_hold_one_sequence_and_a_group():
  """The tiles the kernel runs: block_q from the batch's mean tokens per sequence (4 here), rows padded to
  the sublane tile; the 13-token chunk takes 4 tiles, each decoding token its own."""
  case = CASES[0]
  spec, arrays = _spec(case, make_batch(case))
  call = tpu_paged.make_call(spec, interpret=True)
  assert (call.block_q, call.rows, call.rows_pad) == (4, 16, 16)
  tiles = paged_plan.q_tiles(spec, arrays["cu_q_lens"], arrays["kv_lens"], arrays["num_seqs"], call.block_q)
  assert np.asarray(tiles.count).tolist()[:9] == [4, 4, 4, 1, 1, 1, 4, 4, 1]


# ----------------------------------------------------------------------------
# What the kernel refuses, by name
# ----------------------------------------------------------------------------

def _refusal(case: Case, **change):
  batch = make_batch(case)
  kwargs = {**batch.kwargs(case), **change}
  with pytest.raises(fl.UnsupportedError) as raised, fl.interpret_as("tpu"):
    fl.paged_attention(impl="flash_pallas", **kwargs)
  return str(raised.value)


def test_refusals_name_the_feature():
  case = CASES[0]
  batch = make_batch(case)
  assert "mask_mod" in _refusal(case, mask_mod=lambda b, h, q, k: q >= k)
  fp8, scales = fl.quantize_kv(jnp.asarray(batch.clean[0], jnp.float32), "float8_e4m3fn")
  assert "float8_e4m3fn pages" in _refusal(case, k_pages=fp8, v_pages=fp8, k_scales=scales, v_scales=scales)
  half = jnp.asarray(batch.clean[0], jnp.float16)
  assert "float16 pages" in _refusal(case, k_pages=half, v_pages=half)
  bf16 = jnp.asarray(batch.clean[0], jnp.bfloat16)  # pages of 8 tokens: half a bfloat16 sublane tile
  assert "page_size 8" in _refusal(case, k_pages=bf16, v_pages=bf16)


# ----------------------------------------------------------------------------
# Ahead-of-time compiles for real TPUs
# ----------------------------------------------------------------------------

TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


@functools.cache
def _device(generation: str):
  topologies = pytest.importorskip("jax.experimental.topologies")
  pytest.importorskip("libtpu")
  return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[generation]).devices[0]


def _serving_step(generation: str, kv_dtype: str, layout: str = "heads_first", page_size: int = 32):
  """(compiled, K+V pool bytes, K+V scales bytes) of a serving step: 512 tokens of 64 sequences (8 query
  heads on 2 kv heads of 128), 4,096-token contexts in pages of `page_size`, a pool of 262,144 tokens, a
  1,024-key window and a softcap; every length and the page table traced."""
  placed = jax.sharding.SingleDeviceSharding(_device(generation))
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)  # noqa: E731
  tokens, seqs, h, kvh, d = 512, 64, 8, 2, 128
  pps, pages = 4096 // page_size, 262144 // page_size
  pool = (kvh, pages, page_size, d) if layout == "heads_first" else (pages, page_size, kvh, d)
  args = [spec((tokens, h, d), jnp.bfloat16), spec(pool, kv_dtype), spec(pool, kv_dtype),
          spec((seqs, pps), jnp.int32), spec((seqs,), jnp.int32), spec((seqs + 1,), jnp.int32),
          spec((), jnp.int32)]
  if kv_dtype == "int8":
    args += [spec(pool[:-1], jnp.float32)] * 2

  def step(q, k, v, table, lens, cu, n, *scales):
    ks, vs = scales or (None, None)
    return fl.paged_attention(q, k, v, page_table=table, kv_lens=lens, cu_q_lens=cu, num_seqs=n, k_scales=ks,
                              v_scales=vs, layout=layout, window=(1024, 0), softcap=30.0, impl="flash_pallas")

  with lowering.lowered_only_for("tpu"):
    compiled = jax.jit(step).lower(*args).compile()
  pool_bytes = 2 * int(np.prod(pool)) * jnp.dtype(kv_dtype).itemsize
  return compiled, pool_bytes, 2 * 4 * int(np.prod(pool[:-1])) if kv_dtype == "int8" else 0


def _mosaic_kernels(hlo: str) -> list[str]:
  calls = re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", hlo)
  return sorted(re.sub(r"\.\d+$", "", name) for name in calls)


@pytest.mark.aot
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("generation", list(TOPOLOGIES))
def test_compiles_to_our_mosaic_kernel(generation, kv_dtype, record_property):
  """One Mosaic kernel, nothing interpreted, and no pool-sized temporary: the kernel reads the pages in
  place (the temporaries are the q tiles, the output tiles, the plan and, for int8 pages of 32 tokens,
  the scales relaid: see the next test)."""
  page_size = 16 if kv_dtype == "bfloat16" else 32
  compiled, pool_bytes, _ = _serving_step(generation, kv_dtype, page_size=page_size)
  hlo = compiled.as_text()
  assert _mosaic_kernels(hlo) == ["flash_layers_paged"], hlo[:2000]
  assert "callback" not in hlo
  temp = compiled.memory_analysis().temp_size_in_bytes
  record_property("temp_size_in_bytes", temp)
  print(f"{generation} {kv_dtype}: compiled temporaries {temp:,} bytes (K+V pool {pool_bytes:,})")
  assert temp < pool_bytes / 4


@pytest.mark.aot
def test_int8_scales_of_pages_under_128_tokens_are_relaid_each_call():
  """XLA's default TPU layout of an array whose minor dimension is under 128 lanes puts a longer dimension
  minor: scales [kv_heads, num_pages, page_size] of 32-token pages arrive pages-minor and are copied to the
  row-major form the kernel reads, each call (keep them row-major with jax's layout API to avoid it);
  scales of 128-token pages are row-major already. v5p, whose temporaries show the copy in HBM."""
  small, _, scales_bytes = _serving_step("v5p", "int8", page_size=32)
  large, _, _ = _serving_step("v5p", "int8", page_size=128)
  temps = [c.memory_analysis().temp_size_in_bytes for c in (small, large)]
  print(f"v5p int8 temporaries: pages of 32 {temps[0]:,} bytes, of 128 {temps[1]:,} "
        f"(scales {scales_bytes:,})")
  assert temps[0] - temps[1] >= scales_bytes


@pytest.mark.aot
def test_a_flax_layout_pool_costs_a_transpose_per_call():
  """explain_paged names it: pages in the flax layout are transposed to heads_first each call, a copy of
  the pool."""
  compiled, pool_bytes, _ = _serving_step("v5e", "bfloat16", layout="flax", page_size=16)
  assert _mosaic_kernels(compiled.as_text()) == ["flash_layers_paged"]
  assert compiled.memory_analysis().temp_size_in_bytes >= pool_bytes
