"""Sharded attention: meshes, logical rules, shard_map for every impl, ring attention.

Multi-device checks run in subprocesses (tests/parallel_worker.py) with 8 simulated
CPU devices, so this process -- and the rest of the suite -- keeps one device:
* one process per impl runs its (case, mesh) forward+gradient checks; others check the compiled
  ring (HLO, memory), the Flax layer, flax's own attention module with `fl.attention_fn` (4 devices),
  and the ring with the GPU kernels interpreted;
* a 2-process x 2-device job on localhost (gloo collectives) runs sharded calls,
  incl. a ring over all 4 devices;
* an ahead-of-time compile of ring-sharded flash_pallas for a v5p:2x2x2 slice (libtpu).
Plans, errors, explain() and the rules table are checked here, on abstract meshes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import flash_layers as fl
from flash_layers import parallel
from flash_layers.parallel import ulysses

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "parallel_worker.py"
F32_TOL = 1e-5  # as the conformance suite: relative error of float32 results
IMPLS = ("reference", "xla_chunked", "flash_pallas")
sys.path.insert(0, str(WORKER.parent))
import parallel_worker  # noqa: E402 -- the case table; importing it starts no devices
from conftest import subprocess_xla_flags  # noqa: E402


def _env(devices: int) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             XLA_FLAGS=subprocess_xla_flags(devices))
  env.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
  env.setdefault("TPU_SKIP_MDS_QUERY", "1")
  return env


def _results(stdout: str) -> list[dict]:
  return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def _run(args, *, devices=8, timeout=600) -> list[dict]:
  proc = subprocess.run([sys.executable, str(WORKER), *args], env=_env(devices), cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
  return _results(proc.stdout)


# ----------------------------------------------------------------------------
# Eight simulated devices: every impl x case x mesh, and the compiled ring
# ----------------------------------------------------------------------------

# One test per impl and one subprocess each: under pytest-xdist a shared fixture would run
# once per xdist worker.
@pytest.mark.parametrize("impl", IMPLS)
def test_sharded_equals_unsharded(impl):
  results = {(r["case"], tuple(r["mesh"])): r for r in _run(["meshes", impl]) if r["check"] == "mesh"}
  expected = [(case, mesh) for case, meshes in parallel_worker.cases_for(impl).items() for mesh in meshes]
  assert sorted(results) == sorted(expected)
  failures = []
  for (case, mesh), result in sorted(results.items()):
    if "error" in result:
      failures.append(f"{case} mesh {mesh}: {result['error']}")
      continue
    errors = result["errors"]
    if set(errors) != {"out", "dq", "dk", "dv"} or not all(e <= F32_TOL for e in errors.values()):
      failures.append(f"{case} mesh {mesh}: relative errors {errors} (limit {F32_TOL})")  # NaN too
    if mesh[3] > 1:
      ring = f"context parallel over sequence={mesh[3]}: strategy ring"
      layout = "contiguous" if "window" in case else "zig-zag"
      if ring not in result["explain"] or layout not in result["explain"]:
        failures.append(f"{case} mesh {mesh}: explain() says {result['explain']!r}")
  assert not failures, f"{impl}:\n" + "\n".join(failures)


def test_ring_hlo_permutes_and_never_gathers_the_sequence():
  results = [r for r in _run(["hlo"]) if r["check"] == "hlo"]
  assert {r["impl"] for r in results} == {"reference", "xla_chunked"}
  for result in results:
    assert result["ops"]["collective-permute"] > 0, result
    assert result["ops"]["all-gather"] == 0 and result["ops"]["all-to-all"] == 0, result
    # The per-device program holds no array as long as the whole sequence (1536 tokens).
    assert result["full_length_shapes"] == [], result
  # Memory per device is O(length / ring size): a ring of 8 needs about half of a ring of 4.
  temp = next(r for r in results if r["impl"] == "xla_chunked")["temp_bytes"]
  assert 0 < temp["8"] <= 0.6 * temp["4"], temp


def test_ring_with_gpu_kernels_interpreted():
  (result,) = [r for r in _run(["gpu"]) if r["check"] == "gpu"]
  assert "pallas-gpu (interpret)" in result["explain"] and "strategy ring" in result["explain"]
  assert all(err <= F32_TOL for err in result["errors"].values()), result


def test_ring_backward_runs_no_forward_kernel():
  """The ring's backward calls the backward kernels with the global lse and D: value_and_grad
  holds the forward's kernel calls and no more (one in the contiguous layout, one per chunk
  pair in the zig-zag one)."""
  results = {r["case"]: r for r in _run(["ring_kernels"]) if r["check"] == "ring_kernels"}
  # A shard of <= 16 queries runs flash_pallas's split-KV decode kernel forward, others the forward
  # kernel; either way the backward is the two backward kernels, once per forward call.
  for case, calls in (("window_mqa", 1), ("causal_packed_gqa", 4)):  # 4: 2 x 2 chunk pairs per step
    ((forward, count),) = results[case]["forward"].items()
    assert forward in ("flash_layers_fwd", "flash_layers_decode") and count == calls, results[case]
    assert results[case]["value_and_grad"] == {
        forward: calls, "flash_layers_bwd_dkv": calls, "flash_layers_bwd_dq": calls}, results[case]


def test_flax_layer_shards_over_its_mesh_or_the_current_one():
  results = {r["mesh"]: r for r in _run(["layer"]) if r["check"] == "layer"}
  assert set(results) == {"given", "current"}
  for name, result in results.items():
    assert result["max_error"] <= F32_TOL, (name, result)  # output and every gradient


def test_flax_attention_fn_shards_over_its_mesh_or_the_current_one():
  """fl.attention_fn in flax's MultiHeadDotProductAttention takes fl.attention's mesh path."""
  results = {r["mesh"]: r for r in _run(["attention_fn"], devices=4) if r["check"] == "attention_fn"}
  assert set(results) == {"given", "current"}
  for name, result in results.items():
    assert result["sharded"], (name, result)  # a shard_map, not GSPMD
    assert result["max_error"] <= F32_TOL, (name, result)  # output and every gradient


# ----------------------------------------------------------------------------
# Two processes x two CPU devices
# ----------------------------------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_multiprocess_sharded_and_ring_agree_with_single_process():
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, str(WORKER), "process", str(i), "2", str(port)],
                            env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outputs = []
  try:
    for proc in procs:
      out, err = proc.communicate(timeout=300)
      outputs.append((proc.returncode, out, err))
  finally:
    for proc in procs:  # also when one hangs or the test fails: no orphans
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  for i, (code, out, err) in enumerate(outputs):
    assert code == 0, f"process {i} failed:\n{out[-2000:]}\n{err[-4000:]}"
  results = [r for _, out, _ in outputs for r in _results(out)]
  assert len(results) == 2 * 2 * 3  # processes x cases x meshes
  assert {r["devices"] for r in results} == {4}
  assert any(r["mesh"] == [1, 1, 1, 4] for r in results)  # a ring across both processes
  for r in results:
    assert all(err <= F32_TOL for err in r["errors"].values()), r


# ----------------------------------------------------------------------------
# Ahead of time, for a TPU pod slice
# ----------------------------------------------------------------------------

@pytest.mark.aot
def test_ring_flash_pallas_compiles_for_v5p_slice():
  pytest.importorskip("libtpu")
  length = 12288
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.cp_aot", "--topology", "v5p:2x2x2",
       "--seq-len", str(length), "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
       "--mask", "causal+packed", "--context-parallel", "ring", "--json"],
      env=dict(_env(1), ALLOW_MULTIPLE_LIBTPU_LOAD="1"), cwd=ROOT, capture_output=True, text=True,
      timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["chips"] == 8 and result["mesh"]["sequence"] == 8
  assert result["mosaic_kernels"] > 0  # the real kernels, not an interpreted fallback
  assert result["collectives"]["collective-permute"] > 0
  assert result["collectives"]["all-gather"] == 0 and result["collectives"]["all-to-all"] == 0
  assert result["full_length_shapes"] == []
  # Per chip: its 1/8 of q, k, v (and segment ids) in, 1/8 of the gradients out.
  local_qkv = 1 * (length // 8) * (4 + 2 + 2) * 64 * 2
  assert local_qkv <= result["per_chip_bytes"]["arguments"] <= local_qkv + 2 * length
  assert result["per_chip_bytes"]["temporaries"] > 0


# ----------------------------------------------------------------------------
# In this process: mesh helpers, rules, plans, explain, errors
# ----------------------------------------------------------------------------

def test_make_mesh_axes_and_rest():
  mesh = parallel.make_mesh(data=-1)
  assert mesh.axis_names == ("data", "fsdp", "tensor", "sequence")
  assert dict(mesh.shape) == {"data": len(jax.devices()), "fsdp": 1, "tensor": 1, "sequence": 1}


@pytest.mark.parametrize("kwargs,words", [
    ({"tensor": 2}, ["tensor=2", "needs 2 devices", f"there are {len(jax.devices())}"]),
    ({"data": -1, "sequence": -1}, ["make_mesh sequence", "at most one size", "-1"]),
    ({"fsdp": 0}, ["make_mesh fsdp", "positive integer or -1"]),
    ({"sequence": 3, "data": -1, "devices": jax.devices() * 1}, ["make_mesh data", "-1 takes the rest",
                                                                 "does not divide"]),
])
def test_make_mesh_errors_name_the_field_and_count(kwargs, words):
  with pytest.raises(ValueError) as info:
    parallel.make_mesh(**kwargs)
  for word in words:
    assert word in str(info.value)


def test_logical_rules_with_flax():
  rules = parallel.LOGICAL_RULES
  assert nn.logical_to_mesh_axes(("batch", "length", "heads", "head_dim"), rules) == P(
      ("data", "fsdp"), "sequence", "tensor", None)
  # Activations keep embed whole (fsdp is taken by the batch); weights shard it.
  assert nn.logical_to_mesh_axes(("batch", "length", "embed"), rules) == P(("data", "fsdp"), "sequence", None)
  assert nn.logical_to_mesh_axes(("embed", "kv_heads", "head_dim"), rules) == P("fsdp", "tensor", None)
  assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == P("fsdp", "tensor")
  assert nn.logical_to_mesh_axes(("embed", "vocab"), rules) == P("fsdp", "tensor")
  with nn.logical_axis_rules(rules):
    assert nn.logical_to_mesh_axes(("batch", "length")) == P(("data", "fsdp"), "sequence")


def _abstract(data=1, fsdp=1, tensor=1, sequence=1):
  return AbstractMesh((data, fsdp, tensor, sequence), parallel.AXES)


def _shapes(batch=4, length=64, heads=8, kv_heads=2, head_dim=16):
  q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
  kv = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), jnp.float32)
  return q, kv, kv


@pytest.mark.parametrize("heads,kv_heads,tensor,local,index", [
    (8, 8, 4, 2, None),                    # MHA: split kv heads like the heads
    (8, 4, 2, 2, None),                    # GQA with kv heads to spare: split them
    (8, 2, 4, 1, (0, 0, 1, 1)),            # GQA, fewer kv heads than shards: one each
    (8, 1, 4, 1, (0, 0, 0, 0)),            # MQA
    (6, 3, 2, 3, (0, 0, 1, 1, 2, 2)),      # shards straddle groups: one kv head per local head
])
def test_kv_heads_each_shard_gets_what_it_reads(heads, kv_heads, tensor, local, index):
  got_local, got_index = ulysses.kv_heads_plan(heads, kv_heads, tensor)
  assert (got_local, got_index) == (local, index)
  # Independently: local query head j of shard s must read global kv head (s*m + j) // group.
  per_shard, group = heads // tensor, heads // kv_heads
  for s in range(tensor):
    for j in range(per_shard):
      local_kv = j // (per_shard // got_local)
      kv = (s * got_local + local_kv if index is None else index[s * got_local + local_kv])
      assert kv == (s * per_shard + j) // group


def test_explain_says_how_the_call_is_sharded():
  q, k, v = _shapes()
  text = str(fl.explain(q, k, v, impl="reference", causal=True, mesh=_abstract(data=2, tensor=4, sequence=2),
                         context_parallel="ring"))
  for words in ("shard_map", "data=2", "tensor=4", "heads over tensor (2 per shard", "1 of 2 kv heads",
                "context parallel over sequence=2: strategy ring", "zig-zag"):
    assert words in text, text
  plain = fl.explain(q, k, v, impl="reference", window=3, mesh=_abstract(sequence=4), context_parallel="ring")
  assert "contiguous" in plain.sharding
  assert fl.explain(q, k, v, impl="reference").sharding is None
  # A mesh of one device (or none current) shards nothing.
  assert fl.explain(q, k, v, impl="reference", mesh=_abstract()).sharding is None


def test_explain_uses_the_current_mesh():
  q, k, v = _shapes()
  with jax.sharding.use_abstract_mesh(_abstract(fsdp=4)):
    assert "batch over fsdp (4 shards)" in fl.explain(q, k, v, impl="reference").sharding


@pytest.mark.parametrize("mesh,shapes,words", [
    (dict(data=8), dict(batch=4), ["batch=4", "data x fsdp", "(8)"]),
    (dict(tensor=3), dict(heads=8), ["num_heads=8", "tensor", "(3)"]),
    (dict(sequence=3), dict(length=64), ["q_len=64", "sequence", "(3)"]),
])
def test_uneven_splits_name_the_dimension(mesh, shapes, words):
  q, k, v = _shapes(**shapes)
  with pytest.raises(ValueError) as info:
    fl.explain(q, k, v, impl="reference", mesh=_abstract(**mesh))
  for word in words:
    assert word in str(info.value)


def test_dense_mask_and_bias_refused_on_a_ring():
  """They would have to travel around the ring with K/V; attention_fn names them (fixed mesh or current)."""
  q = jax.ShapeDtypeStruct((2, 16, 2, 8), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 1, 16, 16), jnp.bool_)
  ring = _abstract(sequence=2)
  fn = fl.attention_fn(impl="reference", mesh=ring)
  with pytest.raises(fl.UnsupportedError, match="dense mask with a sequence-sharded"):
    jax.eval_shape(lambda q, mask: fn(q, q, q, mask=mask), q, mask)
  with jax.sharding.use_abstract_mesh(ring), pytest.raises(fl.UnsupportedError,
                                                            match="dense bias with a sequence-sharded"):
    jax.eval_shape(lambda q, bias: fl.attention_fn(impl="reference")(q, q, q, bias=bias), q,
                   jax.ShapeDtypeStruct((2, 1, 16, 16), jnp.float32))


def test_mesh_must_be_a_mesh():
  q = jnp.zeros((1, 8, 2, 8))
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    fl.attention(q, q, q, mesh="data")


def test_one_device_mesh_runs_unsharded():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32) for _ in range(3))
  mesh = parallel.make_mesh()
  np.testing.assert_array_equal(fl.attention(q, k, v, impl="reference", causal=True, mesh=mesh),
                                fl.attention(q, k, v, impl="reference", causal=True))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_gives_every_ring_device_equal_causal_work(n):
  """Visible (query chunk, kv chunk) pairs a device computes over the whole ring, by the ring's own
  skip test: zig-zag, 2n+1 each (of the n(2n+1) causal chunk pairs); contiguous, i+1 for device i."""
  from flash_layers import validate
  from flash_layers.parallel import ring

  q = jax.ShapeDtypeStruct((1, 16 * 2 * n, 1, 8), jnp.float32)
  request, _ = validate.prepare(q, q, q, causal=True)

  def work(chunks):
    local = dataclasses.replace(request, q_len=16 * 2 // chunks, kv_len=16 * 2 // chunks)
    config = ring.RingConfig("reference", local, "sequence", n, chunks)
    per_device = []
    for me in range(n):
      q_offs = ring._offsets(me, config, local.q_len)
      per_device.append(sum(
          bool(ring._pair_visible(config, q_off, kv_off, None, None))
          for step in range(n) for q_off in q_offs
          for kv_off in ring._offsets((me - step) % n, config, local.kv_len)))
    return per_device

  assert work(chunks=2) == [2 * n + 1] * n
  assert work(chunks=1) == [i + 1 for i in range(n)]
