"""The context-parallel cost model (flash_layers/parallel/cost.py): "auto"'s choices on a table of
shapes, the byte formulas against counts worked by hand, and the refusals' messages."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from flash_layers.parallel import cost
from flash_layers.parallel.context import STRATEGIES

MIB = 1024**2
ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cp-cost-model-2026-12-06.json"


def req(batch, tokens, heads, kv_heads, head_dim, **kw):
  return cost.make_request(batch, tokens, heads, kv_heads, head_dim, **kw)


# (make_request args, size, generation, dcn_groups) -> (strategy, group) that "auto" picks.
CHOICES = [
    ((1, 131072, 16, 4, 128), 8, "v5p", 1, "ulysses", None),
    # GQA 16:1 at 8k: K/V are small, all_gather gathers them; causal, its zig-zag moves q and out.
    ((1, 8192, 16, 1, 128, False), 4, "v5p", 1, "all_gather", None),
    ((1, 8192, 16, 1, 128), 4, "v5p", 1, "ulysses", None),
    ((1, 32768, 6, 6, 128), 4, "v5p", 1, "all_gather", None),   # 6 heads: no Ulysses on 4
    ((1, 32768, 8, 8, 128), 16, "v5p", 1, "ulysses_ring", 8),   # fewer heads than devices
    ((1, 65536, 8, 8, 128), 8, "v5p", 2, "ulysses", None),      # across 2 slices
    ((1, 1048576, 8, 8, 128), 8, "v5e", 1, "ulysses", None),    # all_gather over HBM/4 on v5e
    ((1, 1048576, 8, 8, 128), 8, "v5p", 1, "ulysses", None),
    ((2, 32768, 32, 8, 128), 8, "v4", 1, "ulysses", None),
    ((2, 32768, 32, 8, 128), 8, "v6e", 1, "ulysses", None),
    ((2, 32768, 32, 8, 128), 8, "gpu", 1, "ulysses", None),
]


@pytest.mark.parametrize("shape,size,generation,dcn_groups,strategy,group", CHOICES)
def test_auto_choices(shape, size, generation, dcn_groups, strategy, group):
  causal = shape[5] if len(shape) > 5 else True
  got, got_group, reason, costs = cost.choose(req(*shape[:5], causal=causal), size, generation, dcn_groups)
  assert (got, got_group) == (strategy, group), reason
  assert reason.startswith(strategy) and f"on {generation}" in reason and " < " in reason
  assert set(costs) == set(STRATEGIES)
  best = costs[strategy]
  assert all(best.seconds <= c.seconds for c in costs.values() if c.feasible)


def test_ulysses_moves_fewer_bytes_than_the_ring_at_long_lengths():
  r = req(1, 131072, 16, 4, 128)
  ring, ulysses = (cost.strategy_cost(s, r, 8) for s in ("ring", "ulysses"))
  assert ulysses.bytes < ring.bytes / 3
  # Non-causal too (no zig-zag shuffle for the ring).
  r = req(1, 131072, 16, 4, 128, causal=False)
  assert cost.strategy_cost("ulysses", r, 8).bytes < cost.strategy_cost("ring", r, 8).bytes


# --- the formulas against hand counts ------------------------------------------------------------
# b 1, 8192 tokens, 4 query heads, 2 kv heads, d = dv = 64, bfloat16 (e = 2), size 4: a chip holds
# 2048 tokens: K = V = 2048*2*64*2 = 0.5 MiB, Q = O = 2048*4*64*2 = 1 MiB, lse L = 2048*4*4 = 32768.

def small(causal):
  return req(1, 8192, 4, 2, 64, causal=causal)


def test_ring_bytes_by_hand():
  c = cost.strategy_cost("ring", small(False), 4)
  # fwd 4 hops x (K+V) = 4 MiB; bwd 4 hops x (K+V) x (1 + 4/2) = 12 MiB.
  assert (c.ici_bytes, c.dcn_bytes) == (16 * MIB, 0)
  assert c.memory_bytes == 3 * MIB  # visiting K/V + float32 dK/dV
  assert math.isclose(c.seconds, 16 * MIB / 600e9)  # v5p: 1200 GB/s bidirectional -> 600 one way
  # Causal adds the zig-zag shuffle: 2 (Q + K + V + O + L) = 2 (3 MiB + 32768).
  assert cost.strategy_cost("ring", small(True), 4).ici_bytes == 16 * MIB + 6 * MIB + 65536


def test_ulysses_bytes_by_hand():
  c = cost.strategy_cost("ulysses", small(True), 4)
  # 2 kv heads < 4 devices: K/V repeated to 4 heads (1 MiB each); 2 x 3/4 x (Q + K' + V' + O + L).
  assert c.ici_bytes == 2 * 3 / 4 * (4 * MIB + 32768)
  assert c.dcn_bytes == 0


def test_all_gather_bytes_by_hand():
  c = cost.strategy_cost("all_gather", small(False), 4, generation="gpu")
  assert c.ici_bytes == 2 * 3 * MIB  # 3 peers' K+V in, 3 peers' dK+dV out (a reduce-scatter)
  assert c.memory_bytes == 4 * MIB  # the whole sequence's K/V
  # A TPU compiles the reduce-scatter as an all-reduce: twice the backward's bytes.
  assert cost.strategy_cost("all_gather", small(False), 4, generation="v5p").ici_bytes == 9 * MIB
  # Causal adds the queries' zig-zag: 2 (Q + O + L) = 2 (2 MiB + 32768).
  causal = cost.strategy_cost("all_gather", small(True), 4, generation="v5p")
  assert causal.ici_bytes == 9 * MIB + 4 * MIB + 65536


def test_two_slice_ulysses_ring_puts_the_ring_on_dcn():
  # size 8 over 2 slices, group 4: Ulysses inside a slice, a 2-hop ring across the slices. A chip
  # holds 1024 tokens: Q = O = K' = V' = 1024*4*64*2 = 0.5 MiB (K/V at max(2, 4) = 4 heads), L = 16384.
  r = req(1, 8192, 4, 2, 64, causal=False)
  c = cost.strategy_cost("ulysses_ring", r, 8, group=4, dcn_groups=2)
  assert c.ici_bytes == 2 * 3 / 4 * (2 * MIB + 16384)
  assert c.dcn_bytes == 2 * MIB + 2 * MIB * 3  # 2 hops of K'+V', 2 of K'+V' and f32 dK'/dV'
  assert math.isclose(c.seconds, c.ici_bytes / 600e9 + c.dcn_bytes / 6.25e9)
  one_slice = cost.strategy_cost("ulysses_ring", r, 8, group=4)
  assert one_slice.dcn_bytes == 0 and one_slice.ici_bytes == c.ici_bytes + c.dcn_bytes


# --- refusals --------------------------------------------------------------------------------------

def test_ulysses_refuses_heads_that_do_not_split():
  c = cost.strategy_cost("ulysses", req(1, 32768, 6, 6, 128), 4)
  assert not c.feasible and c.seconds == math.inf
  assert c.why_not == "ulysses: num_heads 6 does not divide by 4 devices"


def test_all_gather_refused_over_a_quarter_of_hbm():
  c = cost.strategy_cost("all_gather", req(1, 1048576, 8, 8, 128), 8, generation="v5e")
  assert not c.feasible
  assert c.why_not == ("all_gather: the gathered K/V take 4096.0 MiB per chip, over 0.25 of v5e's "
                       "14.9 GiB HBM (3814.7 MiB)")
  assert cost.strategy_cost("all_gather", req(1, 1048576, 8, 8, 128), 8, generation="v5p").feasible


def test_length_and_group_refusals():
  assert cost.strategy_cost("ring", req(1, 1000, 8, 8, 64), 16).why_not == (
      "ring: q_len 1000 does not divide into 16 chunks (16 devices x 1)")
  assert cost.strategy_cost("ulysses_ring", req(1, 4096, 8, 8, 64), 8, group=3).why_not == (
      "ulysses_ring: group 3 must divide 8 devices and lie strictly between 1 and 8")
  assert cost.strategy_cost("ulysses_ring", req(1, 4096, 8, 8, 64), 8, group=4, dcn_groups=4).why_not == (
      "ulysses_ring: group 4 does not divide the 2 devices of a slice (8 devices over 4 slices)")
  assert cost.strategy_cost("ulysses", req(1, 4096, 8, 3, 64), 4).why_not == (
      "ulysses: num_kv_heads 3 neither divides nor is divided by 4 devices")
  _, group, _, costs = cost.choose(req(1, 4096, 7, 7, 64), 4)
  assert group is None and costs["ulysses_ring"].why_not.startswith("ulysses_ring: no group g")
  with pytest.raises(ValueError, match="no context-parallel strategy fits: ring: q_len 1000"):
    cost.choose(req(1, 1000, 8, 8, 64), 16, allowed=("ring",))
  with pytest.raises(ValueError, match="unknown context-parallel strategy 'auto'"):
    cost.strategy_cost("auto", req(1, 4096, 8, 8, 64), 4)


def test_only_allowed_strategies_and_the_reason_names_the_runner_up():
  r = req(1, 131072, 16, 4, 128)
  strategy, _, reason, costs = cost.choose(r, 8, allowed=("ring", "all_gather"))
  assert strategy == "all_gather" and set(costs) == {"ring", "all_gather"}
  assert reason == ("all_gather: 930.0 MiB/chip/layer over ICI (1.63 ms on v5p) < "
                    "ring 1346.0 MiB/chip/layer over ICI (2.35 ms on v5p)")
  assert cost.choose(r, 8, allowed=("ring",))[2].endswith("(the only feasible strategy)")


def test_ulysses_ring_group_is_the_largest_divisor_the_heads_allow():
  assert cost.ulysses_ring_group(req(1, 4096, 8, 8, 64), 16) == 8
  assert cost.ulysses_ring_group(req(1, 4096, 12, 12, 64), 8) == 4
  assert cost.ulysses_ring_group(req(1, 4096, 16, 16, 64), 8, dcn_groups=4) == 2
  assert cost.ulysses_ring_group(req(1, 4096, 5, 5, 64), 8) is None


@pytest.mark.parametrize("kind,generation", [
    ("TPU v5 lite", "v5e"), ("TPU v5p", "v5p"), ("TPU v5", "v5p"), ("TPU v4", "v4"),
    ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"), ("cpu", "cpu"), ("gpu", "gpu"), ("cuda", "gpu"),
    ("NVIDIA H100 80GB HBM3", "gpu")])
def test_generation_of(kind, generation):
  assert cost.generation_of(kind) == generation


def test_generation_of_unknown():
  with pytest.raises(ValueError, match="unknown platform or device kind 'TPU v9'"):
    cost.generation_of("TPU v9")


def test_results_file_is_the_models_output():
  """docs/sharding.md's cost tables come from this file: it must be what the model says now."""
  stored = json.loads(RESULTS.read_text())
  assert stored["cases"] == json.loads(json.dumps(cost.table()))
