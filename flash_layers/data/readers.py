"""Readers for labelled text on disk: JSONL, CSV/TSV and a folder-per-class tree of .txt files.

Every reader returns a `Records`: a list of {"text": str, "label": ...} whose labels are of one
`label_kind`:

  "single"  one class per document: the label is an int id into a `LabelVocab`;
  "multi"   a set of classes per document, possibly empty: a JSONL list, or a ";"-separated string
            in CSV/TSV ("" = no label); the label is a sorted tuple of ids;
  "values"  regression targets: a number, or a list of `num` numbers (JSONL), or a number / a
            ";"-separated list of numbers (CSV/TSV); the label is a tuple of floats, and the
            vocabulary names the outputs.
  "tags"    token classification (JSONL only): the text field holds the document's words (a list
            of strings) and the label field one tag per word, "O" or B-/I- plus a type (IOB1 or
            IOB2); the record's "text" is the tuple of words and its label the tuple of tag ids.
  "none"    text only (masked-LM pretraining): a label field, if there is one, is not read; the
            label is None.

The vocabulary comes from the training split and is saved with the model; at eval time it is
passed back in, so that label ids mean the same thing in both runs and a label the model never saw
is an error (naming the file and line) instead of a silent new class -- or, with
unseen_labels="ignore", dropped and counted (`Records.unseen`). A label that cannot be read (a
string for regression, a number where a set is expected) is a DataError naming the document (file
and line) and the field.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from flash_layers.errors import UserError

SPLITS = ("train", "dev", "test")
LABEL_KINDS = ("single", "multi", "values", "tags", "none")
UNSEEN_LABELS = ("error", "ignore")
MULTI_SEPARATOR = ";"  # between the labels of a document in a CSV/TSV cell
FILE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}
_CHOOSE_COLUMNS = ("choose others with text_column= / label_column=; in train.py with "
                   "config.data.text_field / config.data.label_field")


class DataError(UserError, ValueError):
  """Malformed or inconsistent input data; the message names the file (and line where there is one)."""


# ----------------------------------------------------------------------------
# Labels
# ----------------------------------------------------------------------------

def _label_order(label):
  # Integer labels sort numerically (so 10 comes after 9), strings alphabetically after them.
  return (0, label, "") if isinstance(label, int) else (1, 0, str(label))


@dataclasses.dataclass(frozen=True)
class LabelVocab:
  """The label names of a task, in id order. Save it with a checkpoint; pass it back at eval time."""

  names: tuple[Any, ...]

  def __post_init__(self):
    object.__setattr__(self, "names", tuple(self.names))
    if len(set(self.names)) != len(self.names):
      raise ValueError(f"label names must be unique; got {list(self.names)}")
    for name in self.names:
      if isinstance(name, bool) or not isinstance(name, (str, int)):
        raise TypeError(f"labels must be str or int; got {type(name).__name__} {name!r}")

  @classmethod
  def build(cls, labels: Iterable) -> LabelVocab:
    return cls(tuple(sorted(set(labels), key=_label_order)))

  def __len__(self) -> int:
    return len(self.names)

  def index(self, label, *, where: str = "") -> int:
    try:
      return self._ids[label]
    except KeyError:
      raise DataError(f"{where}label {label!r} was not seen in training; known labels: "
                      f"{list(self.names)}") from None

  @property
  def _ids(self) -> dict:
    ids = self.__dict__.get("_ids_cache")
    if ids is None:
      ids = {name: i for i, name in enumerate(self.names)}
      object.__setattr__(self, "_ids_cache", ids)
    return ids

  def save(self, path: str | pathlib.Path) -> None:
    pathlib.Path(path).write_text(json.dumps({"labels": list(self.names)}, indent=1) + "\n")

  @classmethod
  def load(cls, path: str | pathlib.Path) -> LabelVocab:
    path = pathlib.Path(path)
    try:
      data = json.loads(path.read_text(encoding="utf-8"))
      return cls(tuple(data["labels"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise DataError(f"{path}: not a label vocabulary saved by LabelVocab.save ({e})") from None


def as_vocab(label_vocab) -> LabelVocab | None:
  """None, a LabelVocab, a saved vocabulary's path, or a sequence of names -> LabelVocab or None."""
  if label_vocab is None or isinstance(label_vocab, LabelVocab):
    return label_vocab
  if isinstance(label_vocab, (str, pathlib.Path)):
    return LabelVocab.load(label_vocab)
  if isinstance(label_vocab, Sequence):
    return LabelVocab(tuple(label_vocab))
  raise TypeError(f"label_vocab must be a LabelVocab, a path to a saved one, or a list of names; "
                  f"got {type(label_vocab).__name__}")


