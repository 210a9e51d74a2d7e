"""Every feature of the contract on every mesh, with every context-parallel strategy.

Eight simulated CPU devices in subprocesses (tests/cp_worker.py): for each strategy x mesh
{data, data x tensor, sequence, data x sequence, tensor x sequence} x request {causal, packed
documents, window, global tokens, prefix-LM mask_mod with a per-row operand, chunked-causal
mask_mod, a score_mod with a trainable table, sinks, dropout, GQA 8:2}, the output and every
gradient (q, k, v, the table, the sinks) equal the unsharded call's. xla_chunked runs the whole
table, the reference and the interpreted flash kernels a representative subset (their mods on a batch,
head and Ulysses split included). What a strategy cannot serve is refused by name, and the refusal is
asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import flash_layers as fl
from flash_layers import validate
from flash_layers.parallel import sharded

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "cp_worker.py"
F32_TOL = 2e-5
sys.path.insert(0, str(WORKER.parent))
import cp_worker  # noqa: E402 -- the case table; importing it starts no devices
from conftest import subprocess_xla_flags  # noqa: E402

SEQUENCE_MESHES = [name for name, sizes in cp_worker.MESHES if "sequence" in sizes]
OTHER_MESHES = [name for name, sizes in cp_worker.MESHES if "sequence" not in sizes]
STRATEGIES = fl.parallel.STRATEGIES
# (impl, request, mesh, strategy) that must be refused, with these words. The shapes divide for every
# strategy (8 heads, 64 tokens, 4 sequence devices) and every impl here hands the mods global batch rows
# and heads (the sharded_mods capability), so nothing is refused now; a strategy or impl that refuses a
# case names it here.
REFUSALS: dict[tuple[str, str, str, str], str] = {}


def _run(args, timeout=900) -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=subprocess_xla_flags(8))
  proc = subprocess.run([sys.executable, str(WORKER), *args], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)
  assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
  lines = proc.stdout.splitlines()
  return [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]


def _check(results: list[dict], expected_cases: int) -> None:
  assert len(results) == expected_cases, [(r["request"], r["mesh"], r["strategy"]) for r in results]
  failures = []
  for r in results:
    where = f"{r['impl']} {r['request']} on {r['mesh']} with {r['strategy']}"
    refusal = REFUSALS.get((r["impl"], r["request"], r["mesh"], r["strategy"]))
    if refusal is not None:
      if refusal not in r.get("refused", ""):
        failures.append(f"{where}: expected a refusal naming {refusal!r}; got {r}")
      continue
    if "errors" not in r:
      failures.append(f"{where}: {r.get('refused') or r.get('error')}")
      continue
    bad = {k: e for k, e in r["errors"].items() if not e <= F32_TOL}  # NaN fails too
    names = {"out", "dq", "dk", "dv"} | ({"dmod_operands"} if r["request"] == "t5_table" else set()) | (
        {"dsinks"} if r["request"] == "sinks" else set())
    if bad or set(r["errors"]) != names:
      failures.append(f"{where}: relative errors {r['errors']} (limit {F32_TOL})")
    if r["strategy"] != "auto" and f"strategy {r['strategy']}" not in r["explain"]:
      failures.append(f"{where}: explain says {r['explain']!r}")
  assert not failures, "\n".join(failures)


# The default tier's 8-device check: one interpreter runs every strategy on the sequence mesh (and auto
# on data x tensor) for two requests, causal packed documents and a trainable T5 table (a per-head
# operand that takes gradients); the full table below is the second tier.
def test_every_strategy_on_eight_devices_in_one_process():
  requests = ["packed", "t5_table"]
  results = _run(["xla_chunked", ",".join(STRATEGIES), ",".join(requests), "sequence,data_tensor"])
  _check(results, len(requests) * (len(STRATEGIES) + 1))
  assert {r["strategy"] for r in results} == {*STRATEGIES, "auto"}


# One interpreter runs the whole table, xla_chunked: every request with every strategy on the three
# sequence meshes and with auto on the data and tensor meshes (each request's unsharded call is
# computed once and compared with all of its sharded ones).
def test_every_request_on_every_mesh_with_every_strategy():
  results = _run(["xla_chunked", ",".join(STRATEGIES), "", ",".join(SEQUENCE_MESHES + OTHER_MESHES)])
  _check(results, len(cp_worker.REQUESTS) * (len(SEQUENCE_MESHES) * len(STRATEGIES) + len(OTHER_MESHES)))
  assert {(r["mesh"], r["strategy"]) for r in results} == {
      *((m, s) for m in SEQUENCE_MESHES for s in STRATEGIES), *((m, "auto") for m in OTHER_MESHES)}


def test_reference_on_every_strategy():
  requests = ["packed", "prefix_lm", "t5_table", "dropout"]
  results = _run(["reference", ",".join(STRATEGIES), ",".join(requests), "data_tensor,tensor_sequence"])
  _check(results, len(requests) * (1 + len(STRATEGIES)))


# The flash kernels, interpreted (TPU family on a CPU host), in one interpreter: packed documents, a
# mask_mod with a per-row operand and a trainable table, each strategy once on the sequence mesh
# (Ulysses: a head split), and auto on data x tensor, where the prefix-LM mask_mod reads prefix[b] and
# the T5 table table[h] with the global row and head a shard adds (scalar_table.origin).
# (tests/test_sharded_mods.py holds the kernels to the reference on a slice in one process, where a
# tile fully visible to local rows or heads would skip the mask.)
def test_interpreted_flash_kernels_on_every_strategy_and_on_batch_and_head_splits():
  requests = ["packed", "prefix_lm", "t5_table"]
  results = _run(["flash_pallas", ",".join(STRATEGIES), ",".join(requests), "sequence,data_tensor"])
  _check(results, len(requests) * (len(STRATEGIES) + 1))
  assert {r["mesh"] for r in results if r["strategy"] == "auto"} == {"data_tensor"}


# ----------------------------------------------------------------------------
# Refusals and declarations, on abstract meshes (no devices needed)
# ----------------------------------------------------------------------------

def _abstract(**sizes):
  names = fl.parallel.AXES
  return jax.sharding.AbstractMesh(tuple(sizes.get(a, 1) for a in names), names)


def _qkv(heads=8, kv_heads=2, length=64, batch=4):
  return (jax.ShapeDtypeStruct((batch, length, heads, 16), jnp.float32),
          jax.ShapeDtypeStruct((batch, length, kv_heads, 16), jnp.float32),
          jax.ShapeDtypeStruct((batch, length, kv_heads, 16), jnp.float32))


def test_ulysses_refuses_heads_that_do_not_divide():
  q, k, v = _qkv(heads=6, kv_heads=2)
  with pytest.raises(fl.UnsupportedError, match=r"ulysses.*num_heads|num_heads.*ulysses"):
    fl.explain(q, k, v, impl="xla_chunked", causal=True, mesh=_abstract(sequence=4),
               context_parallel="ulysses")


def test_unknown_strategy_is_named():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="context_parallel must be one of"):
    fl.explain(q, k, v, impl="xla_chunked", mesh=_abstract(sequence=4), context_parallel="megatron")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dense_bias_with_a_sequence_split_is_refused(strategy):
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _qkv())
  request, args = validate.prepare(q, k, v, bias=jnp.zeros((4, 8, 64, 64), jnp.float32))
  with pytest.raises(fl.UnsupportedError, match=f"{strategy}.*dense bias|dense bias.*{strategy}"):
    plan = sharded.make_plan(request, _abstract(sequence=4), strategy=strategy)  # the strategy refuses
    sharded._check_sequence_split(plan, args)  # or the split does, before shard_map


def test_operand_layouts_are_checked_by_name():
  q, k, v = _qkv()
  prefix = jnp.zeros((4,), jnp.int32)
  mask_mod = fl.masks.prefix_lm(operand=0)
  with pytest.raises(ValueError, match=r"mod_operand_axes\[0\]\[0\] must be one of"):
    fl.explain(q, k, v, impl="xla_chunked", mask_mod=mask_mod, mod_operands=(prefix,),
               mod_operand_axes=(("rows",),))
  with pytest.raises(ValueError, match=r"mod_operands\[0\] axis 0 is declared 'heads'"):
    fl.explain(q, k, v, impl="xla_chunked", mask_mod=mask_mod, mod_operands=(prefix,),
               mod_operand_axes=(("heads",),))
  with pytest.raises(ValueError, match="one entry per mod_operand"):
    fl.explain(q, k, v, impl="xla_chunked", mask_mod=mask_mod, mod_operands=(prefix,),
               mod_operand_axes=(("batch",), None))


def test_user_axis_names_need_a_mapping():
  q, k, v = _qkv()
  mesh = jax.sharding.AbstractMesh((2, 4), ("batch", "model"))
  with pytest.raises(ValueError, match="none of flash_layers'"):
    fl.explain(q, k, v, impl="xla_chunked", causal=True, mesh=mesh)
  text = fl.explain(q, k, v, impl="xla_chunked", causal=True, mesh=mesh,
                    mesh_axes={"batch": "batch", "heads": "model"}).sharding
  assert "batch over batch (2 shards)" in text and "heads over model (2 per shard" in text, text
  import flax.linen as nn
  with nn.logical_axis_rules([("batch", "batch"), ("heads", "model")]):
    assert fl.explain(q, k, v, impl="xla_chunked", causal=True, mesh=mesh).sharding == text
  with pytest.raises(ValueError, match="does not have"):
    fl.explain(q, k, v, impl="xla_chunked", mesh=mesh, mesh_axes={"heads": "tensor"})


# auto's choice through fl.explain, on abstract meshes (the cost model's table: tests/test_cp_cost.py).
@pytest.mark.parametrize("length, heads, kv_heads, causal, sizes, strategy", [
    (131072, 16, 4, True, dict(sequence=8), "ulysses"),  # long, heads >= devices: two all-to-alls
    (8192, 16, 1, False, dict(sequence=8), "all_gather"),  # one kv head, an encoder: gather K/V
    (8192, 16, 1, True, dict(sequence=8), "ulysses"),  # causal: all_gather's zig-zag moves q and out
    (4096, 6, 2, True, dict(sequence=4), "all_gather"),  # 6 heads do not split 4 ways: no Ulysses
])
def test_explain_names_autos_strategy(length, heads, kv_heads, causal, sizes, strategy):
  q = jax.ShapeDtypeStruct((1, length, heads, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, length, kv_heads, 128), jnp.bfloat16)
  text = fl.explain(q, k, k, impl="xla_chunked", causal=causal, mesh=_abstract(**sizes)).sharding
  assert f"strategy {strategy} (auto on" in text and "MiB/chip/layer" in text, text


def test_impls_without_sharded_mods_refuse_mods_on_a_batch_or_head_split():
  # xla_native serves a mask_mod but does not declare that a shard's mods see global rows and heads.
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _qkv())  # refused before shard_map needs devices
  with pytest.raises(fl.UnsupportedError, match="'xla_native' on a mesh that splits the batch: its kernels"):
    fl.attention(q, k, v, impl="xla_native", mask_mod=fl.masks.causal(), mesh=_abstract(data=2))
  with pytest.raises(fl.UnsupportedError, match="splits the heads.*impl= one of .*'flash_pallas'"):
    fl.attention(q, k, v, impl="xla_native", mask_mod=fl.masks.causal(), mesh=_abstract(tensor=2))
