"""The "ulysses" and "ulysses_ring" context-parallel strategies (flash_layers/parallel/ulysses.py).

Forward and gradients against the unsharded call run in subprocesses with 8 simulated CPU devices
(tests/cp_ulysses_worker.py, one per impl); plans and refusals are checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from flash_layers import validate
from flash_layers.parallel import ulysses

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "cp_ulysses_worker.py"
F32_TOL = 2e-5
sys.path.insert(0, str(WORKER.parent))
import cp_ulysses_worker  # noqa: E402 -- the run table; importing it starts no devices
from conftest import subprocess_xla_flags  # noqa: E402


def _run(which: str) -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=subprocess_xla_flags(8))
  proc = subprocess.run([sys.executable, str(WORKER), which], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
  lines = proc.stdout.splitlines()
  return [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]


@pytest.mark.parametrize("impl", ("reference", "xla_chunked", "flash_pallas"))
def test_strategies_equal_unsharded(impl):
  results = _run(impl)
  assert len(results) == len(cp_ulysses_worker.RUNS[impl])
  failures = []
  for r in results:
    name = f"{r['strategy']} {r['case']} mesh {r['mesh']} group {r['group']}"
    if "error" in r:
      failures.append(f"{name}: {r['error']}")
      continue
    expected = {"out", "lse", "dq", "dk", "dv"} | ({"d_operand0"} if r["case"] == "score_table" else set())
    if set(r["errors"]) != expected or not all(e <= F32_TOL for e in r["errors"].values()):
      failures.append(f"{name}: relative errors {r['errors']} (limit {F32_TOL})")
  assert not failures, f"{impl}:\n" + "\n".join(failures)


def test_collectives():
  """Ulysses is all-to-alls only; the hybrid adds the ring's collective-permutes; neither gathers."""
  ops = {r["strategy"]: r["ops"] for r in _run("hlo")}
  assert ops["ulysses"]["all-to-all"] > 0 and ops["ulysses"]["collective-permute"] == 0, ops
  assert ops["ulysses_ring"]["all-to-all"] > 0 and ops["ulysses_ring"]["collective-permute"] > 0, ops
  assert ops["ulysses"]["all-gather"] == ops["ulysses_ring"]["all-gather"] == 0, ops


def _request(heads=8, kv_heads=2, length=64, **kwargs):
  q = jnp.zeros((2, length, heads, 16), jnp.float32)
  kv = jnp.zeros((2, length, kv_heads, 16), jnp.float32)
  return validate.prepare(q, kv, kv, **kwargs)[0]


def test_kv_heads_plan_repeats_kv_heads_only_as_needed():
  assert ulysses.kv_heads_plan(8, 8, 4) == (2, None)  # split, never copied
  assert ulysses.kv_heads_plan(8, 2, 4) == (1, (0, 0, 1, 1))  # each kv head twice, not 4 times
  assert ulysses.kv_heads_plan(8, 1, 8) == (1, (0,) * 8)
  assert ulysses.kv_heads_plan(6, 3, 2) == (3, (0, 0, 1, 1, 2, 2))  # heads straddle kv groups
  local = ulysses.local_request(_request(), 4)
  assert (local.num_heads, local.num_kv_heads, local.q_len, local.kv_len) == (2, 1, 64, 64)


def test_hybrid_local_request():
  causal = ulysses.hybrid_local_request(_request(causal=True), 8, 2)  # 4 ring positions, zig-zag
  assert (causal.num_heads, causal.num_kv_heads, causal.q_len, causal.kv_len) == (4, 1, 8, 8)
  window = ulysses.hybrid_local_request(_request(window=(4, 0)), 8, 4)  # 2 positions, contiguous
  assert (window.num_heads, window.num_kv_heads, window.q_len, window.kv_len) == (2, 1, 32, 32)


def test_refusals_name_the_dimension():
  assert ulysses.refusal(_request(), 4, 1) is None
  message = ulysses.refusal(_request(heads=6, kv_heads=2), 4, 1)
  assert "num_heads=6" in message and "4" in message and "ulysses" in message
  assert "q_len=60" in ulysses.refusal(_request(length=60), 8, 1)
  assert ulysses.hybrid_refusal(_request(), 8, 2) is None
  assert "group (3)" in ulysses.hybrid_refusal(_request(), 8, 3)
  message = ulysses.hybrid_refusal(_request(heads=6, kv_heads=2), 8, 4)
  assert "num_heads=6" in message and "ulysses_ring" in message
  assert "q_len=36" in ulysses.hybrid_refusal(_request(length=36), 8, 2)
