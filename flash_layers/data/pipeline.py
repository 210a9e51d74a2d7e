"""The grain pipeline: records -> shuffled, sharded, tokenized, fixed-shape (optionally packed) batches.

    records.shuffle(seed).repeat(num_epochs)   global index shuffle, reseeded each epoch
      [process_index::process_count]           this process's share of that one global order
      .batch(tokenize_chunk) .map(encode)      batched tokenization (in worker processes if num_workers)
      -> PackedBatches                         rows of max_len tokens, batch_size rows per batch

Every batch is a dict of int32 numpy arrays:
  input_ids    [batch, max_len]   pad id where there is no token
  segment_ids  [batch, max_len]   1, 2, ... for the documents of a row, 0 for padding
  positions    [batch, max_len]   position within its document (restarting at 0 for each), 0 on padding
  labels       [batch, max_docs]  label of the row's d-th document (segment id d + 1), -1 where none;
               a multi-label or regression task adds a last axis (readers.LabelSpec: a multi-hot
               row, -1 where none, or float32 targets, NaN where none)
               token classification: [batch, max_len], a tag id per token (its word's first
               piece), -1 elsewhere

Without packing a row holds one document (max_docs = 1). Hierarchical documents (`chunks`): a row holds
one document's first `chunks` windows (of max_len tokens each) as its segments 1, 2, ..., positions
restarting in each, so a row is up to chunks * max_len tokens and its one label slot is the document's.
With packing, documents are placed in
order, greedily: a row takes the next document while it fits in max_len and the row has fewer
than max_docs_per_row documents. A long document split into windows gives one "document" per
window, each with the document's label. A final short batch is padded with empty rows (labels
-1) unless drop_remainder.

The iterator's `get_state()` / `set_state()` (grain's DatasetIterator protocol, so grain's
orbax checkpoint handler works too) restore the exact position: a resumed run sees the batches
the uninterrupted run would have seen.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from flash_layers.data.readers import SINGLE, LabelSpec
from flash_layers.data.tokenize import TextTokenizer

# (token ids of one window, its document's label as Records hold it), or for a hierarchical document
# (the ids of its chunks, the label, each token's chunk: 1, 2, ...).
Example = tuple


class _Encode:
  """Tokenize a chunk of records: -> [(window ids, label)], windows of a record in order. Token
  classification ("tags"): the label is per token, the word's tag on its first piece, else -1."""

  def __init__(self, tokenizer: TextTokenizer, kind: str = "single", chunks: int | None = None):
    self.tokenizer = tokenizer
    self.kind = kind
    self.chunks = chunks

  def __call__(self, records: Sequence[dict]) -> list[Example]:
    if self.chunks:  # hierarchical: one example of a document's first `chunks` windows
      windows = self.tokenizer.encode([r["text"] for r in records])
      return [chunked(ws[:self.chunks], r["label"]) for r, ws in zip(records, windows, strict=True)]
    if self.kind == "none":  # masked LM: per token, the id (or -1) and whether it starts a word
      return [w for ws in self.tokenizer.encode_pieces([r["text"] for r in records]) for w in ws]
    if self.kind == "tags":
      windows = self.tokenizer.encode_words([r["text"] for r in records])
      return [(w.ids, token_tags(w.first_word, r["label"])) for r, ws in zip(records, windows, strict=True)
              for w in ws]
    windows = self.tokenizer.encode([r["text"] for r in records])
    return [(w, r["label"]) for r, ws in zip(records, windows, strict=True) for w in ws]


def chunked(windows: Sequence[np.ndarray], label) -> Example:
  """A hierarchical document's example: its windows' ids end to end, its label, each token's chunk."""
  segments = np.concatenate([np.full(len(w), c + 1, np.int32) for c, w in enumerate(windows)])
  return np.concatenate(windows).astype(np.int32), label, segments


def token_tags(word_index: np.ndarray, tags) -> np.ndarray:
  """int32 per token: tags[w] where word_index is w >= 0, -1 elsewhere (tags None: all -1)."""
  if tags is None:
    return np.full(len(word_index), -1, np.int32)
  tags = np.asarray(tags, np.int32)
  return np.where(word_index >= 0, tags[np.maximum(word_index, 0)] if len(tags) else -1, -1).astype(np.int32)