@dataclasses.dataclass(frozen=True)
class LabelSpec:
  """How one document's label becomes its slot in a batch's `labels` array (pipeline.pack_rows).

  "single": an int32 scalar per slot, -1 = no document / no label. "multi": an int32 multi-hot row
  of `size` classes, all -1 = none. "values": a float32 row of `size` targets, NaN = none.
  "tags": one int32 tag id per token instead of per document ([rows, length]), -1 = not scored.
  "none": per token, int32 [rows, length, 2]: (the token's id, or -1 for a special token or padding;
  1 where it starts a word, else 0): what masked-LM masking draws from (training/objectives.py).
  """

  kind: str = "single"
  size: int = 1

  def __post_init__(self):
    if self.kind not in LABEL_KINDS:
      raise ValueError(f"label kind must be one of {LABEL_KINDS}; got {self.kind!r}")

  @property
  def shape(self) -> tuple[int, ...]:
    if self.kind == "none":
      return (2,)
    return () if self.kind in ("single", "tags") else (self.size,)

  @property
  def per_token(self) -> bool:
    return self.kind in ("tags", "none")

  def empty(self, *leading: int) -> np.ndarray:
    """A labels array of `leading` slots, all empty."""
    if self.kind == "values":
      return np.full((*leading, *self.shape), np.nan, np.float32)
    return np.full((*leading, *self.shape), -1, np.int32)

  def encode(self, label) -> np.ndarray | int:
    """One document's label (as `Records` hold it) -> its slot's value; None -> empty."""
    if label is None:
      return self.empty()
    if self.kind == "single":
      return int(label)
    if self.kind == "multi":
      hot = np.zeros(self.size, np.int32)
      hot[list(label)] = 1
      return hot
    return np.asarray(label, np.float32)


SINGLE = LabelSpec()  # one int class per document


class Records(list):
  """A list of {"text": str, "label": ...} with the task's `vocab` (label or output names), its
  `label_kind` (module doc), `source`, and `unseen`: {label: documents} dropped as unseen."""

  def __init__(self, items: Iterable[dict], *, vocab: LabelVocab, source: str, split: str,
               label_kind: str = "single", unseen: dict | None = None):
    super().__init__(items)
    if label_kind not in LABEL_KINDS:
      raise ValueError(f"label_kind must be one of {LABEL_KINDS}; got {label_kind!r}")
    self.vocab = vocab
    self.source = source
    self.split = split
    self.label_kind = label_kind
    self.unseen = dict(unseen or {})

  @property
  def num_labels(self) -> int:
    return len(self.vocab)

  @property
  def label_spec(self) -> LabelSpec:
    return LabelSpec(self.label_kind, len(self.vocab))

  def __repr__(self) -> str:
    return f"Records({self.source!r}, split={self.split!r}, n={len(self)}, labels={list(self.vocab.names)})"


# ----------------------------------------------------------------------------
# Raw readers: (text, label, where) triples, `where` naming file and line for errors
# ----------------------------------------------------------------------------

def _read_text(path: pathlib.Path) -> str:
  try:
    data = path.read_bytes()
  except OSError as e:
    raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise DataError(f"{path}:{line}: bytes {data[e.start:e.end]!r} are not valid UTF-8 "
                    f"(byte offset {e.start}); re-encode the file as UTF-8") from None


def _check_text(text, where: str) -> str:
  if not isinstance(text, str):
    raise DataError(f"{where}text must be a string; got {type(text).__name__} {text!r:.60}")
  return text


def _check_words(words, where: str, text_column: str) -> tuple[str, ...]:
  if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
    raise DataError(f"{where}field {text_column!r} must be a list of words (strings) for token "
                    f"classification; got {type(words).__name__} {words!r:.60}")
  return tuple(words)


