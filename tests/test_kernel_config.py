"""The kernel families' configuration modules: docs/kernels.md's tile tables are theirs, written
out (parsed from the markdown and compared entry by entry), and the autotuning candidate spaces
hold only configurations the kernels accept."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import pytest

import flash_layers as fl
from flash_layers import validate
from flash_layers.impls.flash_pallas import gpu_config, tpu_config
from flash_layers.impls.tiling import LANES

KERNELS_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "kernels.md"
TPU_HEADER = "| generation | forward (q, kv) | backward (q, kv) |"
GPU_HEADER = "| generation | head_dim | forward q × kv, warps, stages |"


def _table(text: str, header: str) -> list[list[str]]:
  """The body rows (cells stripped) of the one markdown table whose header starts with `header`."""
  lines = text.splitlines()
  starts = [i for i, line in enumerate(lines) if line.startswith(header)]
  assert len(starts) == 1, f"expected one table starting {header!r} in docs/kernels.md; found {len(starts)}"
  rows = []
  for line in lines[starts[0] + 2:]:  # skip the header and the |---| line
    if not line.startswith("|"):
      break
    rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
  return rows


def _ints(cell: str) -> list[int]:
  return [int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*", cell)]


def tpu_disagreements(text: str) -> list[str]:
  """Where the docs' TPU tile table and `tpu_config.TILE_TABLE` (+ its generic row) differ."""
  entries = {e.generation: e for e in (*tpu_config.TILE_TABLE, tpu_config.GENERIC)}
  problems, seen = [], set()
  for generation, forward, backward, vmem, why in _table(text, TPU_HEADER):
    seen.add(generation)
    entry = entries.get(generation)
    if entry is None:
      problems.append(f"docs row {generation!r} has no entry in tpu_config")
      continue
    s = entry.sizes
    if _ints(forward) != [s.block_q, s.block_kv]:
      problems.append(f"{generation} forward: docs {forward}, config {s.block_q}, {s.block_kv}")
    if _ints(backward) != list(s.backward):
      problems.append(f"{generation} backward: docs {backward}, config {s.backward}")
    if entry.vmem_capacity is None:
      if "default" not in vmem:
        problems.append(f"{generation} VMEM: docs {vmem!r}, config has none (Mosaic's default)")
    elif _ints(vmem) != [entry.vmem_capacity >> 20, entry.default_scoped_vmem >> 20]:
      problems.append(f"{generation} VMEM: docs {vmem!r}, config {entry.vmem_capacity >> 20} MiB "
                      f"({entry.default_scoped_vmem >> 20})")
    if why != entry.why:
      problems.append(f"{generation} why: docs {why!r}, config {entry.why!r}")
  problems += [f"tpu_config entry {g!r} is not in the docs' table" for g in entries if g not in seen]
  return problems


def gpu_disagreements(text: str) -> list[str]:
  """Where the docs' GPU table and `gpu_config.TILE_TABLE` differ (shared memory: the estimate of
  `gpu_config.shared_memory_bytes` for bfloat16 at the bucket's head_dim)."""
  entries = {(e.generation, e.head_dim): e for e in gpu_config.TILE_TABLE}
  problems, seen = [], set()
  for generation, head_dim, forward, backward, smem, why in _table(text, GPU_HEADER):
    key = (generation, _ints(head_dim)[0])
    seen.add(key)
    entry = entries.get(key)
    if entry is None:
      problems.append(f"docs row {key} has no entry in gpu_config")
      continue
    s = entry.sizes
    if _ints(forward) != [s.block_q, s.block_kv, s.num_warps, s.num_stages]:
      problems.append(f"{key} forward: docs {forward}, config {s}")
    if _ints(backward) != [s.block_q_bwd, s.block_kv_bwd, s.num_warps_bwd, s.num_stages_bwd]:
      problems.append(f"{key} backward: docs {backward}, config {s}")
    kib = gpu_config.shared_memory_bytes(s, key[1], key[1], 2) / 1024
    if _ints(smem) != [kib]:
      problems.append(f"{key} shared memory: docs {smem}, estimate {kib} KiB")
    if why != entry.why:
      problems.append(f"{key} why: docs {why!r}, config {entry.why!r}")
  problems += [f"gpu_config entry {k} is not in the docs' table" for k in entries if k not in seen]
  return problems


