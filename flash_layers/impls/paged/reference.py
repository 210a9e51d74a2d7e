"""reference for paged attention: every query row gathers its sequence's pages and attends, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flash_layers.contract import paged
from flash_layers.contract.paged import PagedSpec


def row_logits(spec: PagedSpec, q, keys, seq, pos, kv_lens, kv_offset=0):
  """(logits [rows, kv_heads, group, kv] float32 after scale and softcap, masked to -inf) of query rows
  q [rows, heads, d] against their keys [rows, kv, kv_heads, d] (key j at position kv_offset + j)."""
  rows = q.shape[0]
  qg = q.reshape(rows, spec.num_kv_heads, spec.group, spec.head_dim)
  s = jnp.einsum("rhgd,rjhd->rhgj", qg, keys, precision=spec.precision,
                 preferred_element_type=jnp.float32) * spec.scale
  if spec.softcap is not None:
    s = spec.softcap * jnp.tanh(s / spec.softcap)
  kv_pos = kv_offset + jnp.arange(keys.shape[1], dtype=jnp.int32)
  head = jnp.arange(spec.num_heads, dtype=jnp.int32).reshape(1, spec.num_kv_heads, spec.group, 1)
  ok = paged.visible(spec, pos[:, None, None, None], kv_pos[None, None, None, :],
                     kv_lens[seq][:, None, None, None], seq[:, None, None, None], head)
  return jnp.where(ok, s, -jnp.inf)


def softmax_out(spec: PagedSpec, logits, values, valid, dtype):
  """(out [rows, heads, dv] in dtype, lse [rows, heads]) from masked logits and values [rows, kv, kvh, dv]."""
  rows = logits.shape[0]
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  e = jnp.exp(logits - top)
  z = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(z > 0, z, 1.0)
  out = jnp.einsum("rhgj,rjhd->rhgd", p.astype(values.dtype) if values.dtype == jnp.bfloat16 else p,
                   values, precision=spec.precision, preferred_element_type=jnp.float32)
  lse = jnp.where(z[..., 0] > 0, jnp.log(jnp.where(z[..., 0] > 0, z[..., 0], 1.0)) + top[..., 0], -jnp.inf)
  out = jnp.where(valid[:, None, None, None], out, 0.0).reshape(rows, spec.num_heads, spec.head_dim_v)
  lse = jnp.where(valid[:, None, None], lse, -jnp.inf).reshape(rows, spec.num_heads)
  return out.astype(dtype), lse


def gather_keys(spec: PagedSpec, pages, scales, table_rows, compute_dtype):
  """Pages by id, [rows, n pages] -> [rows, n * page_size, kv_heads, d] in compute_dtype, dequantized."""
  pages = paged.to_flax(pages, spec.layout)
  scales = None if scales is None else paged.to_flax(scales, spec.layout)
  rows = table_rows.shape[0]
  gathered = pages[table_rows]  # [rows, pages_per_seq, page_size, kvh, d]
  if scales is not None:
    gathered = paged.dequantize(gathered, scales[table_rows], jnp.float32)
  gathered = gathered.astype(compute_dtype)
  return gathered.reshape(rows, -1, *gathered.shape[3:])


def compute_dtype(spec: PagedSpec):
  """bfloat16 q and pages stay bfloat16 (float32 accumulation); anything else computes in float32."""
  return jnp.bfloat16 if spec.dtype == "bfloat16" and spec.kv_dtype == "bfloat16" else jnp.float32


def attend_rows(spec: PagedSpec, q, k_pages, v_pages, arrays, seq, pos, valid):
  dtype = compute_dtype(spec)
  table = jnp.clip(arrays["page_table"][seq], 0, spec.num_pages - 1)
  keys = gather_keys(spec, k_pages, arrays["k_scales"], table, dtype)
  values = gather_keys(spec, v_pages, arrays["v_scales"], table, dtype)
  logits = row_logits(spec, q.astype(dtype), keys, seq, pos, arrays["kv_lens"])
  return softmax_out(spec, logits, values, valid, q.dtype)


class PagedReference:
  name = "reference"

  def unsupported(self, spec: PagedSpec, platform: str) -> str | None:
    return None

  def kernel(self, spec: PagedSpec, platform: str) -> str:
    return "xla (pages gathered per query row)"

  def attend(self, q, k_pages, v_pages, *, spec: PagedSpec, arrays) -> tuple[jax.Array, jax.Array]:
    seq, pos, valid = paged.token_positions(arrays["cu_q_lens"], arrays["kv_lens"], arrays["num_seqs"],
                                            spec.num_tokens)
    return attend_rows(spec, q, k_pages, v_pages, arrays, seq, pos, valid)