def _read_jsonl(path: pathlib.Path, text_column: str, label_column: str, words: bool = False):
  content = _read_text(path)
  rows = 0
  for lineno, line in enumerate(content.splitlines(), 1):
    if not line.strip():
      continue
    where = f"{path}:{lineno}: "
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{where}not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
      raise DataError(f"{where}each line must be a JSON object; got {type(row).__name__}")
    missing = [c for c in (text_column, label_column) if c is not None and c not in row]
    if missing:
      raise DataError(f"{where}missing column(s) {missing}; the line has {sorted(row)} "
                      f"({_CHOOSE_COLUMNS})")
    rows += 1
    text = row[text_column]
    text = _check_words(text, where, text_column) if words else _check_text(text, where)
    yield text, None if label_column is None else row[label_column], where
  if rows == 0:
    raise DataError(f"{path}: empty file (no records)")


def _read_delimited(path: pathlib.Path, delimiter: str, text_column: str, label_column: str):
  content = _read_text(path)
  reader = csv.DictReader(io.StringIO(content, newline=""), delimiter=delimiter)
  if reader.fieldnames is None:
    raise DataError(f"{path}: empty file (no header line)")
  missing = [c for c in (text_column, label_column) if c is not None and c not in reader.fieldnames]
  if missing:
    raise DataError(f"{path}:1: missing column(s) {missing}; the header has {reader.fieldnames} "
                    f"({_CHOOSE_COLUMNS})")
  rows = 0
  for row in reader:
    where = f"{path}:{reader.line_num}: "
    if row[text_column] is None or (label_column is not None and row[label_column] is None):
      raise DataError(f"{where}row has fewer fields than the header {reader.fieldnames}")
    rows += 1
    yield row[text_column], None if label_column is None else row[label_column], where
  if rows == 0:
    raise DataError(f"{path}: empty file (a header but no records)")


def _read_class_folders(root: pathlib.Path):
  classes = sorted(p for p in root.iterdir() if p.is_dir())
  if not classes:
    raise DataError(f"{root}: no class folders (expected {root}/<label>/*.txt)")
  for folder in classes:
    files = sorted(folder.glob("*.txt"))
    if not files:
      raise DataError(f"{folder}: class folder has no .txt files")
    for path in files:
      text = _read_text(path)
      if not text.strip():
        raise DataError(f"{path}: empty file")
      yield text, folder.name, f"{path}: "


