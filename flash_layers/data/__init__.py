"""Document-classification data: readers, built-in datasets, tokenization and the grain pipeline.

    from flash_layers import data
    train = data.load("bbc_news", split="train")          # Records: [{"text", "label"}], .vocab
    tok = data.TextTokenizer("minilm", max_len=512)
    batches = data.make_batches(train, tok, batch_size=8, pack=True, max_docs_per_row=4, seed=0)
    batch = next(batches)      # {"input_ids", "segment_ids", "positions", "labels"}: int32 numpy
    state = batches.get_state()   # ... later: batches.set_state(state)
"""

from __future__ import annotations

import pathlib

from flash_layers.data import bbc, listops
from flash_layers.data.eval_plan import AGGREGATIONS, aggregate_logits, eval_batches, length_buckets
from flash_layers.data.pipeline import make_batches, pack_rows
from flash_layers.data.readers import (
  LABEL_KINDS,
  SPLITS,
  UNSEEN_LABELS,
  DataError,
  LabelSpec,
  LabelVocab,
  Records,
  read,
  read_documents,
)
from flash_layers.data.tokenize import LONG_DOCS, TextTokenizer, listops_tokenizer, load_tokenizer

BUILTIN = ("bbc_news", "listops", *bbc.DERIVED)


def load(name_or_path: str | pathlib.Path, split: str = "train", **options) -> Records:
  """Records {"text": str, "label": int} of a built-in dataset or of files on disk.

  Args:
    name_or_path: "bbc_news", "listops", "bbc_news_regions" (multi-label), "bbc_news_quotes"
      (regression), "bbc_news_places" (token classification), a .jsonl/.csv/.tsv file, a folder of
      <label>/*.txt, or a directory holding the splits as train/dev/test files or folders.
    split: "train", "dev" or "test".
    **options: bbc_news: `seed` (of the fixed split). listops: `num_examples`, `seed`, `cache_dir`.
      Files: `label_vocab` (a LabelVocab, the path of a saved one, or a list of names),
      `text_column`, `label_column`, `label_kind` ("single", "multi" or "values": readers.py),
      `unseen_labels` ("error" or "ignore").
  """
  def check(allowed):
    unknown = sorted(set(options) - set(allowed))
    if unknown:
      raise TypeError(f"load({name_or_path!r}) got unknown option(s) {unknown}; allowed: {sorted(allowed)}")

  if name_or_path == "bbc_news":
    check({"seed"})
    return bbc.load(split, **options)
  if name_or_path == "listops":
    check({"num_examples", "seed", "cache_dir"})
    return listops.load(split, **options)
  if name_or_path in bbc.DERIVED:
    check({"seed"})
    return bbc.load_derived(name_or_path, split, **options)
  check({"label_vocab", "text_column", "label_column", "label_kind", "unseen_labels"})
  if isinstance(name_or_path, str) and not pathlib.Path(name_or_path).exists():
    raise FileNotFoundError(f"dataset must be one of {BUILTIN} or an existing file or folder; "
                            f"got {name_or_path!r}")
  return read(name_or_path, split=split, **options)


__all__ = ["AGGREGATIONS", "BUILTIN", "LABEL_KINDS", "LONG_DOCS", "SPLITS", "UNSEEN_LABELS", "DataError",
           "LabelSpec", "LabelVocab", "Records",
           "TextTokenizer", "aggregate_logits", "eval_batches", "length_buckets", "listops_tokenizer", "load",
           "load_tokenizer", "make_batches", "pack_rows", "read", "read_documents"]
