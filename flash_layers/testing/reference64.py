"""Attention in float64 NumPy, forward and backward, written from the contract alone.

It imports nothing from flash_layers, so a mistake shared by the impls (in the
mask, the softcap, GQA head mapping or the gradient) cannot hide here too. The
backward pass is derived by hand, not by autodiff:

  x = scale * q.k + alibi + bias,  alibi[h, i, j] = -slope[h] * |i - j|
  y = score_mod(x) (x without one; the caller gives y and dy/dx, elementwise)
  s = y (then c * tanh(y / c) with a softcap), p = softmax over visible keys,
  lse = log sum_j exp(s_j)  (before dropout)
  m = keep / (1 - rate) (dropout, with a given keep mask; 1 without),  out = (m p) v
  dv = (m p)^T dout,  dp = m * (dout v^T),  ds = p * (dp - rowsum(dout * out) + dlse)
  (softcap: ds *= 1 - tanh^2),  dscore = ds (dL/dy),  (score_mod: ds *= dy/dx),
  dbias = ds,  dq = scale * ds k,  dk = scale * ds^T q

(sum_j p_j m_j dout.v_j = dout.out, so the row term is the same with dropout.)

Beside each result it returns a *magnitude*: the same sums taken over absolute
values (e.g. ``p |v|`` for out). Rounding errors scale with it, not with the
result, which may cancel to ~0 (a row that sees one key has dq = 0 exactly), so
tests measure errors relative to it.
"""

from __future__ import annotations

import numpy as np


def _document_positions(ids) -> np.ndarray:
  """Per row, each token's position within its run of equal ids (a document)."""
  ids = np.asarray(ids)
  out = np.zeros(ids.shape, np.int64)
  for row in range(ids.shape[0]):
    for n in range(1, ids.shape[1]):
      out[row, n] = out[row, n - 1] + 1 if ids[row, n] == ids[row, n - 1] else 0
  return out


def mask(batch, q_len, kv_len, *, causal=False, window=None, segment_ids=None,
         kv_segment_ids=None, q_offset=0, kv_offset=0, global_tokens=0):
  """bool [batch, q_len, kv_len]: may query i attend key j?

  global_tokens=g (with a window): the window does not apply when query i or key j is one of
  the first g tokens of its document (positions restart where the segment id changes; without
  segment ids, the global position).
  """
  i = q_offset + np.arange(q_len)[:, None]
  j = kv_offset + np.arange(kv_len)[None, :]
  ok = np.ones((batch, q_len, kv_len), dtype=bool)
  if causal:
    ok &= j <= i
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    in_window = np.broadcast_to((j >= i - left) & (j <= i + right), ok.shape)
    if global_tokens:
      if segment_ids is None:
        q_doc, kv_doc = np.broadcast_to(i, (batch, q_len, 1)), np.broadcast_to(j, (batch, 1, kv_len))
      else:
        q_doc = _document_positions(segment_ids)[:, :, None]
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        kv_doc = _document_positions(kv_ids)[:, None, :]
      in_window = in_window | (q_doc < global_tokens) | (kv_doc < global_tokens)
    ok &= in_window
  if segment_ids is not None:
    q_seg = np.asarray(segment_ids)
    kv_seg = q_seg if kv_segment_ids is None else np.asarray(kv_segment_ids)
    ok &= q_seg[:, :, None] == kv_seg[:, None, :]
  return ok