def pack_rows(rows: Sequence[Sequence[Example]], *, batch_size: int, max_len: int, max_docs: int,
              pad_id: int = 0, label_spec: LabelSpec = SINGLE) -> dict[str, np.ndarray]:
  """One batch from rows of examples; missing rows are empty (all padding, labels empty)."""
  if len(rows) > batch_size:
    raise ValueError(f"{len(rows)} rows do not fit in batch_size={batch_size}")
  ids = np.full((batch_size, max_len), pad_id, np.int32)
  seg = np.zeros((batch_size, max_len), np.int32)
  pos = np.zeros((batch_size, max_len), np.int32)
  labels = label_spec.empty(batch_size, max_len if label_spec.per_token else max_docs)
  for r, row in enumerate(rows):
    if len(row) > max_docs:
      raise ValueError(f"row {r} has {len(row)} documents; max_docs={max_docs}")
    start = 0
    for d, (tokens, label, *chunks) in enumerate(row):
      end = start + len(tokens)
      if end > max_len:
        raise ValueError(f"row {r}: documents of {end} tokens exceed max_len={max_len}")
      ids[r, start:end] = tokens
      if chunks:  # a hierarchical document: its chunks are the row's segments
        seg[r, start:end] = chunks[0]
        first = np.r_[0, np.flatnonzero(np.diff(chunks[0])) + 1]
        pos[r, start:end] = np.arange(len(tokens)) - np.repeat(first, np.diff(np.r_[first, len(tokens)]))
      else:
        seg[r, start:end] = d + 1
        pos[r, start:end] = np.arange(len(tokens))
      if label_spec.per_token:
        labels[r, start:end] = -1 if label is None else label
      else:
        labels[r, d] = label_spec.encode(label)
      start = end
  return {"input_ids": ids, "segment_ids": seg, "positions": pos, "labels": labels}


class _PackedBatchesIterator(grain.DatasetIterator):
  """Pulls chunks of examples from the parent and emits fixed-shape batches.

  State: the parent's state before the chunk in progress, and how many of that chunk's examples
  are already in emitted batches. Restoring re-reads that chunk (the parent is deterministic).
  """

  def __init__(self, parent: grain.DatasetIterator, cfg: dict[str, Any]):
    super().__init__(parent)
    self._cfg = cfg
    self._chunk: list[Example] | None = None
    self._chunk_state: dict | None = None
    self._pos = 0
    self._exhausted = False

  def _peek(self) -> Example | None:
    while self._chunk is None or self._pos >= len(self._chunk):
      if self._exhausted:
        return None
      state = copy.deepcopy(self._parent.get_state())
      try:
        self._chunk = next(self._parent)
      except StopIteration:
        self._exhausted, self._chunk = True, None
        return None
      self._chunk_state, self._pos = state, 0
    return self._chunk[self._pos]

  def _next_row(self) -> list[Example]:
    cfg, row, used = self._cfg, [], 0
    while (example := self._peek()) is not None:
      n = len(example[0])
      if n > cfg["max_len"]:
        raise ValueError(f"an example of {n} tokens exceeds max_len={cfg['max_len']}")
      if row and (used + n > cfg["max_len"] or len(row) >= cfg["max_docs"]):
        break
      row.append(example)
      used += n
      self._pos += 1
      if not cfg["pack"]:
        break
    return row

  def __next__(self) -> dict[str, np.ndarray]:
    cfg, rows = self._cfg, []
    while len(rows) < cfg["batch_size"] and (row := self._next_row()):
      rows.append(row)
    if not rows or (cfg["drop_remainder"] and len(rows) < cfg["batch_size"]):
      raise StopIteration
    return pack_rows(rows, batch_size=cfg["batch_size"], max_len=cfg["max_len"],
                     max_docs=cfg["max_docs"], pad_id=cfg["pad_id"], label_spec=cfg["label_spec"])

  def get_state(self) -> dict[str, Any]:
    if self._chunk is None or self._pos >= len(self._chunk):
      return {"parent": copy.deepcopy(self._parent.get_state()), "offset": 0}
    return {"parent": copy.deepcopy(self._chunk_state), "offset": self._pos}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(copy.deepcopy(state["parent"]))
    self._chunk, self._pos, self._exhausted = None, 0, False
    if state["offset"]:
      self._chunk_state = copy.deepcopy(state["parent"])
      self._chunk = next(self._parent)
      self._pos = state["offset"]


