"""Data: readers and their errors, BBC News splits, the ListOps generator, tokenization, the pipeline.

Independent references: a ListOps evaluator written here (a stack machine over the tokens), the
golden token ids of Hugging Face's tokenizer (tests/golden/minilm_golden.npz), and plain Python
bookkeeping of which document's tokens went where.
"""

import collections
import json
import pathlib
import statistics

import numpy as np
import pytest

from flash_layers import data
from flash_layers.data import bbc, listops

GOLDEN = pathlib.Path(__file__).parent / "golden" / "minilm_golden.npz"


# ----------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------

def write(path, text, encoding="utf-8"):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
  return path


def test_jsonl_csv_tsv_and_folders_read_the_same_records(tmp_path):
  rows = [("a cat", "pets"), ("stocks fell, again", "money"), ('say "hi"\tthere', "pets")]
  jsonl = write(tmp_path / "d.jsonl", "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
  csv = write(tmp_path / "d.csv", 'body,y\n"a cat",pets\n"stocks fell, again",money\n'
                                  '"say ""hi""\tthere",pets\n')
  tsv = write(tmp_path / "d.tsv", 'text\tlabel\na cat\tpets\nstocks fell, again\tmoney\n'
                                  '"say ""hi""\tthere"\tpets\n')
  for i, (t, y) in enumerate(rows):
    write(tmp_path / "folders" / y / f"{i:03d}.txt", t)
  want = [{"text": t, "label": {"money": 0, "pets": 1}[y]} for t, y in rows]
  for path, kwargs in ((jsonl, {}), (csv, {"text_column": "body", "label_column": "y"}), (tsv, {})):
    records = data.load(str(path), **kwargs)
    assert list(records) == want, path
    assert records.vocab.names == ("money", "pets") and records.num_labels == 2
  folder = data.load(tmp_path / "folders")
  assert sorted(map(tuple, (r.values() for r in folder))) == sorted(tuple(w.values()) for w in want)


def test_label_vocabulary_is_built_on_train_saved_and_reused(tmp_path):
  write(tmp_path / "train.jsonl", "".join(json.dumps({"text": str(i), "label": y}) + "\n"
                                          for i, y in enumerate([10, 2, 9, 2])))
  write(tmp_path / "dev.jsonl", json.dumps({"text": "x", "label": 9}) + "\n")
  train = data.load(tmp_path, split="train")
  assert train.vocab.names == (2, 9, 10)  # integers sort numerically
  assert [r["label"] for r in train] == [2, 0, 1, 0]
  dev = data.load(tmp_path, split="dev")  # vocabulary from the directory's train split
  assert [r["label"] for r in dev] == [1]
  train.vocab.save(tmp_path / "labels.json")
  other = write(tmp_path / "other.jsonl", json.dumps({"text": "y", "label": 10}) + "\n")
  reloaded = data.load(other, split="test", label_vocab=tmp_path / "labels.json")
  assert list(reloaded) == [{"text": "y", "label": 2}]
  with pytest.raises(data.DataError, match="needs the training label vocabulary"):
    data.load(other, split="test")


def test_unseen_label_at_eval_names_file_and_line(tmp_path):
  vocab = data.LabelVocab(("neg", "pos"))
  path = write(tmp_path / "test.csv", "text,label\ngood,pos\nmeh,neutral\n")
  with pytest.raises(data.DataError,
                     match=r"test\.csv:3: field 'label': label 'neutral' was not seen in training"):
    data.load(path, split="test", label_vocab=vocab)


def test_empty_files_are_errors(tmp_path):
  for name in ("e.jsonl", "e.csv", "h.csv"):
    write(tmp_path / name, "text,label\n" if name == "h.csv" else "")
  with pytest.raises(data.DataError, match=r"e\.jsonl: empty file"):
    data.load(tmp_path / "e.jsonl")
  with pytest.raises(data.DataError, match=r"e\.csv: empty file \(no header"):
    data.load(tmp_path / "e.csv")
  with pytest.raises(data.DataError, match=r"h\.csv: empty file \(a header but no records"):
    data.load(tmp_path / "h.csv")
  write(tmp_path / "f" / "a" / "1.txt", "   \n")
  with pytest.raises(data.DataError, match=r"1\.txt: empty file"):
    data.load(tmp_path / "f")


def test_missing_columns_are_named(tmp_path):
  path = write(tmp_path / "d.csv", "body,label\nhello,x\n")
  with pytest.raises(data.DataError, match=r"d\.csv:1: missing column\(s\) \['text'\].*\['body', 'label'\]"):
    data.load(path)
  path = write(tmp_path / "d.jsonl", json.dumps({"text": "a", "label": 1}) + "\n" +
               json.dumps({"text": "b"}) + "\n")
  with pytest.raises(data.DataError, match=r"d\.jsonl:2: missing column\(s\) \['label'\]"):
    data.load(path)


def test_undecodable_bytes_name_file_and_line(tmp_path):
  path = write(tmp_path / "d.jsonl", b'{"text": "ok", "label": 1}\n{"text": "caf\xe9", "label": 1}\n')
  with pytest.raises(data.DataError, match=r"d\.jsonl:2: bytes b'\\xe9' are not valid UTF-8"):
    data.load(path)
  write(tmp_path / "f" / "a" / "x.txt", b"line one\nline two\n\xff\xfe")
  with pytest.raises(data.DataError, match=r"x\.txt:3: bytes"):
    data.load(tmp_path / "f")


def test_other_reader_errors(tmp_path):
  with pytest.raises(data.DataError, match="not valid JSON"):
    data.load(write(tmp_path / "bad.jsonl", '{"text": "a", "label": 1}\n{"text": \n'))
  with pytest.raises(data.DataError, match="label must be a string or an integer"):
    data.load(write(tmp_path / "float.jsonl", json.dumps({"text": "a", "label": 0.5}) + "\n"))
  with pytest.raises(data.DataError, match="unknown format '.parquet'"):
    data.load(write(tmp_path / "d.parquet", "x"))
  with pytest.raises(FileNotFoundError, match="bbc_news"):
    data.load("bbc-news")
  with pytest.raises(ValueError, match="split must be one of"):
    data.load(tmp_path / "float.jsonl", split="validation")
  with pytest.raises(TypeError, match=r"unknown option\(s\) \['num_examples'\]"):
    data.load(tmp_path / "float.jsonl", num_examples=3)
  (tmp_path / "splits").mkdir()
  with pytest.raises(data.DataError, match="no data for split 'dev'"):
    data.load(tmp_path / "splits", split="dev")


def test_documents_to_predict_and_their_errors(tmp_path):
  path = write(tmp_path / "p.jsonl", '{"id": 7, "text": "one"}\n\n{"text": "two"}\n')
  assert data.read_documents(path) == [{"id": 7, "text": "one"}, {"text": "two"}]
  write(tmp_path / "q.jsonl", '{"body": "x"}\n')
  assert data.read_documents(tmp_path / "q.jsonl", text_column="body") == [{"body": "x"}]
  with pytest.raises(data.DataError, match=r"q\.jsonl:1: .*string field 'text'"):
    data.read_documents(tmp_path / "q.jsonl")
  with pytest.raises(data.DataError, match=r"r\.jsonl:2: not valid JSON"):
    data.read_documents(write(tmp_path / "r.jsonl", '{"text": "a"}\n{"text": \n'))
  with pytest.raises(data.DataError, match=r"s\.jsonl: empty file"):
    data.read_documents(write(tmp_path / "s.jsonl", "\n"))
  with pytest.raises(data.DataError, match=r"absent\.jsonl: cannot read"):
    data.read_documents(tmp_path / "absent.jsonl")
  with pytest.raises(data.DataError, match=r"tokenizer\.json: not a Hugging Face tokenizers file"):
    data.load_tokenizer(write(tmp_path / "tokenizer.json", "{}"))


# ----------------------------------------------------------------------------
# BBC News
# ----------------------------------------------------------------------------

def test_bbc_news_has_2127_unique_texts_in_disjoint_stratified_splits():
  splits = {s: data.load("bbc_news", split=s) for s in data.SPLITS}
  texts = {s: [r["text"] for r in recs] for s, recs in splits.items()}
  assert sum(map(len, texts.values())) == 2127
  assert len(set().union(*map(set, texts.values()))) == 2127  # unique, so no text in two splits
  files = sorted(bbc.data_dir().glob("*/*.txt"))
  assert len(files) == 2225
  assert len({f.read_bytes() for f in files}) == 2127
  vocab = splits["train"].vocab
  assert vocab.names == ("business", "entertainment", "politics", "sports", "tech")
  counts = {s: collections.Counter(r["label"] for r in recs) for s, recs in splits.items()}
  for label in range(5):
    total = sum(counts[s][label] for s in data.SPLITS)
    for split, fraction in bbc.FRACTIONS.items():
      assert abs(counts[split][label] - fraction * total) <= 1, (split, label)
  # Fixed: the same call gives the same split.
  assert [r["text"] for r in bbc.load("dev")] == texts["dev"]


# ----------------------------------------------------------------------------
# ListOps
# ----------------------------------------------------------------------------

def evaluate_listops(text):
  """Independent evaluator: a stack machine over the LRA tokens; also checks the tree's shape."""
  ops = {"[MIN": min, "[MAX": max, "[MED": lambda v: int(statistics.median(v)),
         "[SM": lambda v: sum(v) % 10}
  stack, depth, max_depth = [], 0, 0
  for token in text.split():
    if token in ops:
      stack.append((token, []))
      depth += 1
      max_depth = max(max_depth, depth)
    elif token == "]":
      op, args = stack.pop()
      assert 2 <= len(args) <= 10, (op, args)
      value = ops[op](args)
      depth -= 1
      if not stack:
        return value, max_depth
      stack[-1][1].append(value)
    else:
      assert token in "0123456789" and len(token) == 1
      stack[-1][1].append(int(token))
  raise AssertionError("unbalanced expression")


def test_listops_labels_agree_with_an_independent_evaluator(tmp_path):
  records = data.load("listops", split="train", num_examples=40, seed=3, cache_dir=tmp_path)
  assert len(records) == 40 and records.num_labels == 10
  for r in records:
    n = len(r["text"].split())
    assert 500 < n < 2000
    value, depth = evaluate_listops(r["text"])
    assert r["label"] == value
    assert depth <= listops.MAX_DEPTH - 1  # operators sit above depth 10, where only digits are
  assert evaluate_listops("[MAX 2 9 [MIN 4 7 ] 0 ]") == (9, 2)
  assert evaluate_listops("[MED 1 2 3 8 ]") == (2, 1)  # median 2.5, truncated
  assert listops.apply_op("MED", [1, 2, 3, 8]) == 2 and listops.apply_op("SM", [9, 9, 5]) == 3


def test_listops_is_deterministic_and_cached(tmp_path):
  a = data.load("listops", split="dev", num_examples=5, seed=1, cache_dir=tmp_path / "a")
  b = data.load("listops", split="dev", num_examples=5, seed=1, cache_dir=tmp_path / "b")
  assert list(a) == list(b)
  assert list(data.load("listops", split="dev", num_examples=5, seed=2, cache_dir=tmp_path / "a")) != list(a)
  assert list(data.load("listops", split="test", num_examples=5, seed=1, cache_dir=tmp_path / "a")) != list(a)
  # The second load reads the cache file: proven by editing it.
  path = pathlib.Path(a.source)
  lines = path.read_text().splitlines()
  path.write_text("\n".join([json.dumps({"text": "[SM 1 2 ]", "label": 3})] + lines[1:]) + "\n")
  again = data.load("listops", split="dev", num_examples=5, seed=1, cache_dir=tmp_path / "a")
  assert again[0] == {"text": "[SM 1 2 ]", "label": 3} and list(again)[1:] == list(a)[1:]


# ----------------------------------------------------------------------------
# Tokenization
# ----------------------------------------------------------------------------

def test_minilm_tokenizer_matches_hugging_face_ids():
  golden = np.load(GOLDEN)
  tok = data.TextTokenizer("minilm", max_len=128)
  for ids, row, mask in zip(tok.encode(list(golden["texts"])), golden["input_ids"], golden["attention_mask"],
                            strict=True):
    assert len(ids) == 1
    np.testing.assert_array_equal(ids[0], row[:mask.sum()])


def test_long_documents_truncate_or_split_into_windows():
  text = " ".join(str(i % 10) for i in range(30))
  trunc = data.TextTokenizer("listops", max_len=12).encode([text])[0]
  assert len(trunc) == 1 and len(trunc[0]) == 12
  windows = data.TextTokenizer("listops", max_len=12, long_docs="windows", stride=3).encode([text])[0]
  body = [w[1:-1] for w in windows]  # drop [CLS] ... [SEP]
  assert all(w[0] == 2 and w[-1] == 3 and len(w) <= 12 for w in windows)
  rebuilt = list(body[0])
  for prev, cur in zip(body, body[1:], strict=False):
    np.testing.assert_array_equal(cur[:3], prev[-3:])  # consecutive windows share `stride` tokens
    rebuilt += list(cur[3:])
  digit_ids = [5 + i % 10 for i in range(30)]  # listops vocab: the digits follow the 5 specials
  assert rebuilt == digit_ids
  with pytest.raises(ValueError, match="long_docs must be one of"):
    data.TextTokenizer("listops", max_len=12, long_docs="chunks")
  with pytest.raises(ValueError, match="stride must be in"):
    data.TextTokenizer("listops", max_len=12, long_docs="windows", stride=10)


# ----------------------------------------------------------------------------
# The pipeline
# ----------------------------------------------------------------------------

def short_records(n=90, seed=0):
  """ListOps-vocabulary texts of 1-20 digits: word i of record r is a known token."""
  rng = np.random.default_rng(seed)
  return [{"text": " ".join(str(d) for d in rng.integers(0, 10, size=rng.integers(1, 21))),
           "label": int(rng.integers(0, 7))} for _ in range(n)]


def documents_in(batches):
  """Every document of every batch as (tokens, label), checking the row layout on the way."""
  docs = []
  for batch in batches:
    assert {k: (v.dtype, v.ndim) for k, v in batch.items()} == {
        "input_ids": (np.int32, 2), "segment_ids": (np.int32, 2), "positions": (np.int32, 2),
        "labels": (np.int32, 2)}
    for ids, seg, pos, labels in zip(batch["input_ids"], batch["segment_ids"], batch["positions"],
                                     batch["labels"], strict=True):
      n_docs = int(seg.max())
      assert list(labels[n_docs:]) == [-1] * (len(labels) - n_docs)
      used = int((seg > 0).sum())
      assert (seg[:used] > 0).all() and (seg[used:] == 0).all() and (ids[used:] == 0).all()
      assert (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all()  # 1, 1, 2, 2, 3 ...
      for d in range(1, n_docs + 1):
        tokens = ids[seg == d]
        np.testing.assert_array_equal(pos[seg == d], np.arange(len(tokens)))
        assert labels[d - 1] >= 0
        docs.append((tuple(tokens), int(labels[d - 1])))
  return docs


@pytest.mark.parametrize("pack", [False, True])
def test_every_token_of_every_document_lands_once(pack):
  records = short_records()
  tok = data.TextTokenizer("listops", max_len=32)
  max_docs = 5 if pack else 1
  batches = list(data.make_batches(records, tok, batch_size=4, pack=pack, max_docs_per_row=max_docs if pack
                                   else None, seed=7, process_index=0, process_count=1, tokenize_chunk=16))
  encoded = tok.encode([r["text"] for r in records])
  want = collections.Counter((tuple(w[0]), r["label"]) for w, r in zip(encoded, records, strict=True))
  assert collections.Counter(documents_in(batches)) == want
  assert batches[0]["labels"].shape == (4, max_docs)
  rows = [(int(seg.max()), int((seg > 0).sum()), int((seg == 1).sum()))  # (docs, tokens, first doc's)
          for b in batches for seg in b["segment_ids"] if seg.max() > 0]
  assert len(rows) == (len(records) if not pack else len(rows))
  if pack:
    assert len(rows) < 0.6 * len(records)  # 1-20 digit documents: often several to a 32-token row
    # Greedy in order: a row ends only when the next document does not fit in it.
    for (docs, used, _), (_, _, next_first) in zip(rows, rows[1:], strict=False):
      assert docs == max_docs or used + next_first > 32


def test_shuffling_is_seeded_and_sharding_splits_the_records():
  records = short_records(60)
  tok = data.TextTokenizer("listops", max_len=32)
  run = lambda **kw: documents_in(data.make_batches(records, tok, batch_size=3, **kw))
  base = dict(process_index=0, process_count=1)
  assert run(seed=1, **base) == run(seed=1, **base)
  assert run(seed=1, **base) != run(seed=2, **base)
  assert run(shuffle=False, **base) == [(tuple(w[0]), r["label"]) for w, r in
                                        zip(tok.encode([r["text"] for r in records]), records, strict=True)]
  shards = [run(seed=1, process_index=i, process_count=3) for i in range(3)]
  assert all(len(s) == 20 for s in shards)
  # One global shuffle dealt out: process i holds documents i, i + 3, ... of the 1-process order,
  # so a global batch holds the same documents for any number of processes.
  single = run(seed=1, **base)
  assert [s for i in range(3) for s in shards[i]] != single
  assert all(shards[i] == single[i::3] for i in range(3))


def test_windows_become_documents_with_the_label():
  records = [{"text": " ".join(["7"] * 25), "label": 4}, {"text": "1 2", "label": 1}]
  tok = data.TextTokenizer("listops", max_len=12, long_docs="windows", stride=2)
  docs = documents_in(data.make_batches(records, tok, batch_size=2, shuffle=False, process_index=0,
                                        process_count=1))
  assert [label for _, label in docs] == [4, 4, 4, 1]


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("pack", [False, True])
def test_restored_iterator_yields_the_same_following_batches(pack):
  records = short_records(50)
  tok = data.TextTokenizer("listops", max_len=32)
  make = lambda: data.make_batches(records, tok, batch_size=3, pack=pack, seed=5, num_epochs=None,
                                   process_index=0, process_count=1, tokenize_chunk=7)
  it = make()
  for skip in (1, 3, 7, 20):  # mid-chunk, chunk boundaries and past the first epoch
    take(it, skip)
    state = json.loads(json.dumps(it.get_state()))  # states survive a JSON round trip
    want = take(it, 6)
    fresh = make()
    fresh.set_state(state)
    assert_same_batches(take(fresh, 6), want)
    it.set_state(state)  # and the same iterator can rewind
    assert_same_batches(take(it, 6), want)


def test_worker_processes_give_the_same_batches():
  records = short_records(40)
  tok = data.TextTokenizer("listops", max_len=32)
  make = lambda workers: data.make_batches(records, tok, batch_size=4, pack=True, seed=3, num_epochs=1,
                                           process_index=0, process_count=1, tokenize_chunk=8,
                                           num_workers=workers)
  inline = list(make(0))
  it = make(2)
  try:
    assert_same_batches(list(it), inline)
  finally:
    it.close()


def test_pipeline_argument_errors():
  tok = data.TextTokenizer("listops", max_len=32)
  records = short_records(4)
  with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
    data.make_batches(records, tok, batch_size=0)
  with pytest.raises(ValueError, match="needs pack=True"):
    data.make_batches(records, tok, batch_size=2, max_docs_per_row=3)
  with pytest.raises(ValueError, match="process_index must be in"):
    data.make_batches(records, tok, batch_size=2, process_index=2, process_count=2)
  with pytest.raises(TypeError, match="TextTokenizer"):
    data.make_batches(records, "listops", batch_size=2)


# ----------------------------------------------------------------------------
# Evaluation batches: every document once, bucketed by length
# ----------------------------------------------------------------------------

def test_length_buckets_are_a_short_ladder_ending_at_max_len():
  assert data.length_buckets(512) == (128, 256, 384, 512)
  assert data.length_buckets(4096)[-5:] == (2048, 2560, 3072, 3584, 4096)
  assert data.length_buckets(8192, granule=512) == (512, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120,
                                                    6144, 7168, 8192)
  assert data.length_buckets(32) == (32,)
  for max_len in (300, 4096, 10000):
    ladder = data.length_buckets(max_len)
    assert all(b / a <= 2 for a, b in zip(ladder, ladder[1:], strict=False)) and ladder[-1] == max_len


@pytest.mark.parametrize("pack", [False, True])
def test_eval_batches_hold_every_window_once_with_its_document(pack):
  records = short_records(70, seed=3) + [{"text": " ".join(["7"] * 45), "label": 2}]
  tok = data.TextTokenizer("listops", max_len=32, long_docs="windows", stride=2)
  texts, labels = [r["text"] for r in records], [r["label"] for r in records]
  batches = data.eval_batches(texts, labels, tok, batch_size=4, max_docs_per_row=3, pack=pack,
                              buckets=(8, 16, 32))
  want = collections.Counter((d, tuple(w)) for d, ws in enumerate(tok.encode(texts)) for w in ws)
  assert max(want.values()) == 1 and sum(n for (d, _), n in want.items() if d == 70) == 2  # 2 windows
  got = collections.Counter()
  for batch in batches:
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] in (8, 16, 32)
    doc_ids = batch.pop("doc_ids")
    layout = documents_in([batch])  # also checks segment ids, positions and labels
    slots = [(r, d) for r in range(4) for d in range(doc_ids.shape[1]) if doc_ids[r, d] >= 0]
    assert len(slots) == len(layout)
    for (r, d), (tokens, label) in zip(slots, layout, strict=True):
      assert label == labels[doc_ids[r, d]]
      got[(int(doc_ids[r, d]), tokens)] += 1
    # The bucket is the smallest that holds the batch's longest row.
    longest = int((batch["segment_ids"] > 0).sum(axis=1).max())
    assert batch["input_ids"].shape[1] == min(b for b in (8, 16, 32) if b >= longest)
  assert got == want
  fraction = data.eval_plan.real_token_fraction(batches)
  padded = sum(len(w) for _, w in want) / (32 * -(-len(want) // 4) * 4)  # one window per max_len row
  assert fraction > padded + 0.2


def test_rows_per_batch_shrinks_for_rows_longer_than_row_tokens():
  rows = data.eval_plan.rows_per_batch
  assert [rows(n, batch_size=8, row_tokens=512) for n in (128, 512, 640, 1024, 1280, 4096, 9000)] == [
      8, 8, 6, 4, 3, 1, 1]
  by_four = [rows(n, batch_size=8, row_tokens=512, row_multiple=4) for n in (512, 640, 1024, 4096)]
  assert by_four == [8, 4, 4, 4]
  assert rows(4096, batch_size=8, row_tokens=None) == 8
  with pytest.raises(ValueError, match="multiple of row_multiple=3"):
    rows(64, batch_size=8, row_tokens=16, row_multiple=3)


def test_eval_batches_give_a_long_tail_small_batches_and_keep_short_documents_short():
  # 60 short documents (3-22 tokens) and a tail of long ones: one of 64 tokens (a bucket of its
  # own), then 30, 26 and 22.
  records = short_records(60, seed=5) + [{"text": " ".join(["3"] * n), "label": 1} for n in (62, 28, 24, 20)]
  tok = data.TextTokenizer("listops", max_len=64)
  texts, labels = [r["text"] for r in records], [r["label"] for r in records]
  want = collections.Counter((tuple(w[0]), label) for w, label in zip(tok.encode(texts), labels, strict=True))
  kw = dict(batch_size=4, max_docs_per_row=3, buckets=(8, 16, 32, 64))
  small = data.eval_batches(texts, labels, tok, row_tokens=16, **kw)
  full = data.eval_batches(texts, labels, tok, row_tokens=None, **kw)
  for batches in (small, full):
    for b in batches:
      b.pop("doc_ids")
    assert collections.Counter(documents_in(batches)) == want
  shapes = [b["input_ids"].shape for b in small]
  assert shapes[0] == (1, 64) and shapes[1] == (2, 32)  # 4 * 16 slots: one row of 64, two of 32
  assert all(rows == 4 for rows, n in shapes if n <= 16)
  assert all(rows * n <= max(4 * 16, n) for rows, n in shapes)
  # Fixed batch_size rows put three more rows of short documents next to the 64-token one, where
  # attention spans 64 keys; with the budget, no document under 33 tokens is in a 64-token row.
  def in_long_rows(batches):
    return sorted(int((seg == d).sum()) for b in batches if b["segment_ids"].shape[1] == 64
                  for seg in b["segment_ids"] for d in range(1, seg.max() + 1))
  assert in_long_rows(small) == [64]
  assert full[0]["input_ids"].shape == (4, 64) and len(in_long_rows(full)) > 4
  assert sum(b["segment_ids"].size for b in small) < sum(b["segment_ids"].size for b in full)


@pytest.mark.parametrize("row_tokens", [512, 16])
def test_eval_batches_split_one_global_plan_between_processes(row_tokens):
  records = short_records(41, seed=4)
  tok = data.TextTokenizer("listops", max_len=32)
  args = ([r["text"] for r in records], [r["label"] for r in records], tok)
  kw = dict(batch_size=6, buckets=(16, 32), row_tokens=row_tokens)
  single = data.eval_batches(*args, row_multiple=3, **kw)
  shards = [data.eval_batches(*args, process_index=i, process_count=3, **kw) for i in range(3)]
  assert all(len(s) == len(single) for s in shards)
  # With 16-token rows as the budget, 32-token rows come 6 * 16 // 32 = 3 (one per process) to a batch.
  assert {b["input_ids"].shape[0] for b in single if b["input_ids"].shape[1] == 32} == {
      6 if row_tokens == 512 else 3}
  for step, batch in enumerate(single):
    for key, value in batch.items():
      np.testing.assert_array_equal(np.concatenate([s[step][key] for s in shards]), value)


def test_aggregate_logits_mean_and_max_per_document():
  logits = np.array([[[1.0, 0.0], [0.0, 4.0]], [[3.0, -2.0], [9.0, 9.0]]])  # [rows, slots, classes]
  doc_ids = np.array([[0, 2], [0, -1]])
  mean, seen = data.aggregate_logits(logits, doc_ids, 4, "mean")
  np.testing.assert_allclose(mean, [[2.0, -1.0], [0.0, 0.0], [0.0, 4.0], [0.0, 0.0]])
  np.testing.assert_array_equal(seen, [True, False, True, False])
  high, _ = data.aggregate_logits(logits, doc_ids, 4, "max")
  np.testing.assert_allclose(high[[0, 2]], [[3.0, 0.0], [0.0, 4.0]])
  with pytest.raises(ValueError, match="window_aggregation must be one of"):
    data.aggregate_logits(logits, doc_ids, 4, "median")