def read_documents(path: str | pathlib.Path, *, text_column: str = "text", words: bool = False) -> list[dict]:
  """The JSON objects of a JSONL file of unlabelled documents, each with a string `text_column`
  (with `words`: a list of strings, for token classification) to predict; DataError naming the file
  and line otherwise."""
  path = pathlib.Path(path)
  rows = []
  for lineno, line in enumerate(_read_text(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if words and isinstance(row, dict) and text_column in row:
      _check_words(row[text_column], f"{path}:{lineno}: ", text_column)
    elif not isinstance(row, dict) or not isinstance(row.get(text_column), str):
      raise DataError(f"{path}:{lineno}: each line must be a JSON object with a string field {text_column!r}")
    rows.append(row)
  if not rows:
    raise DataError(f"{path}: empty file (no documents)")
  return rows


def _raw(path: pathlib.Path, text_column: str, label_column: str, words: bool = False):
  if path.is_dir():
    return _read_class_folders(path)
  kind = FILE_FORMATS.get(path.suffix.lower())
  if kind is None:
    raise DataError(f"{path}: unknown format {path.suffix!r}; expected one of {sorted(FILE_FORMATS)} "
                    "or a folder of <label>/*.txt")
  if words and kind != "jsonl":
    raise DataError(f"{path}: token classification data is JSONL (a list of words and a list of tags per "
                    "line); CSV/TSV cells cannot hold them")
  if kind == "jsonl":
    return _read_jsonl(path, text_column, label_column, words)
  return _read_delimited(path, "," if kind == "csv" else "\t", text_column, label_column)


def split_path(root: pathlib.Path, split: str) -> pathlib.Path:
  """The file or folder holding `split` under a dataset directory, or `root` itself if it is a file."""
  if root.is_file():
    return root
  if not root.exists():
    raise FileNotFoundError(f"{root}: no such file or directory")
  candidates = [root / f"{split}{ext}" for ext in FILE_FORMATS] + [root / split]
  found = [p for p in candidates if p.exists()]
  if len(found) > 1:
    raise DataError(f"{root}: several files for split {split!r}: {[p.name for p in found]}")
  if found:
    return found[0]
  if split == "train" and not any((root / s).exists() for s in SPLITS):
    return root  # a bare folder-per-class tree is the training data
  raise DataError(f"{root}: no data for split {split!r}; expected one of "
                  f"{[p.name for p in candidates]}")


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _class_names(label, kind: str, where: str, label_column: str, *, jsonl: bool) -> list:
  """The raw class names of one document's label ("single": one name; "multi": a list, or a
  ";"-separated CSV/TSV cell)."""
  if kind == "multi":
    if isinstance(label, str) and not jsonl:  # a CSV/TSV cell
      return [part.strip() for part in label.split(MULTI_SEPARATOR) if part.strip()]
    if not isinstance(label, list):
      raise DataError(f"{where}field {label_column!r} must be a list of labels for multi-label data "
                      f"(an empty list for none; in CSV/TSV {MULTI_SEPARATOR!r}-separated); got "
                      f"{type(label).__name__} {label!r:.60}")
    names = label
  else:
    names = [label]
  for name in names:
    if isinstance(name, bool) or not isinstance(name, (str, int)):
      raise DataError(f"{where}field {label_column!r}: a label must be a string or an integer; got "
                      f"{type(name).__name__} {name!r:.60}")
  return names


def _values(label, where: str, label_column: str, *, jsonl: bool) -> tuple[float, ...]:
  """One document's regression targets as floats: a number or a list of numbers (JSONL), or a
  number / ";"-separated numbers (CSV/TSV cells are strings)."""
  if isinstance(label, str) and not jsonl:
    parts = [p.strip() for p in label.split(MULTI_SEPARATOR)]
    try:
      values = [float(p) for p in parts]
    except ValueError:
      raise DataError(f"{where}field {label_column!r} must hold a number (or {MULTI_SEPARATOR!r}-separated "
                      f"numbers) for regression; got {label!r:.60}") from None
  elif _is_number(label):
    values = [label]
  elif isinstance(label, list) and label and all(_is_number(v) for v in label):
    values = label
  else:
    raise DataError(f"{where}field {label_column!r} must be a number or a non-empty "
                    f"list of numbers for regression; got {type(label).__name__} {label!r:.60}")
  values = tuple(float(v) for v in values)
  if not all(math.isfinite(v) for v in values):
    raise DataError(f"{where}field {label_column!r}: regression targets must be "
                    f"finite; got {label!r:.60}")
  return values


def _value_names(label_column: str, count: int) -> tuple[str, ...]:
  return (label_column,) if count == 1 else tuple(f"{label_column}[{i}]" for i in range(count))


def read(path: str | pathlib.Path, *, split: str = "train", label_vocab=None, text_column: str = "text",
         label_column: str = "label", label_kind: str = "single", unseen_labels: str = "error") -> Records:
  """Records of a dataset on disk.

  `path` is a .jsonl/.csv/.tsv file, a folder of <label>/*.txt, or a directory holding
  train/dev/test as such files or folders. Without `label_vocab` the vocabulary is built from
  this split when it is "train", and from the directory's train split otherwise. `label_kind`
  and `unseen_labels` ("error", or "ignore": an unseen class is dropped from a "multi" label set,
  a document whose "single" label is unseen is dropped; both counted in `Records.unseen`) as the
  module doc says.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
  if label_kind not in LABEL_KINDS:
    raise ValueError(f"label_kind must be one of {LABEL_KINDS}; got {label_kind!r}")
  if unseen_labels not in UNSEEN_LABELS:
    raise ValueError(f"unseen_labels must be one of {UNSEEN_LABELS}; got {unseen_labels!r}")
  root = pathlib.Path(path)
  source = split_path(root, split)
  if label_kind not in ("single", "none") and source.is_dir():
    raise DataError(f"{source}: a folder-per-class tree holds one label per document; "
                    f"{label_kind!r} labels need a JSONL, CSV or TSV file")
  vocab = as_vocab(label_vocab)
  jsonl = FILE_FORMATS.get(source.suffix.lower()) == "jsonl"
  raw = list(_raw(source, text_column, None if label_kind == "none" else label_column,
                  words=label_kind == "tags"))
  common = dict(source=str(source), split=split, label_kind=label_kind)
  if label_kind == "none":
    return Records([{"text": text, "label": None} for text, _, _ in raw], vocab=LabelVocab(()), **common)
  if label_kind == "tags":
    return _tagged(raw, root, source, split, vocab, text_column, label_column, unseen_labels, common)
  if label_kind == "values":
    items, count = [], None
    for text, label, where in raw:
      values = _values(label, where, label_column, jsonl=jsonl)
      if count is None:
        count = len(values)
      elif len(values) != count:
        raise DataError(f"{where}field {label_column!r} has {len(values)} values; the documents before it "
                        f"have {count}")
      items.append({"text": text, "label": values})
    names = _value_names(label_column, count)
    if vocab is not None and len(vocab) != count:
      raise DataError(f"{source}: {count} regression targets per document, but the model has "
                      f"{len(vocab)} outputs {list(vocab.names)}")
    return Records(items, vocab=vocab or LabelVocab(names), **common)
  names = [(text, _class_names(label, label_kind, where, label_column, jsonl=jsonl), where)
           for text, label, where in raw]
  if vocab is None:
    if split == "train":
      vocab = LabelVocab.build(n for _, ns, _ in names for n in ns)
    elif root.is_dir() and source != root:
      vocab = read(root, split="train", text_column=text_column, label_column=label_column,
                   label_kind=label_kind).vocab
    else:
      raise DataError(f"{source}: split {split!r} needs the training label vocabulary; pass "
                      "label_vocab= (a LabelVocab, or the path LabelVocab.save wrote)")
  items, unseen = [], {}
  for text, labels, where in names:
    ids = []
    for name in labels:
      if name in vocab._ids:
        ids.append(vocab._ids[name])
      elif unseen_labels == "ignore":
        unseen[name] = unseen.get(name, 0) + 1
      else:
        vocab.index(name, where=f"{where}field {label_column!r}: ")  # raises, naming the label
    if label_kind == "single":
      if ids:
        items.append({"text": text, "label": ids[0]})
    else:
      items.append({"text": text, "label": tuple(sorted(set(ids)))})
  return Records(items, vocab=vocab, unseen=unseen, **common)


def _tag_names(tags, words: tuple, where: str, label_column: str) -> list[str]:
  if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
    raise DataError(f"{where}field {label_column!r} must be a list of tags (strings), one per word; got "
                    f"{type(tags).__name__} {tags!r:.60}")
  if len(tags) != len(words):
    raise DataError(f"{where}field {label_column!r} has {len(tags)} tags but the document has {len(words)} "
                    "words; give one tag per word")
  for i, tag in enumerate(tags):
    if tag != "O" and not (tag[:2] in ("B-", "I-") and len(tag) > 2):
      raise DataError(f"{where}field {label_column!r}: tag {i} is {tag!r}; tags are 'O' or 'B-'/'I-' and a "
                      "type (IOB1 or IOB2, e.g. 'B-PER')")
  return tags


def _tagged(raw, root, source, split, vocab, text_column, label_column, unseen_labels, common) -> Records:
  """Records of token-classification data: ("tags" kind; read's arguments)."""
  rows = [(words, _tag_names(tags, words, where, label_column), where) for words, tags, where in raw]
  if vocab is None:
    if split == "train":
      vocab = LabelVocab.build({"O"} | {t for _, tags, _ in rows for t in tags})
    elif root.is_dir() and source != root:
      vocab = read(root, split="train", text_column=text_column, label_column=label_column,
                   label_kind="tags").vocab
    else:
      raise DataError(f"{source}: split {split!r} needs the training tag vocabulary; pass label_vocab= "
                      "(a LabelVocab, or the path LabelVocab.save wrote)")
  items, unseen = [], {}
  for words, tags, where in rows:
    ids = []
    for tag in tags:
      if tag in vocab._ids:
        ids.append(vocab._ids[tag])
      elif unseen_labels == "ignore" and "O" in vocab._ids:  # read as outside any entity
        unseen[tag] = unseen.get(tag, 0) + 1
        ids.append(vocab._ids["O"])
      else:
        vocab.index(tag, where=f"{where}field {label_column!r}: ")
    items.append({"text": words, "label": tuple(ids)})
  return Records(items, vocab=vocab, unseen=unseen, **common)
