"""The all-gather context-parallel strategy (flash_layers/parallel/all_gather.py).

Multi-device checks run in subprocesses (tests/cp_all_gather_worker.py) with 8 simulated CPU
devices, one per impl so pytest-xdist spreads them: `all_gather.attention` inside `jax.shard_map`
against the unsharded call of the same impl (output, lse, dq, dk, dv, a score_mod table's gradient),
and the collectives of the compiled programs. Refusals and local requests are checked here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from flash_layers import validate
from flash_layers.parallel import all_gather

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "cp_all_gather_worker.py"
F32_TOL = 2e-5  # relative error of float32 results
sys.path.insert(0, str(WORKER.parent))
import cp_all_gather_worker as worker  # noqa: E402 -- the case table; importing it starts no devices
from conftest import subprocess_xla_flags  # noqa: E402


def _run(args) -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=subprocess_xla_flags(8))
  proc = subprocess.run([sys.executable, str(WORKER), *args], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
  lines = proc.stdout.splitlines()
  return [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]


@pytest.mark.parametrize("impl", ["reference", "xla_chunked", "flash_pallas"])
def test_all_gather_equals_unsharded(impl):
  results = _run([impl, "hlo"] if impl != "flash_pallas" else [impl])
  cases = {r["case"]: r for r in results if r["check"] == "case"}
  assert sorted(cases) == sorted(worker.IMPL_CASES.get(impl, worker.CASES))
  failures = []
  for case, result in sorted(cases.items()):
    errors = result["errors"]
    wanted = {"out", "lse", "dq", "dk", "dv"} | ({"d_operand0"} if case == "score_table" else set())
    if set(errors) != wanted or not all(e <= F32_TOL for e in errors.values()):  # NaN fails too
      failures.append(f"{case}: relative errors {errors} (limit {F32_TOL})")
    if result["chunks"] != result["expected_chunks"] or result["local_kv_len"] != worker.LENGTH:
      failures.append(f"{case}: layout {result}")
  assert not failures, f"{impl}:\n" + "\n".join(failures)
  for hlo in (r for r in results if r["check"] == "hlo"):
    # K and V arrive whole (f32[b, 64, kv heads, d]) by all-gather, never by all-to-all.
    whole, shard = "f32[2,64,2,16]", "f32[2,16,2,16]"
    assert hlo["forward"]["all-gather"] == [whole] * 2 and hlo["forward"]["reduce-scatter"] == [], hlo
    # all_gather's transpose: XLA's CPU backend keeps a reduce-scatter of dK and dV to the local
    # shard (no all-reduce + dynamic-slice).
    assert hlo["grad"]["reduce-scatter"] == [shard] * 2 and hlo["grad"]["all-reduce"] == [], hlo
    assert hlo["grad"]["all-to-all"] == [], hlo


def _request(length=64, **kwargs):
  q = jnp.zeros((2, length, 4, 16), jnp.float32)
  k = jnp.zeros((2, length, 2, 16), jnp.float32)
  return validate.prepare(q, k, k, **kwargs)[0]


def test_refusal_names_the_dimension():
  assert all_gather.refusal(_request(causal=True), 8, 1) is None
  assert "q_len=66" in all_gather.refusal(_request(66), 4, 1)
  request = dataclasses.replace(_request(), kv_len=70)
  assert "kv_len=70" in all_gather.refusal(request, 4, 1) and "(4)" in all_gather.refusal(request, 4, 1)


@pytest.mark.parametrize("kwargs, size, q_len", [
    ({"causal": True}, 4, 8),  # zig-zag: 2 chunks of 64 / 8 queries
    ({"causal": True}, 8, 4),
    ({"window": (5, 2), "causal": True}, 4, 16),  # windows stay contiguous
    ({}, 4, 16),
    ({"causal": True}, 32, 1),  # 64 % 64 == 0: still zig-zag, one query per chunk
    ({"causal": True, "length": 36}, 4, 9),  # 36 % 8 != 0: contiguous
])
def test_local_request_holds_one_query_chunk_and_every_key(kwargs, size, q_len):
  request = _request(**kwargs)
  local = all_gather.local_request(request, size, 1)
  assert (local.q_len, local.kv_len, local.batch, local.num_heads) == (q_len, request.kv_len, 2, 4)
