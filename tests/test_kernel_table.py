"""The kernels' scalar table: `scalar_table.Table` reads exactly what `scalar_table.build` writes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import flash_layers as fl
from flash_layers import validate
from flash_layers.contract import dropout
from flash_layers.impls.flash_pallas import scalar_table


@pytest.mark.parametrize("alibi,rate", [(False, 0.0), (True, 0.0), (False, 0.2), (True, 0.2)])
def test_reads_match_what_build_writes(alibi, rate):
  b, t, h = 3, 16, 4
  q = jnp.zeros((b, t, h, 8))
  kwargs = {"alibi_slopes": fl.alibi_slopes(h)} if alibi else {}
  if rate:
    kwargs.update(dropout_rate=rate, dropout_rng=jax.random.key(7))
  request, args = validate.prepare(q, q, q, **kwargs)
  args = dataclasses.replace(args, q_offset=jnp.int32(5), kv_offset=jnp.int32(9), batch_offset=jnp.int32(2),
                             head_offset=jnp.int32(1))
  table = scalar_table.build(request, args, b)
  layout = scalar_table.Table.of(request)
  offsets = scalar_table.offsets(table)  # what the kernels read
  assert (int(offsets.q), int(offsets.kv)) == (int(args.q_offset), int(args.kv_offset))
  origin = scalar_table.origin(table)  # what the mods add to a program's row and head
  assert (int(origin.batch), int(origin.head)) == (int(args.batch_offset), int(args.head_offset))
  fixed = scalar_table.offsets_table(args.q_offset, args.kv_offset, args.batch_offset, args.head_offset)
  assert fixed.shape == (4,) and (table[:4] == fixed).all()  # the decode table is that part alone
  expected_len = 4 + (h if alibi else 0) + (b * h if rate else 0)
  assert table.shape == (expected_len,)
  for head in range(h):
    if alibi:
      assert float(layout.slope(table, head)) == float(fl.alibi_slopes(h)[head])
    for row in range(b if rate else 0):
      want = dropout.stream(args.dropout_seed, args.batch_offset + row, args.head_offset + head)
      assert int(layout.stream(table, row, head)) == int(want)