def attention(q, k, v, visible, *, scale=None, softcap=None, bias=None, alibi_slopes=None,
              keep=None, rate=0.0, q_offset=0, kv_offset=0, dout=None, dlse=None, sinks=None,
              score_mod=None):
  """q [b, t, h, d], k [b, s, kvh, d], v [b, s, kvh, dv]; visible broadcastable to [b, h, t, s].

  bias: broadcastable to [b, h, t, s]; alibi_slopes: [h] (positions q_offset + i, kv_offset + j);
  keep: the dropout keep mask (bool, broadcastable to [b, h, t, s]) applied with `rate`.
  sinks: [h] logits that join each row's softmax denominator with no value (attention sinks);
  then also dsinks.
  score_mod: a float64 NumPy function x [b, h, t, s] -> (y, dy/dx), both [b, h, t, s]; then also
  dscore = dL/dy (and its elementwise magnitude, magnitude["dscore_elements"]), from which a test
  derives its operands' gradients.
  Returns a dict with out [b, t, h, dv], lse [b, h, t] and, when dout is given,
  dq, dk, dv (and dbias [b, h, t, s] with a bias) (all float64). Rows that see no key:
  out 0, lse -inf, gradients 0.
  """
  q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  kvh = k.shape[2]
  group = h // kvh
  scale = d ** -0.5 if scale is None else scale
  # Query head n reads kv head n // group: repeat each kv head `group` times.
  k_rep = np.repeat(k, group, axis=2)
  v_rep = np.repeat(v, group, axis=2)
  x = scale * np.einsum("bthd,bshd->bhts", q, k_rep)
  if alibi_slopes is not None:
    i = q_offset + np.arange(t)[:, None]
    j = kv_offset + np.arange(k.shape[1])[None, :]
    x = x - np.asarray(alibi_slopes, np.float64)[None, :, None, None] * np.abs(i - j)
  if bias is not None:
    x = x + np.asarray(bias, np.float64)
  dy_dx = None
  if score_mod is not None:
    x, dy_dx = score_mod(x)
  tanh = None
  if softcap is not None:
    tanh = np.tanh(x / softcap)
    logits = softcap * tanh
  else:
    logits = x
  vis = np.broadcast_to(visible, logits.shape)
  row_max = np.where(vis, logits, -np.inf).max(-1, keepdims=True)
  sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]  # [1, h, 1, 1]
  if sink is not None:
    row_max = np.maximum(row_max, sink)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  e = np.where(vis, np.exp(np.where(vis, logits, 0.0) - row_max), 0.0)
  has_key = e.sum(-1, keepdims=True) > 0
  z = e.sum(-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - row_max))
  p = e / np.where(z > 0, z, 1.0)
  m = 1.0 if keep is None else np.broadcast_to(keep, p.shape) / (1.0 - rate)
  pm = p * m
  out = np.einsum("bhts,bshv->bthv", pm, v_rep)
  lse = np.where(z > 0, row_max + np.log(np.where(z > 0, z, 1.0)), -np.inf)[..., 0]
  result = {"out": out, "lse": lse, "visible_rows": has_key[..., 0],
            "magnitude": {"out": np.einsum("bhts,bshv->bthv", pm, np.abs(v_rep)).max(initial=0.0)}}
  if dout is None:
    return result

  do = np.asarray(dout, dtype=np.float64)
  dp = m * np.einsum("bthv,bshv->bhts", do, v_rep)
  dv_rep = np.einsum("bhts,bthv->bshv", pm, do)
  row_dot = np.einsum("bthv,bthv->bht", do, out)[..., None]
  if dlse is not None:
    row_dot = row_dot - np.asarray(dlse, dtype=np.float64)[..., None]
  ds = p * (dp - row_dot)
  if sink is not None:  # d out / d sink = -p_sink * out, d lse / d sink = p_sink
    p_sink = np.exp(sink[..., 0] - lse)  # [b, h, t]
    result["dsinks"] = -(p_sink * row_dot[..., 0]).sum((0, 2))
    result["magnitude"]["dsinks"] = (p_sink * np.abs(row_dot[..., 0])).sum((0, 2)).max(initial=0.0)
  if tanh is not None:
    ds = ds * (1.0 - tanh * tanh)
  if dy_dx is not None:
    result["dscore"] = ds.copy()
    result["magnitude"]["dscore_elements"] = p * (np.abs(dp) + np.abs(row_dot))
    ds = ds * dy_dx
  if bias is not None:
    result["dbias"] = ds.copy()
    result["magnitude"]["dbias"] = (p * (np.abs(dp) + np.abs(row_dot))
                                    * (1.0 if dy_dx is None else np.abs(dy_dx))).max(initial=0.0)
  dx = scale * ds
  dq = np.einsum("bhts,bshd->bthd", dx, k_rep)
  dk_rep = np.einsum("bhts,bthd->bshd", dx, q)
  s = k.shape[1]
  dx_mag = scale * p * (np.abs(dp) + np.abs(row_dot)) * (1.0 if dy_dx is None else np.abs(dy_dx))
  result["magnitude"].update(
      dq=np.einsum("bhts,bshd->bthd", dx_mag, np.abs(k_rep)).max(initial=0.0),
      dk=np.einsum("bhts,bthd->bshd", dx_mag, np.abs(q)).max(initial=0.0),
      dv=np.einsum("bhts,bthv->bshv", pm, np.abs(do)).max(initial=0.0))
  result["dq"] = dq
  result["dk"] = dk_rep.reshape(b, s, kvh, group, d).sum(3)
  result["dv"] = dv_rep.reshape(b, s, kvh, group, v.shape[3]).sum(3)
  return result


