"""Text -> token ids with the Hugging Face `tokenizers` library, one or several windows per document.

A checkpoint's tokenizer.json often turns padding on (all-MiniLM-L6-v2's pads every text to 128);
we turn it off and pad in the batcher, which also packs several documents into one row. Long
documents are either truncated to `max_len` tokens or split into windows of `max_len` tokens that
overlap by `stride`; every window keeps the [CLS] ... [SEP] frame of the checkpoint's template.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import tokenizers

from flash_layers.data.readers import DataError
from flash_layers.models import assets

LONG_DOCS = ("truncate", "windows")


class WordWindow(NamedTuple):
  """One window of a pre-split document (`TextTokenizer.encode_words`), int32 arrays of its tokens:
  ids; first_word: w where the token is word w's first piece, else -1 (specials, later pieces, and
  a word's pieces cut off from its first by the window's start); central_word: w where the token is
  word w's first piece and this window is the one where that piece is most central (the window a
  word is predicted from: each word in exactly one window), else -1."""

  ids: np.ndarray
  first_word: np.ndarray
  central_word: np.ndarray


def listops_tokenizer() -> tokenizers.Tokenizer:
  """A word-level tokenizer for ListOps texts: specials, the 10 digits, 4 operators and "]"."""
  specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
  words = specials + [str(d) for d in range(10)] + ["[MIN", "[MAX", "[MED", "[SM", "]"]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                         unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
  return tok


def load_tokenizer(name_or_path: str | pathlib.Path) -> tokenizers.Tokenizer:
  """"minilm", "listops", a tokenizer.json file, or a directory that holds one."""
  if name_or_path == "listops":
    return listops_tokenizer()
  path = assets.checkpoint_dir(name_or_path)
  if path.is_dir():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise FileNotFoundError(f"tokenizer must be 'minilm', 'listops', a tokenizer.json or a directory "
                            f"holding one; {path} does not exist")
  try:
    return tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # the Rust library raises a bare Exception for any malformed file
    raise DataError(f"{path}: not a Hugging Face tokenizers file ({str(e).splitlines()[0][:200]})") from None


class TextTokenizer:
  """Batched encoding to int32 windows of at most `max_len` tokens, specials included.

  Args:
    tokenizer: a `tokenizers.Tokenizer`, or anything `load_tokenizer` takes.
    max_len: tokens per window, [CLS] and [SEP] included.
    long_docs: "truncate" keeps the first window; "windows" keeps them all.
    stride: tokens shared by consecutive windows ("windows" only).
  """

  def __init__(self, tokenizer, *, max_len: int, long_docs: str = "truncate", stride: int = 0):
    if not isinstance(tokenizer, tokenizers.Tokenizer):
      tokenizer = load_tokenizer(tokenizer)
    if long_docs not in LONG_DOCS:
      raise ValueError(f"long_docs must be one of {LONG_DOCS}; got {long_docs!r}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 3:
      raise ValueError(f"max_len must be an int >= 3 (room for [CLS] x [SEP]); got {max_len!r}")
    specials = tokenizer.num_special_tokens_to_add(is_pair=False)
    if not 0 <= stride < max_len - specials:
      raise ValueError(f"stride must be in [0, max_len - {specials}) = [0, {max_len - specials}); "
                       f"got {stride}")
    self.tokenizer = tokenizer
    self.max_len = max_len
    self.long_docs = long_docs
    self.stride = stride
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_len, stride=stride if long_docs == "windows" else 0)
    pad_id = tokenizer.token_to_id("[PAD]")
    self.pad_id = 0 if pad_id is None else pad_id
    self.vocab_size = tokenizer.get_vocab_size()

  def encode(self, texts: Sequence[str]) -> list[list[np.ndarray]]:
    """For each text its windows (just one with "truncate"), each an int32 array."""
    if isinstance(texts, str):
      raise TypeError("texts must be a sequence of strings, not one string")
    out = []
    for enc in self.tokenizer.encode_batch(list(texts)):
      windows = [enc] + (list(enc.overflowing) if self.long_docs == "windows" else [])
      out.append([np.asarray(w.ids, dtype=np.int32) for w in windows])
    return out

  def encode_pieces(self, texts: Sequence[str]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """`encode`, each window with its int32 [n, 2] table for masked-LM masking: the token id, or -1
    for a special token; 1 where the token starts a word (the pre-tokenizer's words), else 0."""
    if isinstance(texts, str):
      raise TypeError("texts must be a sequence of strings, not one string")
    out = []
    for enc in self.tokenizer.encode_batch(list(texts)):
      windows = [enc] + (list(enc.overflowing) if self.long_docs == "windows" else [])
      pieces = []
      for w in windows:
        ids = np.asarray(w.ids, np.int32)
        special = np.asarray(w.special_tokens_mask, bool)
        words = [-1 if x is None else x for x in w.word_ids]
        starts = np.asarray([i == 0 or words[i] != words[i - 1] for i in range(len(words))], np.int32)
        table = np.stack([np.where(special, -1, ids), starts * ~special], axis=-1)
        pieces.append((ids, table.astype(np.int32)))
      out.append(pieces)
    return out

  def _specials(self) -> tuple[list[int], list[int]]:
    """The template's special tokens before and after a single text ([CLS], [SEP] for BERT)."""
    enc = self.tokenizer.encode(["x"], is_pretokenized=True)
    inside = enc.word_ids.index(0)
    return enc.ids[:inside], enc.ids[inside + 1:]

  def encode_words(self, documents: Sequence[Sequence[str]]) -> list[list[WordWindow]]:
    """For each pre-split document (a list of words), its windows of at most max_len tokens (one
    with "truncate"; with "windows", as many as cover it, consecutive ones sharing `stride` tokens),
    each framed by the template's specials, with every word's first piece located (`WordWindow`).
    A word the tokenizer turns into no piece, or one past a truncated window, is in no window."""
    if not hasattr(self, "_whole"):  # the same tokenizer without truncation: windows are cut here
      self._whole = tokenizers.Tokenizer.from_str(self.tokenizer.to_str())
      self._whole.no_truncation()
      self._frame = self._specials()
    before, after = self._frame
    room = self.max_len - len(before) - len(after)
    step = room - self.stride if self.long_docs == "windows" else room
    out = []
    encodings = self._whole.encode_batch([list(d) for d in documents], is_pretokenized=True,
                                         add_special_tokens=False)
    for enc in encodings:
      ids = np.asarray(enc.ids, np.int32)
      word_of = np.asarray([-1 if w is None else w for w in enc.word_ids], np.int64)
      first = np.full(len(ids), -1, np.int64)
      seen = set()
      for i, w in enumerate(word_of):
        if w >= 0 and w not in seen:
          seen.add(w)
          first[i] = w
      starts = [0]
      if self.long_docs == "windows":
        while starts[-1] + room < len(ids):
          starts.append(starts[-1] + step)
      # The window where each first piece is most central: the largest distance to the nearer edge.
      centre = np.full(len(ids), -1)
      best = np.full(len(ids), -1)
      for k, a in enumerate(starts):
        b = min(a + room, len(ids))
        index = np.arange(a, b)
        margin = np.minimum(index - a, b - 1 - index)
        better = margin > best[a:b]
        best[a:b] = np.where(better, margin, best[a:b])
        centre[a:b] = np.where(better, k, centre[a:b])
      windows = []
      for k, a in enumerate(starts):
        b = min(a + room, len(ids))
        frame = lambda x, fill: np.concatenate([np.full(len(before), fill), x, np.full(len(after), fill)])
        piece_first = first[a:b]
        windows.append(WordWindow(
            ids=np.concatenate([before, ids[a:b], after]).astype(np.int32),
            first_word=frame(piece_first, -1).astype(np.int32),
            central_word=frame(np.where(centre[a:b] == k, piece_first, -1), -1).astype(np.int32)))
      out.append(windows)
    return out

  def pad(self, windows: Sequence[np.ndarray], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, segment_ids) [n, length]: one window per row, padding with segment id 0."""
    length = self.max_len if length is None else length
    ids = np.full((len(windows), length), self.pad_id, np.int32)
    seg = np.zeros((len(windows), length), np.int32)
    for i, w in enumerate(windows):
      ids[i, :len(w)] = w
      seg[i, :len(w)] = 1
    return ids, seg
