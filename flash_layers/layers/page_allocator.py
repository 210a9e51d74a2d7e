"""The host side of a paged KV cache: which pool pages each sequence holds, and each call's batch.

A paged cache (flash_layers/contract/paged.py, `fl.paged_attention`) keeps every sequence's keys and
values in pages of one shared pool; a page table says which pages are whose. The pages live on the
device, in each layer's cache; the bookkeeping of who owns them is plain host arithmetic, done here
with numpy between calls (no jax, no flax), the way a serving loop schedules its next step:

* `PageAllocator(num_pages, page_size, max_seqs, pages_per_seq)` owns the pool's page numbers and
  `max_seqs` slots, each slot a row of the page table (`pages_per_seq` pages, so a sequence holds at
  most ``pages_per_seq * page_size`` tokens).
* `admit()` gives a request a free slot; `grow(slot, n)` makes room for its next n tokens, taking
  pages from the free list as the sequence crosses page boundaries (all of them or none: a pool too
  small raises `PoolExhaustedError` naming the numbers and changes nothing); `release(slot)` returns
  its pages and slot when it finishes.
* `batch(schedule)` describes one call as a `PagedBatch`: the sequences of `schedule` (slot, new
  tokens) in that order, their page-table rows, their lengths *after* the call's tokens (kv_lens
  counts the new tokens: the layer writes them into their pages, then attends), `cu_q_lens` of the
  packed tokens and `num_seqs`. Its arrays have fixed shapes ([max_seqs, pages_per_seq], [max_seqs],
  [max_seqs + 1], a scalar) whatever the schedule, so a jitted step compiles once; rows past
  `num_seqs` are padding.

Every page is free or held by exactly one slot (`check_invariants`). Pages are handed out lowest
number first, so a run is reproducible.

Sliding windows: `PageAllocator(..., window=left)` also frees, on each `grow`, the pages of a sequence
that hold only tokens no future query can see: a query at position p sees keys p - left ... p, so
once the sequence's next token is at position L, a page all of whose tokens are before L - left is
dead. This is only correct when *every* layer that reads these page tables is causal with a window of
at most `left` keys (a model with a full-attention layer must not pass it). A freed page's table entry
becomes 0: the entry is still in the pool's range, so an impl that gathers every entry of a row reads
some page's finite values there, and the window masks them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


class PoolExhaustedError(RuntimeError):
  """The allocator has no free page (or no free slot) for a request; its state is unchanged."""


class PagedBatch(NamedTuple):
  """The ragged batch of one paged call: `fl.paged_attention`'s page_table, kv_lens, cu_q_lens, num_seqs.

  Sequence s of the call (s < num_seqs) owns the packed token rows ``cu_q_lens[s]:cu_q_lens[s + 1]``,
  its keys are in the pages ``page_table[s]`` and it has ``kv_lens[s]`` tokens including this call's;
  its i-th new token is at position ``kv_lens[s] - q_len + i``. A NamedTuple, so jax treats it as a
  pytree of arrays: pass it through `jax.jit` as an argument (its arrays become traced, its shapes
  static). Made by `PageAllocator.batch` as numpy int32 arrays.
  """

  page_table: Any  # int32 [max_seqs, pages_per_seq]
  kv_lens: Any     # int32 [max_seqs]
  cu_q_lens: Any   # int32 [max_seqs + 1]
  num_seqs: Any    # int32 scalar

  @classmethod
  def empty(cls, max_seqs: int, pages_per_seq: int) -> PagedBatch:
    """A batch of no sequence (every row padding): what an init call needs for its shapes."""
    return cls(np.zeros((max_seqs, pages_per_seq), np.int32), np.zeros((max_seqs,), np.int32),
               np.zeros((max_seqs + 1,), np.int32), np.asarray(0, np.int32))


def pages_for(tokens: int, page_size: int) -> int:
  """Pages that hold `tokens` tokens from position 0."""
  return -(-int(tokens) // int(page_size))


def bytes_per_page(page_size: int, num_kv_heads: int, head_dim: int, itemsize: int, *,
                   head_dim_v: int | None = None, num_layers: int = 1, scales: bool = False) -> int:
  """The device memory one page number stands for: its keys and values in every layer's pool (and the
  float32 per-token-head scales of quantized pages)."""
  head_dim_v = head_dim if head_dim_v is None else head_dim_v
  per_token_head = (head_dim + head_dim_v) * itemsize + (8 if scales else 0)
  return page_size * num_kv_heads * per_token_head * num_layers


def _positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name} must be a positive int; got {value!r}")
  return int(value)


def _check_new_tokens(n) -> None:
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
    raise ValueError(f"n must be a non-negative int (new tokens); got {n!r}")


class PageAllocator:
  """Pages of a shared KV pool handed to sequences in `max_seqs` slots (module doc).

  Args:
    num_pages: pages in the pool (the layers' `num_pages`).
    page_size: tokens per page (the layers' `page_size`).
    max_seqs: slots, the rows of the page table: the most sequences in flight at once.
    pages_per_seq: the page table's columns: a sequence holds at most pages_per_seq * page_size tokens.
    window: free pages no query can see any more, for models whose every layer is causal with a
      sliding window of at most `window` keys on the left (module doc); None keeps every page.
  """

  def __init__(self, num_pages: int, page_size: int, max_seqs: int, pages_per_seq: int, *,
               window: int | None = None):
    self.num_pages = _positive_int("num_pages", num_pages)
    self.page_size = _positive_int("page_size", page_size)
    self.max_seqs = _positive_int("max_seqs", max_seqs)
    self.pages_per_seq = _positive_int("pages_per_seq", pages_per_seq)
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer))
                               or window < 0):
      raise ValueError(f"window must be a non-negative int (keys left of a query) or None; got {window!r}")
    self.window = None if window is None else int(window)
    self._free = list(range(self.num_pages))  # a heap: the lowest free page number first
    self._table = np.zeros((self.max_seqs, self.pages_per_seq), np.int32)
    self._lens = np.zeros((self.max_seqs,), np.int32)
    self._first = np.zeros((self.max_seqs,), np.int32)  # the first page index still held (window)
    self._active = np.zeros((self.max_seqs,), bool)

  # -- the sequences ----------------------------------------------------------------------------

  def admit(self) -> int:
    """A free slot (the lowest) for a new sequence of length 0; PoolExhaustedError when all are busy."""
    free = np.flatnonzero(~self._active)
    if not free.size:
      raise PoolExhaustedError(f"no free slot: all {self.max_seqs} slots (max_seqs) hold sequences; "
                               "release one first")
    slot = int(free[0])
    self._active[slot] = True
    self._lens[slot] = self._first[slot] = 0
    return slot

  def grow(self, slot: int, n: int) -> None:
    """Make room for sequence `slot`'s next `n` tokens (positions length .. length + n - 1).

    Takes the pages it needs from the pool (after freeing the pages a window hides, with `window`).
    All or nothing: PoolExhaustedError when the pool has too few free pages, ValueError past the
    page table's row; either way nothing changes.
    """
    self._check_slot(slot)
    _check_new_tokens(n)
    length, new_length = int(self._lens[slot]), int(self._lens[slot]) + int(n)
    if new_length > self.pages_per_seq * self.page_size:
      raise ValueError(f"slot {slot} would hold {new_length} tokens, more than pages_per_seq * page_size "
                       f"= {self.pages_per_seq} * {self.page_size} = {self.pages_per_seq * self.page_size}")
    first, dead = self._dead_pages(slot, length)
    held_end = pages_for(length, self.page_size)
    needed = pages_for(new_length, self.page_size) - held_end
    if needed > len(self._free) + len(dead):
      raise PoolExhaustedError(
          f"slot {slot} needs {needed} more page(s) of {self.page_size} tokens to grow from {length} to "
          f"{new_length} tokens, but only {len(self._free)} of the pool's {self.num_pages} pages are free "
          f"({self.pages_in_use} held by {int(self._active.sum())} sequences"
          + (f", {len(dead)} about to leave the window" if dead else "") + ")")
    for page in dead:
      heapq.heappush(self._free, page)
    self._table[slot, self._first[slot]:first] = 0
    self._first[slot] = first
    for index in range(held_end, held_end + needed):
      self._table[slot, index] = heapq.heappop(self._free)
    self._lens[slot] = new_length

  def release(self, slot: int) -> None:
    """Sequence `slot` is finished: its pages go back to the pool and its slot is free."""
    self._check_slot(slot)
    for page in self.pages(slot):
      heapq.heappush(self._free, page)
    self._table[slot] = 0
    self._lens[slot] = self._first[slot] = 0
    self._active[slot] = False

  def _dead_pages(self, slot: int, length: int) -> tuple[int, list[int]]:
    """(the first page index still needed, the pages before it) for a sequence whose next token is at
    position `length`: without a window none is dead."""
    first = int(self._first[slot])
    if self.window is None or length - self.window <= 0:
      return first, []
    new_first = max(first, (length - self.window) // self.page_size)
    return new_first, [int(p) for p in self._table[slot, first:new_first]]

  def _check_slot(self, slot: int) -> None:
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.max_seqs:
      raise ValueError(f"slot must be an int in [0, {self.max_seqs}); got {slot!r}")
    if not self._active[slot]:
      raise ValueError(f"slot {slot} holds no sequence (admit() gives a slot)")

  # -- what the layers get ----------------------------------------------------------------------

  def batch(self, schedule: Sequence[tuple[int, int]]) -> PagedBatch:
    """One call's `PagedBatch`: the sequences of `schedule`, (slot, new tokens) pairs, in that order.

    Call `grow(slot, n)` for each first: kv_lens are the lengths after the call's tokens, and a
    sequence's n new tokens are the last n of its length. The call packs the tokens in the same
    order: sequence i's are rows cu_q_lens[i]:cu_q_lens[i + 1] of its token array.
    """
    schedule = [(int(slot), int(n)) for slot, n in schedule]
    if len(schedule) > self.max_seqs:
      raise ValueError(f"a batch holds at most max_seqs = {self.max_seqs} sequences; got {len(schedule)}")
    slots = [slot for slot, _ in schedule]
    if len(set(slots)) != len(slots):
      raise ValueError(f"a slot appears twice in the schedule: {slots}")
    table, lens = np.zeros_like(self._table), np.zeros_like(self._lens)
    q_lens = np.zeros((self.max_seqs,), np.int32)
    for row, (slot, n) in enumerate(schedule):
      self._check_slot(slot)
      if not 0 <= n <= self._lens[slot]:
        raise ValueError(f"slot {slot} has {int(self._lens[slot])} tokens, so a call cannot bring {n} new "
                         "ones: grow(slot, n) before batch()")
      table[row], lens[row], q_lens[row] = self._table[slot], self._lens[slot], n
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return PagedBatch(table, lens, cu_q_lens, np.asarray(len(schedule), np.int32))

  @property
  def page_table(self) -> np.ndarray:
    """int32 [max_seqs, pages_per_seq] by slot (a copy); a free slot's row is zeros."""
    return self._table.copy()

  @property
  def kv_lens(self) -> np.ndarray:
    """int32 [max_seqs]: each slot's tokens (0 for a free slot), a copy."""
    return self._lens.copy()

  def length(self, slot: int) -> int:
    self._check_slot(slot)
    return int(self._lens[slot])

  def pages(self, slot: int) -> list[int]:
    """The pool pages sequence `slot` holds, in position order."""
    self._check_slot(slot)
    return [int(p) for p in self._table[slot, self._first[slot]:pages_for(self._lens[slot], self.page_size)]]

  @property
  def active_slots(self) -> list[int]:
    return [int(s) for s in np.flatnonzero(self._active)]

  @property
  def free_pages(self) -> int:
    return len(self._free)

  @property
  def pages_in_use(self) -> int:
    return self.num_pages - len(self._free)

  def pages_needed(self, slot: int, n: int) -> int:
    """The free pages `grow(slot, n)` would take, net of those the window frees first (negative when it
    frees more than it takes): grow succeeds when this is at most `free_pages`."""
    self._check_slot(slot)
    _check_new_tokens(n)
    length = int(self._lens[slot])
    _, dead = self._dead_pages(slot, length)
    return pages_for(length + n, self.page_size) - pages_for(length, self.page_size) - len(dead)

  def memory_in_use(self, page_bytes: int) -> int:
    """Bytes of the pool the held pages stand for, with `page_bytes` per page (`bytes_per_page`)."""
    return self.pages_in_use * int(page_bytes)

  def check_invariants(self) -> None:
    """Raise AssertionError unless every page is free or held by exactly one active slot, once, and
    every active slot holds exactly the pages its length needs (less those a window freed)."""
    owners = np.zeros((self.num_pages,), np.int64)
    for slot in range(self.max_seqs):
      if not self._active[slot]:
        assert self._lens[slot] == 0 and not self._table[slot].any(), f"free slot {slot} holds pages"
        continue
      held = self.pages(slot)
      want = pages_for(self._lens[slot], self.page_size) - int(self._first[slot])
      assert len(held) == max(want, 0), f"slot {slot} holds {len(held)} pages for {self._lens[slot]} tokens"
      np.add.at(owners, held, 1)
    free = np.asarray(self._free, np.int64)
    assert len(set(self._free)) == len(self._free), "a page is free twice"
    np.add.at(owners, free, 1)
    assert (owners == 1).all(), f"pages owned {owners.tolist()} times (free counts as an owner)"

  def __repr__(self) -> str:
    return (f"PageAllocator({self.pages_in_use}/{self.num_pages} pages of {self.page_size} in use, "
            f"{int(self._active.sum())}/{self.max_seqs} slots)")
