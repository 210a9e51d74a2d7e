"""Evaluation and prediction batches whose cost follows the real tokens, not max_len.

Training streams fixed [batch, max_len] rows (pipeline.py). Evaluation sees each document exactly
once and its order does not matter, so it is planned up front over the whole split:

    tokenize every document (its windows with long_docs="windows")
    sort the windows longest first
    batch after batch: row length L = the smallest bucket >= the longest window left;
      the batch has rows_per_batch(L) rows (batch_size, fewer for rows longer than row_tokens);
      each of its rows takes the longest window left, then packs the shortest ones
      left into its free room (at most max_docs per row)

Buckets are a short ladder of lengths (multiples of `granule`, at most ~1/4 octave apart), so a
batch wastes little padding and the eval step compiles for a handful of shapes.

Why long rows come fewer to a batch: a batch's rows all take the length of its longest window.
In the sparse tail of long documents the next-longest windows are much shorter, so batch_size
rows of the longest bucket would pad them (or pack the shortest windows of the split) into rows
of that length: on BBC News at max_len 4,096, one 4,096-token article took seven rows of 4,096
slots with it, 45% of the evaluation's CPU time for 24% of its tokens (docs/benchmarks.md,
"Evaluation cost vs max_len"). A batch therefore holds at most batch_size * row_tokens token
slots (at least `row_multiple` rows): a lone long window gets a batch of one or a few rows, and
the short windows stay in rows of their own short buckets.

The plan is global, so all processes run the same steps with the same shapes, and process p
takes rows [p * local, (p + 1) * local) of each batch (local = the batch's rows / process_count).
The metrics therefore do not depend on the number of processes.

Each batch is the dict of pipeline.py (input_ids, segment_ids, positions, labels [rows,
max_docs]) plus `doc_ids` [rows, max_docs]: the index of the document a slot's window belongs
to, -1 for an empty slot. A document split into windows has several slots with its index;
`aggregate_logits` combines them into one prediction per document.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from flash_layers.data.pipeline import chunked, pack_rows, token_tags
from flash_layers.data.readers import SINGLE, LabelSpec
from flash_layers.data.tokenize import TextTokenizer

AGGREGATIONS = ("mean", "max")

# Rows up to this many tokens come batch_size to a batch; longer ones proportionally fewer
# (module doc). 512 keeps the batches of a model with max_len <= 512 as they were.
ROW_TOKENS = 512


def length_buckets(max_len: int, granule: int = 128) -> tuple[int, ...]:
  """Row lengths a batch may take: multiples of `granule` growing by ~1/4 octave, then max_len."""
  if granule < 1 or max_len < 1:
    raise ValueError(f"max_len and granule must be >= 1; got {max_len}, {granule}")
  out, length = [], granule
  while length < max_len:
    out.append(length)
    octave = 1 << (length.bit_length() - 1)
    length += max(granule, octave // 4 // granule * granule)
  return (*out, max_len)


def _bucket(n: int, buckets: Sequence[int]) -> int:
  return next(b for b in buckets if b >= n)


def rows_per_batch(row_len: int, *, batch_size: int, row_tokens: int | None, row_multiple: int = 1) -> int:
  """Rows in a batch of `row_len`-token rows: batch_size, or as many as fit in batch_size *
  row_tokens slots, rounded down to a multiple of row_multiple (at least row_multiple)."""
  if batch_size % row_multiple:
    raise ValueError(f"batch_size={batch_size} must be a multiple of row_multiple={row_multiple}")
  if row_tokens is None or row_len <= row_tokens:
    return batch_size
  rows = batch_size * row_tokens // row_len // row_multiple * row_multiple
  return max(row_multiple, rows)


class PlannedBatch(NamedTuple):
  row_len: int  # tokens per row
  num_rows: int  # rows over all processes (rows beyond len(rows) are empty)
  rows: list[list[int]]  # example indices per row


def plan_batches(lengths: Sequence[int], *, batch_size: int, max_docs: int, buckets: Sequence[int],
                 pack: bool = True, row_tokens: int | None = None,
                 row_multiple: int = 1) -> list[PlannedBatch]:
  """Every example once, longest first (module doc). row_tokens=None: batch_size rows per batch."""
  if not lengths:
    return []
  if max(lengths) > buckets[-1]:
    raise ValueError(f"an example of {max(lengths)} tokens exceeds the longest bucket {buckets[-1]}")
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  lo, hi = 0, len(order)  # order[lo:hi] is what is left, longest first
  plan = []
  while lo < hi:
    row_len = _bucket(lengths[order[lo]], buckets)
    num_rows = rows_per_batch(row_len, batch_size=batch_size, row_tokens=row_tokens,
                              row_multiple=row_multiple)
    rows = []
    while len(rows) < num_rows and lo < hi:
      row, used = [order[lo]], lengths[order[lo]]
      lo += 1
      while pack and lo < hi and len(row) < max_docs and used + lengths[order[hi - 1]] <= row_len:
        hi -= 1
        row.append(order[hi])
        used += lengths[order[hi]]
      rows.append(row)
    plan.append(PlannedBatch(row_len, num_rows, rows))
  return plan


def eval_batches(texts: Sequence[str], labels: Sequence | None, tokenizer: TextTokenizer, *,
                 batch_size: int, max_docs_per_row: int = 8, pack: bool = True,
                 buckets: Sequence[int] | None = None, row_tokens: int | None = ROW_TOKENS,
                 row_multiple: int = 1, process_index: int = 0, process_count: int = 1,
                 label_spec: LabelSpec = SINGLE, chunks: int | None = None) -> list[dict[str, np.ndarray]]:
  """This process's rows of every evaluation batch (module docstring).

  Args:
    texts: the documents; labels: their labels as `Records` hold them (`label_spec` says how they
      go into a batch: int ids by default), or None (prediction: every label slot empty).
    tokenizer: a TextTokenizer; its long_docs decides truncation or windows.
    batch_size: the most rows in a batch over all processes (a multiple of process_count and
      row_multiple).
    max_docs_per_row: with pack, the most windows in a row (labels' and doc_ids' second dim).
    pack: pack short windows into a row's free room; False = one window per row.
    buckets: allowed row lengths, ascending, the last >= every window (default
      `length_buckets(tokenizer.max_len)`); (tokenizer.max_len,) pads every row to max_len.
    row_tokens: a batch of rows longer than this holds at most batch_size * row_tokens token
      slots (`rows_per_batch`); None = batch_size rows whatever their length.
    row_multiple: every batch's rows divide by this (e.g. the mesh's batch-parallel size) and
      by process_count.
    process_index, process_count: which rows of each batch this process keeps.
    chunks: hierarchical documents: each document is one row of its first `chunks` windows, its
      segments (pipeline.chunked); rows are up to chunks * max_len tokens, one document each.
  """
  if labels is not None and len(labels) != len(texts):
    raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
  options = dict(batch_size=batch_size, max_docs_per_row=max_docs_per_row, pack=pack, buckets=buckets,
                 row_tokens=row_tokens, row_multiple=row_multiple, process_index=process_index,
                 process_count=process_count)
  if label_spec.kind == "none":  # masked LM: each token's id (or -1) and word start, masked on device
    windows, slots, doc_of = [], [], []
    for doc, pieces in enumerate(tokenizer.encode_pieces(list(texts))):
      for ids, table in pieces:
        windows.append(ids)
        slots.append(table)
        doc_of.append(doc)
    return _planned(windows, slots, doc_of, {}, tokenizer, label_spec, **options)
  if label_spec.per_token:
    return token_eval_batches(texts, labels, tokenizer, batch_size=batch_size,
                              max_docs_per_row=max_docs_per_row, pack=pack, buckets=buckets,
                              row_tokens=row_tokens, row_multiple=row_multiple,
                              process_index=process_index, process_count=process_count)
  windows, doc_of = [], []
  for doc, ws in enumerate(tokenizer.encode(list(texts))):
    if chunks:
      windows.append(chunked(ws[:chunks], None))
      doc_of.append(doc)
    else:
      windows += ws
      doc_of += [doc] * len(ws)
  slots = [None if labels is None else labels[doc] for doc in doc_of]
  if chunks:
    options.update(pack=False, buckets=buckets or length_buckets(tokenizer.max_len * chunks))
  return _planned(windows, slots, doc_of, {}, tokenizer, label_spec, **options)


class TokenBatches(list):
  """Token classification's evaluation batches, with what scoring needs beyond them: `doc_words`
  (each document's number of words), `doc_tags` (each document's gold tag ids; None to predict) and
  `num_windows` (the windows the documents were cut into, over all processes). A word is in the
  batches at most once, at its first piece in the window where that piece is most central
  (tokenize.WordWindow); a word in no window (cut off by truncation, or turned into no piece) is
  scored as predicted "O"."""

  def __init__(self, batches, doc_words: list[int], doc_tags: list[np.ndarray] | None, num_windows: int):
    super().__init__(batches)
    self.doc_words = doc_words
    self.doc_tags = doc_tags
    self.num_windows = num_windows


def token_eval_batches(documents: Sequence[Sequence[str]], tags: Sequence | None, tokenizer: TextTokenizer,
                       **options) -> TokenBatches:
  """`eval_batches` for token classification: `documents` are lists of words, `tags` their tag ids
  (or None). Each batch's "labels" [rows, length] holds a word's gold tag at the one token it is
  scored at, and "word_ids" the word's index in the whole split (documents' words numbered in order),
  -1 elsewhere."""
  if tags is not None and len(tags) != len(documents):
    raise ValueError(f"{len(documents)} documents but {len(tags)} tag lists")
  doc_words = [len(d) for d in documents]
  offsets = np.concatenate([[0], np.cumsum(doc_words)]).astype(np.int64)
  windows, doc_of, slots, word_ids = [], [], [], []
  for doc, ws in enumerate(tokenizer.encode_words(list(documents))):
    for w in ws:
      windows.append(w.ids)
      doc_of.append(doc)
      slots.append(token_tags(w.central_word, None if tags is None else tags[doc]))
      word_ids.append(np.where(w.central_word >= 0, w.central_word + offsets[doc], -1).astype(np.int32))
  batches = _planned(windows, slots, doc_of, {"word_ids": word_ids}, tokenizer, LabelSpec("tags"), **options)
  return TokenBatches(batches, doc_words, None if tags is None else [np.asarray(t, np.int32) for t in tags],
                      num_windows=len(windows))


def _planned(windows, slots, doc_of, extras: dict, tokenizer, label_spec, *, batch_size: int,
             max_docs_per_row: int = 8, pack: bool = True, buckets: Sequence[int] | None = None,
             row_tokens: int | None = ROW_TOKENS, row_multiple: int = 1, process_index: int = 0,
             process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """The batches of windows (token ids) with their label slots, and per-token `extras` arrays laid out
  as the tokens are."""
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} must divide over {process_count} processes")
  max_docs = max_docs_per_row if pack else 1
  buckets = tuple(buckets or length_buckets(tokenizer.max_len))
  length = lambda w: len(w[0]) if isinstance(w, tuple) else len(w)
  plan = plan_batches([length(w) for w in windows], batch_size=batch_size, max_docs=max_docs,
                      buckets=buckets, pack=pack, row_tokens=row_tokens,
                      row_multiple=math.lcm(row_multiple, process_count))
  out = []
  for planned in plan:
    local = planned.num_rows // process_count
    mine = planned.rows[process_index * local:(process_index + 1) * local]
    example = lambda i: ((windows[i][0], slots[i], windows[i][2]) if isinstance(windows[i], tuple)
                         else (windows[i], slots[i]))
    batch = pack_rows([[example(i) for i in row] for row in mine], batch_size=local,
                      max_len=planned.row_len, max_docs=max_docs, pad_id=tokenizer.pad_id,
                      label_spec=label_spec)
    doc_ids = np.full((local, max_docs), -1, np.int32)
    for name in extras:
      batch[name] = np.full((local, planned.row_len), -1, np.int32)
    for r, row in enumerate(mine):
      doc_ids[r, :len(row)] = [doc_of[i] for i in row]
      start = 0
      for i in row:
        for name, per_window in extras.items():
          batch[name][r, start:start + length(windows[i])] = per_window[i]
        start += length(windows[i])
    batch["doc_ids"] = doc_ids
    out.append(batch)
  return out


def real_token_fraction(batches: Sequence[dict[str, np.ndarray]]) -> float:
  """Tokens that belong to a document / all token slots of the batches."""
  real = sum(int(np.count_nonzero(b["segment_ids"])) for b in batches)
  total = sum(b["segment_ids"].size for b in batches)
  return real / total if total else float("nan")


def aggregate_logits(logits: np.ndarray, doc_ids: np.ndarray, num_docs: int,
                     how: str = "mean") -> tuple[np.ndarray, np.ndarray]:
  """(per-document logits [num_docs, C], seen [num_docs] bool) from slot logits [..., C] and
  their doc_ids [...] (-1 = no document): the "mean" or the elementwise "max" of a document's
  window logits."""
  if how not in AGGREGATIONS:
    raise ValueError(f"window_aggregation must be one of {AGGREGATIONS}; got {how!r}")
  logits = np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1])
  doc_ids = np.asarray(doc_ids).reshape(-1)
  if logits.shape[0] != doc_ids.shape[0]:
    raise ValueError(f"{logits.shape[0]} slot logits but {doc_ids.shape[0]} doc_ids")
  keep = doc_ids >= 0
  logits, doc_ids = logits[keep], doc_ids[keep]
  counts = np.bincount(doc_ids, minlength=num_docs)
  if how == "mean":
    out = np.zeros((num_docs, logits.shape[1]))
    np.add.at(out, doc_ids, logits)
    out /= np.maximum(counts, 1)[:, None]
  else:
    out = np.full((num_docs, logits.shape[1]), -np.inf)
    np.maximum.at(out, doc_ids, logits)
    out[counts == 0] = 0.0
  return out, counts > 0
