"""ListOps (Nangia & Bowman 2018) as the Long Range Arena uses it (Tay et al. 2020), from the spec.

A sample is a random expression tree over the digits 0-9 with the operators
  MIN, MAX, MED (the median, truncated to an int) and SM (sum modulo 10),
each taking 2-10 arguments. Below depth 10 a node is a digit with probability 0.75, else an
operator; at depth 10 it is always a digit. Samples are kept when 500 < tokens < 2000, where the
text is in LRA's token form, e.g. `[MAX 2 9 [MIN 4 7 ] 0 ]` (an operator and its closing bracket
are a token each). The label is the expression's value: 10 classes.

Generation is deterministic for a seed (Python's `random.Random`, whose sequence is fixed across
platforms and versions) and cached as JSONL after the first time.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import statistics

from flash_layers.data.readers import SPLITS, LabelVocab, Records

OPERATORS = ("MIN", "MAX", "MED", "SM")
MAX_DEPTH = 10
MAX_ARGS = 10
DIGIT_PROB = 0.75
MIN_TOKENS, MAX_TOKENS = 500, 2000  # exclusive bounds, as in LRA
DEFAULT_NUM_EXAMPLES = {"train": 96_000, "dev": 2_000, "test": 2_000}  # LRA's sizes
CACHE_VERSION = 1  # bump when generation changes, so stale caches are not read


def apply_op(op: str, values: list[int]) -> int:
  if op == "MIN":
    return min(values)
  if op == "MAX":
    return max(values)
  if op == "MED":
    return int(statistics.median(values))
  if op == "SM":
    return sum(values) % 10
  raise ValueError(f"operator must be one of {OPERATORS}; got {op!r}")


class _TooLong(Exception):
  pass


def _tree(rng: random.Random, depth: int, tokens: list[str], force_op: bool = False) -> int:
  """Appends one node's tokens; returns its value. Raises _TooLong past MAX_TOKENS."""
  if len(tokens) >= MAX_TOKENS:
    raise _TooLong
  if not force_op and (depth >= MAX_DEPTH or rng.random() < DIGIT_PROB):
    digit = rng.randrange(10)
    tokens.append(str(digit))
    return digit
  op = rng.choice(OPERATORS)
  tokens.append("[" + op)
  values = [_tree(rng, depth + 1, tokens) for _ in range(rng.randint(2, MAX_ARGS))]
  tokens.append("]")
  return apply_op(op, values)


def generate(num_examples: int, seed: int) -> list[dict]:
  """`num_examples` samples {"text", "label"} with MIN_TOKENS < tokens < MAX_TOKENS.

  The root is always an operator: a digit root is one token and would be rejected anyway, so
  this keeps the distribution of accepted samples and saves most of the rejections.
  """
  rng = random.Random(seed)
  out = []
  while len(out) < num_examples:
    tokens: list[str] = []
    try:
      value = _tree(rng, 1, tokens, force_op=True)
    except _TooLong:
      continue
    if MIN_TOKENS < len(tokens) < MAX_TOKENS:
      out.append({"text": " ".join(tokens), "label": value})
  return out


def default_cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("FLASH_LAYERS_CACHE", "~/.cache/flash_layers")).expanduser()


def _split_seed(seed: int, split: str) -> int:
  return seed * len(SPLITS) + SPLITS.index(split)


def load(split: str = "train", *, num_examples: int | None = None, seed: int = 0,
         cache_dir: str | pathlib.Path | None = None) -> Records:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
  n = DEFAULT_NUM_EXAMPLES[split] if num_examples is None else num_examples
  if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
    raise ValueError(f"num_examples must be a positive int; got {num_examples!r}")
  cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
  path = cache / f"listops-v{CACHE_VERSION}-{split}-seed{seed}-n{n}.jsonl"
  if path.exists():
    rows = [json.loads(line) for line in path.read_text().splitlines()]
  else:
    rows = generate(n, _split_seed(seed, split))
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)  # atomic: a concurrent reader sees all of it or none
  vocab = LabelVocab(tuple(range(10)))
  return Records(rows, vocab=vocab, source=str(path), split=split)