def test_docs_tile_tables_match_the_config_modules():
  text = KERNELS_MD.read_text()
  assert tpu_disagreements(text) == []
  assert gpu_disagreements(text) == []


def test_the_comparison_catches_a_changed_entry():
  text = KERNELS_MD.read_text()
  tpu_row = next(line for line in text.splitlines() if line.startswith("| v4 "))
  changed = text.replace(tpu_row, tpu_row.replace("256, 512", "512, 512", 1))
  assert any("v4 backward" in p for p in tpu_disagreements(changed))
  gpu_row = next(line for line in text.splitlines() if line.startswith("| ada | ≤ 256"))
  assert any("not in the docs" in p for p in gpu_disagreements(text.replace(gpu_row + "\n", "")))
  # A config entry that changes is caught too (the docs unchanged).
  entry = gpu_config.TILE_TABLE[0]
  original = gpu_config.TILE_TABLE
  try:
    gpu_config.TILE_TABLE = (dataclasses.replace(entry, why="moved"), *original[1:])
    assert any("why" in p for p in gpu_disagreements(text))
  finally:
    gpu_config.TILE_TABLE = original


def _request(length: int, dtype="bfloat16", head_dim=64, heads=4, kv_heads=4):
  q = jax.ShapeDtypeStruct((1, length, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((1, length, kv_heads, head_dim), dtype)
  return validate.prepare(q, kv, kv, causal=True)[0]


@pytest.mark.parametrize("generation", ["v4", "v5e", None])
def test_tpu_candidates_are_valid_and_start_with_the_default(generation):
  request = _request(2048, dtype="float32", head_dim=256)
  found = tpu_config.candidates(request, generation)
  fwd, bwd = tpu_config.clamp(tpu_config.default_block_sizes(generation), request)
  assert (found[0].block_q, found[0].block_kv) == fwd and found[0].backward == bwd
  assert len(found) == len(set(found)) > 1
  capacity = tpu_config.VMEM_CAPACITY.get(generation)
  for sizes in found[1:]:
    for bq, bk in ((sizes.block_q, sizes.block_kv), sizes.backward):
      assert bq % LANES == 0 and bk % LANES == 0 and bq <= 2048 and bk <= 2048
      if capacity is not None:
        assert tpu_config.vmem_need(256, 256, bq, bk, 4) <= capacity
  if generation == "v4":  # 16 MiB: float32 1024 x 1024 tiles at head_dim 256 do not fit
    assert fl.BlockSizes(1024, 1024, 256, 256) not in found and fl.BlockSizes(256, 256, 256, 256) in found
  elif generation == "v5e":  # 128 MiB: 1024 x 1024 fits, 2048 x 2048 (~96 MiB of logits alone) not
    assert fl.BlockSizes(1024, 1024, 1024, 1024) in found
    assert fl.BlockSizes(2048, 2048, 2048, 2048) not in found
  else:  # unknown generation: no VMEM cut
    assert fl.BlockSizes(2048, 2048, 2048, 2048) in found
  # Short sequences: tiles clamp to the length, so few distinct candidates remain.
  assert tpu_config.candidates(_request(100), generation) == [fl.BlockSizes(128, 128, 128, 128)]


def test_gpu_candidates_fit_shared_memory_and_the_lengths():
  request = _request(1000, head_dim=128)
  for generation in ("hopper", "ada"):
    found = gpu_config.candidates(request, generation)
    assert found[0] == gpu_config.fit_lengths(gpu_config.CONFIG_TABLE[(generation, 128)], request)
    assert len(found) == len(set(found)) > 10
    for cfg in found:
      assert gpu_config.shared_memory_bytes(cfg, 128, 128, 2) <= gpu_config.SHARED_MEMORY[generation]
      assert cfg.num_warps in gpu_config.CANDIDATE_WARPS + (8,)
    assert {cfg.num_warps for cfg in found} == {4, 8} and {cfg.num_stages for cfg in found} == {2, 3}
  # ada's 99 KiB refuses what hopper's 227 KiB takes.
  assert len(gpu_config.candidates(request, "ada")) < len(gpu_config.candidates(request, "hopper"))
  tiny = gpu_config.candidates(_request(20), "hopper")  # every tile fit to 32 tokens
  assert all(max(c.block_q, c.block_kv, c.block_q_bwd, c.block_kv_bwd) <= 32 for c in tiny)