def paged_attention(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, num_seqs=None, layout="flax",
                    k_scales=None, v_scales=None, causal=True, window=None, softcap=None, scale=None,
                    sinks=None, mask_mod=None):
  """The paged contract (flash_layers/contract/paged.py) in float64, one sequence and query at a time.

  q [tokens, h, d]; pages "flax" [pages, page_size, kvh, d] or "heads_first" [kvh, pages, page_size, d],
  int8 / float8 pages times their float32 scales ([pages, page_size, kvh] or [kvh, pages, page_size]).
  Sequence s owns q rows cu_q_lens[s]:cu_q_lens[s+1], its i-th at position kv_lens[s] - q_len + i, and
  keys 0..kv_lens[s]-1, key j in page page_table[s, j // page_size] at row j % page_size. mask_mod is
  called with numpy ints (b=s, h, q_pos, kv_pos). Returns out [tokens, h, dv] float64 (zeros for rows
  past cu_q_lens[num_seqs], and for a query that sees nothing) and its magnitude p|v| per row.
  """
  q = np.asarray(q, np.float64)

  def flax_pages(pages, scales):
    pages = np.asarray(pages.astype(np.float32) if hasattr(pages, "astype") else pages, np.float64)
    if scales is not None:
      pages = pages * np.asarray(scales, np.float64)[..., None]
    return pages if layout == "flax" else np.moveaxis(pages, 0, 2)

  kp, vp = flax_pages(k_pages, k_scales), flax_pages(v_pages, v_scales)
  page_size, kvh = kp.shape[1], kp.shape[2]
  tokens, h, d = q.shape
  group = h // kvh
  scale = 1.0 / np.sqrt(d) if scale is None else scale
  left, right = (None, None) if window is None else ((window, window) if isinstance(window, int) else window)
  table, lens, cu = np.asarray(page_table), np.asarray(kv_lens), np.asarray(cu_q_lens)
  n = len(lens) if num_seqs is None else int(num_seqs)
  out = np.zeros((tokens, h, vp.shape[-1]))
  magnitude = np.zeros((tokens, h))
  for s in range(n):
    length, q_len = int(lens[s]), int(cu[s + 1] - cu[s])
    j = np.arange(length)
    keys = kp[table[s, j // page_size], j % page_size]    # [length, kvh, d]
    values = vp[table[s, j // page_size], j % page_size]
    for i in range(q_len):
      row, pos = int(cu[s]) + i, length - q_len + i
      for head in range(h):
        ok = np.ones(length, bool)
        if causal:
          ok &= j <= pos
        if left is not None:
          ok &= (j >= pos - left) & (j <= pos + right)
        if mask_mod is not None:
          ok &= np.array([bool(mask_mod(s, head, pos, int(jj))) for jj in j], bool)
        logits = scale * keys[:, head // group] @ q[row, head]
        if softcap is not None:
          logits = softcap * np.tanh(logits / softcap)
        logits = np.where(ok, logits, -np.inf)
        sink = None if sinks is None else float(sinks[head])
        top = max(logits.max(initial=-np.inf), -np.inf if sink is None else sink)
        if top == -np.inf:
          continue
        e = np.exp(logits - top)
        z = e.sum() + (0.0 if sink is None else np.exp(sink - top))
        p = e / z
        out[row, head] = p @ values[:, head // group]
        magnitude[row, head] = p @ np.abs(values[:, head // group]).max(-1)
  return out, magnitude
