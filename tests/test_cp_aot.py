"""Context-parallel strategies compiled for a TPU pod slice (libtpu, no TPU): what each moves per chip.

`benchmarks.cp_aot` compiles forward + backward of `fl.attention(..., context_parallel=S)` with the
flash_pallas Mosaic kernels for v5p:2x2x2 and reads the collectives of the compiled HLO
(flash_layers.training.collectives: payload bytes per chip per step, loops multiplied out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.aot


def _compile(strategy: str, seq_len: int, heads: int = 16, kv_heads: int = 4, mask: str = "causal+packed"):
  pytest.importorskip("libtpu")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), ALLOW_MULTIPLE_LIBTPU_LOAD="1",
             TPU_SKIP_MDS_QUERY="1")
  env.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.cp_aot", "--topology", "v5p:2x2x2", "--sequence", "8",
       "--seq-len", str(seq_len), "--heads", str(heads), "--kv-heads", str(kv_heads), "--head-dim", "128",
       "--mask", mask, "--context-parallel", strategy, "--json"],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-5000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ulysses_moves_fewer_bytes_per_chip_than_the_ring_at_128k():
  """16 query heads >= 8 devices, 131,072 tokens: Ulysses's all-to-alls move a fixed share of each
  chip's q, k, v, out (and their gradients), the ring passes every K/V block around the whole ring."""
  ring, ulysses = _compile("ring", 131072), _compile("ulysses", 131072)
  for case in (ring, ulysses):
    assert case["chips"] == 8 and case["mesh"]["sequence"] == 8
    assert case["mosaic_kernels"] > 0  # the real kernels, not an interpreted fallback
    assert case["collective_bytes_per_step_per_chip"]["in_loops_of_unknown_trip_count"] == 0
  assert "strategy ring" in ring["sharding"] and "strategy ulysses" in ulysses["sharding"]
  assert ring["collectives"]["collective-permute"] > 0 and ring["collectives"]["all-to-all"] == 0
  assert ulysses["collectives"]["all-to-all"] > 0 and ulysses["collectives"]["collective-permute"] == 0
  ring_bytes = ring["collective_bytes_per_step_per_chip"]["ici_bytes_per_step_per_chip"]
  ulysses_bytes = ulysses["collective_bytes_per_step_per_chip"]["ici_bytes_per_step_per_chip"]
  assert ulysses_bytes < ring_bytes / 2, (ulysses_bytes, ring_bytes)
  # Ulysses holds one head group's whole sequence but no more: no chip holds another's K/V blocks.
  assert ulysses["per_chip_bytes"]["temporaries"] < ring["per_chip_bytes"]["temporaries"]


def test_a_strategy_that_cannot_split_the_heads_is_recorded_as_refused():
  """6 query heads over 8 devices: Ulysses cannot give each device whole heads, and says so."""
  case = _compile("ulysses", 8192, heads=6, kv_heads=6)
  assert "refused" in case and "ulysses" in case["refused"] and "6" in case["refused"], case


def test_the_pod_dry_run_reports_the_strategy_its_bytes_and_memory():
  """configs/tpu_pod.py on v5p:4x4x4 (fsdp 16 x sequence 4): the report's attention entry is the plan
  `fl.attention` makes for the model's call and the cost model's numbers for it; a config that asks
  for the ring gets the ring."""
  pytest.importorskip("libtpu")
  sys.path.insert(0, str(ROOT))
  try:
    from configs import tpu_pod
  finally:
    sys.path.remove(str(ROOT))
  from flash_layers.parallel import cost
  from flash_layers.parallel.mesh import make_mesh
  from flash_layers.training import aot
  from flash_layers.training import config as config_lib

  config = tpu_pod.get_config()
  devices = aot.topology_devices("v5p:4x4x4")
  mesh = make_mesh(**config_lib.mesh_shape(config, len(devices), 1), devices=devices)
  report = aot.attention_report(config, mesh)
  m = config.model
  assert report["strategy"] == "ulysses" and "strategy ulysses (auto on v5p" in report["sharding"]
  block = cost.make_request(config.train.batch_size // 16, m.max_len, m.num_heads, m.num_heads,
                            m.hidden_size // m.num_heads, causal=False, dtype=m.dtype)
  expected = cost.strategy_cost("ulysses", block, 4, 1, "v5p")
  assert report["modelled_bytes_per_chip_per_layer"] == expected.bytes
  assert report["modelled_bytes_per_chip_per_step"] == expected.bytes * m.num_layers
  assert report["modelled_memory_bytes_per_chip"] == expected.memory_bytes > 0
  config.model.context_parallel = "ring"
  ring = aot.attention_report(config, mesh)
  assert ring["strategy"] == "ring" and ring["reason"] == "asked for"
  assert ring["modelled_bytes_per_chip_per_layer"] > report["modelled_bytes_per_chip_per_layer"]


def test_auto_prices_a_sequence_axis_that_spans_slices_over_dcn():
  """A hand-built mesh whose sequence axis crosses two v5e slices (make_mesh never builds one): auto's
  reason names the DCN bytes, and ulysses_ring's groups stay inside a slice so only its ring crosses."""
  pytest.importorskip("libtpu")
  import jax
  import jax.numpy as jnp
  import numpy as np

  import flash_layers as fl
  from flash_layers.parallel import cost
  from flash_layers.training import aot

  devices = sorted(aot.topology_devices("v5e:2x2", num_slices=2), key=lambda d: (d.slice_index, d.id))
  mesh = jax.sharding.Mesh(np.asarray(devices), ("sequence",))
  q = jax.ShapeDtypeStruct((1, 65536, 8, 128), jnp.bfloat16)
  text = fl.explain(q, q, q, impl="xla_chunked", causal=True, mesh=mesh).sharding
  block = cost.make_request(1, 65536, 8, 8, 128)
  strategy, group, reason, _ = cost.choose(block, 8, "v5e", dcn_groups=2)
  assert f"strategy {strategy}" in text and reason in text, text
  assert "DCN" in reason and reason != cost.choose(block, 8, "v5e")[2]  # one slice: no DCN at all
  hybrid = fl.explain(q, q, q, impl="xla_chunked", causal=True, mesh=mesh, context_parallel="ulysses_ring")
  assert "Ulysses in groups of 4" in hybrid.sharding
