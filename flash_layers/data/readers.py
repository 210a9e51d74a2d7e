"""Readers for labelled text on disk: JSONL, CSV/TSV and a folder-per-class tree of .txt files.

Every reader returns a `Records`: a list of {"text": str, "label": int} whose labels index a
`LabelVocab`. The vocabulary comes from the training split and is saved with the model; at eval
time it is passed back in, so that label ids mean the same thing in both runs and a label the
model never saw is an error (naming the file and line) instead of a silent new class.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

from flash_layers.errors import UserError

SPLITS = ("train", "dev", "test")
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


class Records(list):
  """A list of {"text": str, "label": int} with the task's `vocab` (label names) and `source`."""

  def __init__(self, items: Iterable[dict], *, vocab: LabelVocab, source: str, split: str):
    super().__init__(items)
    self.vocab = vocab
    self.source = source
    self.split = split

  @property
  def num_labels(self) -> int:
    return len(self.vocab)

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


def _read_jsonl(path: pathlib.Path, text_column: str, label_column: str):
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
    missing = [c for c in (text_column, label_column) if c not in row]
    if missing:
      raise DataError(f"{where}missing column(s) {missing}; the line has {sorted(row)} "
                      f"({_CHOOSE_COLUMNS})")
    rows += 1
    yield _check_text(row[text_column], where), row[label_column], where
  if rows == 0:
    raise DataError(f"{path}: empty file (no records)")


def _read_delimited(path: pathlib.Path, delimiter: str, text_column: str, label_column: str):
  content = _read_text(path)
  reader = csv.DictReader(io.StringIO(content, newline=""), delimiter=delimiter)
  if reader.fieldnames is None:
    raise DataError(f"{path}: empty file (no header line)")
  missing = [c for c in (text_column, label_column) if c not in reader.fieldnames]
  if missing:
    raise DataError(f"{path}:1: missing column(s) {missing}; the header has {reader.fieldnames} "
                    f"({_CHOOSE_COLUMNS})")
  rows = 0
  for row in reader:
    where = f"{path}:{reader.line_num}: "
    if row[text_column] is None or row[label_column] is None:
      raise DataError(f"{where}row has fewer fields than the header {reader.fieldnames}")
    rows += 1
    yield row[text_column], row[label_column], where
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


def read_documents(path: str | pathlib.Path, *, text_column: str = "text") -> list[dict]:
  """The JSON objects of a JSONL file of unlabelled documents, each with a string `text_column`
  (to predict); DataError naming the file and line otherwise."""
  path = pathlib.Path(path)
  rows = []
  for lineno, line in enumerate(_read_text(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get(text_column), str):
      raise DataError(f"{path}:{lineno}: each line must be a JSON object with a string field {text_column!r}")
    rows.append(row)
  if not rows:
    raise DataError(f"{path}: empty file (no documents)")
  return rows


def _raw(path: pathlib.Path, text_column: str, label_column: str):
  if path.is_dir():
    return _read_class_folders(path)
  kind = FILE_FORMATS.get(path.suffix.lower())
  if kind is None:
    raise DataError(f"{path}: unknown format {path.suffix!r}; expected one of {sorted(FILE_FORMATS)} "
                    "or a folder of <label>/*.txt")
  if kind == "jsonl":
    return _read_jsonl(path, text_column, label_column)
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


def read(path: str | pathlib.Path, *, split: str = "train", label_vocab=None, text_column: str = "text",
         label_column: str = "label") -> Records:
  """Records of a dataset on disk.

  `path` is a .jsonl/.csv/.tsv file, a folder of <label>/*.txt, or a directory holding
  train/dev/test as such files or folders. Without `label_vocab` the vocabulary is built from
  this split when it is "train", and from the directory's train split otherwise.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
  root = pathlib.Path(path)
  source = split_path(root, split)
  vocab = as_vocab(label_vocab)
  raw = list(_raw(source, text_column, label_column))
  for _, label, where in raw:
    if isinstance(label, bool) or not isinstance(label, (str, int)):
      raise DataError(f"{where}label must be a string or an integer; got {type(label).__name__} {label!r}")
  if vocab is None:
    if split == "train":
      vocab = LabelVocab.build(label for _, label, _ in raw)
    elif root.is_dir() and source != root:
      vocab = read(root, split="train", text_column=text_column, label_column=label_column).vocab
    else:
      raise DataError(f"{source}: split {split!r} needs the training label vocabulary; pass "
                      "label_vocab= (a LabelVocab, or the path LabelVocab.save wrote)")
  items = [{"text": text, "label": vocab.index(label, where=where)} for text, label, where in raw]
  return Records(items, vocab=vocab, source=str(source), split=split)
