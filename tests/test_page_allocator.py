"""The host-side page allocator (flash_layers/layers/page_allocator.py): pages of a shared pool handed to
sequences, the batch description a paged call gets, and what it refuses.

The invariant under every sequence of operations: each page is free or held by exactly one live sequence,
once, and a sequence holds exactly the pages its length needs (less those a window freed).
"""

from __future__ import annotations

import ast
import pathlib
import random

import numpy as np
import pytest

import flash_layers as fl
from flash_layers.layers.page_allocator import PageAllocator, PagedBatch, PoolExhaustedError, bytes_per_page


def _owners(alloc: PageAllocator) -> dict[int, int]:
  """page -> its slot, read from the public view; fails if a page is held twice."""
  owners = {}
  for slot in alloc.active_slots:
    for page in alloc.pages(slot):
      assert page not in owners, f"page {page} held by slots {owners[page]} and {slot}"
      owners[page] = slot
  return owners


def test_pages_are_taken_lowest_first_and_freed():
  alloc = PageAllocator(num_pages=6, page_size=4, max_seqs=3, pages_per_seq=4)
  a, b = alloc.admit(), alloc.admit()
  assert (a, b) == (0, 1)
  alloc.grow(a, 5)  # two pages
  alloc.grow(b, 4)  # one page, full
  alloc.grow(a, 3)  # fills page two: no new page
  assert alloc.pages(a) == [0, 1] and alloc.pages(b) == [2]
  assert alloc.kv_lens.tolist() == [8, 4, 0]
  assert alloc.page_table[:2, :2].tolist() == [[0, 1], [2, 0]]
  assert (alloc.pages_in_use, alloc.free_pages) == (3, 3)
  alloc.release(a)
  assert alloc.active_slots == [b] and alloc.free_pages == 5 and not alloc.page_table[a].any()
  c = alloc.admit()
  assert c == a  # the lowest free slot again
  alloc.grow(c, 1)
  assert alloc.pages(c) == [0]  # the lowest free page again
  alloc.check_invariants()