class PackedBatches(grain.IterDataset):
  def __init__(self, parent: grain.IterDataset, **cfg):
    super().__init__(parent)
    self._cfg = cfg

  def __iter__(self) -> _PackedBatchesIterator:
    return _PackedBatchesIterator(self._parent.__iter__(), self._cfg)


def _absl_flags_parsed():
  """grain's worker processes read absl flags; outside an absl app nobody parsed them: use defaults."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _check_int(name: str, value, *, minimum: int):
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")


def make_dataset(records: Sequence[dict], tokenizer: TextTokenizer, *, batch_size: int,
                 pack: bool = False, max_docs_per_row: int | None = None, shuffle: bool = True,
                 seed: int = 0, num_epochs: int | None = 1, drop_remainder: bool = False,
                 process_index: int | None = None, process_count: int | None = None,
                 num_workers: int = 0, tokenize_chunk: int = 64,
                 chunks: int | None = None) -> grain.IterDataset:
  """The pipeline as a grain IterDataset (see `make_batches` for the arguments)."""
  if not isinstance(tokenizer, TextTokenizer):
    raise TypeError(f"tokenizer must be a flash_layers.data.TextTokenizer; got {type(tokenizer).__name__}")
  _check_int("batch_size", batch_size, minimum=1)
  _check_int("tokenize_chunk", tokenize_chunk, minimum=1)
  _check_int("num_workers", num_workers, minimum=0)
  if num_epochs is not None:
    _check_int("num_epochs", num_epochs, minimum=1)
  if max_docs_per_row is None:
    max_docs_per_row = 8 if pack else 1
  _check_int("max_docs_per_row", max_docs_per_row, minimum=1)
  if chunks is not None:
    _check_int("chunks", chunks, minimum=1)
    if pack:
      raise ValueError("chunks (hierarchical documents) needs pack=False: a row holds one document's chunks")
  if not pack and max_docs_per_row != 1:
    raise ValueError(f"max_docs_per_row={max_docs_per_row} needs pack=True (a row without packing "
                     "holds one document)")
  if process_index is None or process_count is None:
    import jax  # only for the defaults: a data-only user passes both
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index must be in [0, process_count={process_count}); got {process_index}")
  if len(records) < process_count:
    raise ValueError(f"{len(records)} records cannot be sharded over {process_count} processes")

  # Shuffle the whole dataset, then deal it out: the records of global step n are the same for
  # any number of processes (each takes every process_count-th of one global order).
  ds = grain.MapDataset.source(records)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)[process_index::process_count]
  label_spec = getattr(records, "label_spec", SINGLE)
  ds = ds.batch(tokenize_chunk, batch_fn=list).map(_Encode(tokenizer, label_spec.kind, chunks))
  it = ds.to_iter_dataset()
  if num_workers:
    _absl_flags_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return PackedBatches(it, batch_size=batch_size, max_len=tokenizer.max_len * (chunks or 1),
                       max_docs=max_docs_per_row,
                       pad_id=tokenizer.pad_id, pack=pack, drop_remainder=drop_remainder,
                       label_spec=label_spec)


def make_batches(records: Sequence[dict], tokenizer: TextTokenizer, *, batch_size: int,
                 **options) -> grain.DatasetIterator:
  """An iterator of batches (module docstring) with `get_state()` / `set_state(state)`.

  Args:
    records: {"text", "label"} dicts, e.g. from `flash_layers.data.load`; a `Records` brings its
      `label_spec` (multi-label and regression labels), a plain list has single int labels.
    tokenizer: a TextTokenizer; its max_len is the row length.
    batch_size: rows per batch on this process.
    pack: put several documents in a row (segment ids 1, 2, ...).
    max_docs_per_row: with pack, the most documents in a row (the labels' second dim); default 8.
    shuffle, seed: seeded global shuffle, reseeded each epoch.
    num_epochs: passes over the data; None repeats forever.
    drop_remainder: drop a final short batch instead of padding it with empty rows.
    process_index, process_count: this process takes every process_count-th record of the
      globally shuffled stream, from process_index; default jax.process_index() / jax.process_count().
    num_workers: tokenize in this many worker processes (grain mp_prefetch); 0 = in this process.
      The batches are the same for every num_workers.
    tokenize_chunk: records per tokenizer call.
    chunks: hierarchical documents: a row holds a document's first `chunks` windows as its segments
      (the tokenizer's long_docs must be "windows"; pack=False).
  """
  return iter(make_dataset(records, tokenizer, batch_size=batch_size, **options))