@pytest.mark.parametrize("window", [None, 4])
def test_random_admits_grows_and_releases_keep_the_invariant(window):
  rng = random.Random(0)
  alloc = PageAllocator(num_pages=40, page_size=3, max_seqs=6, pages_per_seq=8, window=window)
  lengths: dict[int, int] = {}
  for _ in range(2000):
    op = rng.random()
    if op < 0.2 and len(lengths) < alloc.max_seqs:
      lengths[alloc.admit()] = 0
    elif op < 0.35 and lengths:
      slot = rng.choice(sorted(lengths))
      alloc.release(slot)
      del lengths[slot]
    elif lengths:
      slot, n = rng.choice(sorted(lengths)), rng.randint(0, 7)
      before = (alloc.page_table, alloc.kv_lens, alloc.free_pages)
      try:
        alloc.grow(slot, n)
        lengths[slot] += n
      except (PoolExhaustedError, ValueError):  # all or nothing: nothing changed
        after = (alloc.page_table, alloc.kv_lens, alloc.free_pages)
        assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    alloc.check_invariants()
    owners = _owners(alloc)
    assert len(owners) == alloc.pages_in_use == alloc.num_pages - alloc.free_pages
    assert {s: alloc.length(s) for s in lengths} == lengths
    if window is None:
      assert all(len(alloc.pages(s)) == -(-n // 3) for s, n in lengths.items())


def test_an_exhausted_pool_names_the_numbers_and_changes_nothing():
  alloc = PageAllocator(num_pages=4, page_size=8, max_seqs=2, pages_per_seq=4)
  a, b = alloc.admit(), alloc.admit()
  alloc.grow(a, 17)  # 3 pages
  table, lens = alloc.page_table, alloc.kv_lens
  with pytest.raises(PoolExhaustedError, match=r"slot 1 needs 2 more page\(s\) of 8 tokens to grow from 0 "
                                               r"to 9 tokens, but only 1 of the pool's 4 pages are free "
                                               r"\(3 held by 2 sequences\)"):
    alloc.grow(b, 9)
  assert np.array_equal(alloc.page_table, table) and np.array_equal(alloc.kv_lens, lens)
  assert alloc.pages_needed(b, 9) == 2 > alloc.free_pages
  alloc.grow(b, 8)  # what fits does
  alloc.check_invariants()
  with pytest.raises(PoolExhaustedError, match="no free slot: all 2 slots"):
    alloc.admit()
  with pytest.raises(ValueError, match=r"slot 0 would hold 33 tokens, more than pages_per_seq \* page_size = "
                                       r"4 \* 8 = 32"):
    alloc.grow(a, 16)


def test_misuse_is_refused():
  alloc = PageAllocator(num_pages=4, page_size=2, max_seqs=2, pages_per_seq=2)
  with pytest.raises(ValueError, match="slot 0 holds no sequence"):
    alloc.grow(0, 1)
  alloc.admit()
  with pytest.raises(ValueError, match="slot must be an int in"):
    alloc.grow(5, 1)
  with pytest.raises(ValueError, match="n must be a non-negative int"):
    alloc.grow(0, -1)
  with pytest.raises(ValueError, match="num_pages must be a positive int"):
    PageAllocator(0, 2, 2, 2)
  with pytest.raises(ValueError, match="window must be"):
    PageAllocator(4, 2, 2, 2, window=-1)


def test_batch_lists_the_scheduled_sequences_in_order():
  alloc = PageAllocator(num_pages=8, page_size=2, max_seqs=4, pages_per_seq=3)
  a, b, c = alloc.admit(), alloc.admit(), alloc.admit()
  alloc.grow(a, 3)
  alloc.grow(b, 1)
  alloc.grow(c, 4)
  alloc.grow(a, 1)  # a decoding step of a
  batch = alloc.batch([(c, 4), (a, 1)])  # b not in this call
  assert isinstance(batch, PagedBatch) and batch is not None
  assert batch.page_table.shape == (4, 3) and batch.page_table.dtype == np.int32
  assert batch.page_table[:2].tolist() == [alloc.page_table[c].tolist(), alloc.page_table[a].tolist()]
  assert not batch.page_table[2:].any()
  assert batch.kv_lens.tolist() == [4, 4, 0, 0]
  assert batch.cu_q_lens.tolist() == [0, 4, 5, 5, 5]
  assert int(batch.num_seqs) == 2
  with pytest.raises(ValueError, match="slot 1 has 1 tokens, so a call cannot bring 2 new ones"):
    alloc.batch([(b, 2)])
  with pytest.raises(ValueError, match="a slot appears twice"):
    alloc.batch([(a, 1), (a, 1)])
  empty = PagedBatch.empty(4, 3)
  assert [np.shape(x) for x in empty] == [(4, 3), (4,), (5,), ()] and int(empty.num_seqs) == 0


def test_a_window_frees_the_pages_no_query_can_see():
  """window=left: a query at p sees p - left .. p, so once the next token is at L the pages wholly
  before L - left go back to the pool; every page holding a visible key stays held."""
  page_size, left = 4, 5
  alloc = PageAllocator(num_pages=5, page_size=page_size, max_seqs=2, pages_per_seq=16, window=left)
  a = alloc.admit()
  for _ in range(60):  # 60 tokens through a pool of 20: only the window's pages stay
    length = alloc.length(a)
    alloc.grow(a, 1)
    table = alloc.page_table[a]
    visible = range(max(0, length - left), length + 1)  # what the new token's query sees
    held = set(alloc.pages(a))
    assert {int(table[p // page_size]) for p in visible} <= held
    assert len(held) <= -(-(left + 1) // page_size) + 1
    alloc.check_invariants()
  assert alloc.length(a) == 60 and alloc.pages_in_use <= 3
  b = alloc.admit()
  # b's growth may count on a's dead pages: grow frees before it takes.
  assert alloc.pages_needed(a, 4) <= 1
  alloc.grow(b, 8)
  alloc.check_invariants()


def test_memory_in_use():
  alloc = PageAllocator(num_pages=10, page_size=16, max_seqs=2, pages_per_seq=4)
  alloc.grow(alloc.admit(), 20)
  per_page = bytes_per_page(16, num_kv_heads=2, head_dim=64, itemsize=2, num_layers=3)
  assert per_page == 16 * 2 * (64 + 64) * 2 * 3
  assert alloc.memory_in_use(per_page) == 2 * per_page
  assert bytes_per_page(16, 2, 64, 1, scales=True) == 16 * 2 * (128 + 8)


def test_the_allocator_is_numpy_only():
  """Host-side bookkeeping: the module imports numpy and the standard library, no jax and no flax."""
  path = pathlib.Path(fl.__file__).parent / "layers" / "page_allocator.py"
  imported = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      imported |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      imported.add((node.module or "").split(".")[0])
  assert imported <= {"__future__", "heapq", "collections", "typing", "numpy"}, imported
