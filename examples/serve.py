"""Continuous batching with a paged KV cache: the decoder of examples/decoder.py serving requests over time.

    python -m examples.serve                          # impl "auto", float32 pages
    python -m examples.serve --kv-cache-dtype int8    # int8 pages with per-token-head scales
    python -m examples.serve --impl xla_chunked --token-budget 16

The model is `decoder.CausalLM` with `decode=True, cache="paged"`: every attention layer keeps a pool of
`num_pages` pages of `page_size` tokens (flash_layers/layers/paged_cache.py) and each call takes the
ragged batch of its tokens (`fl.PagedBatch`). The host side is a `fl.PageAllocator` and the `Server`
below, which runs the serving loop one step at a time:

1. Requests whose arrival step has come wait in line; the first ones are admitted while a slot is free
   and the pool can hold their whole generation on top of what the running requests may still need
   (so a running request never finds the pool exhausted).
2. The step's tokens, at most `token_budget`: one per decoding request (its last token), then prefill
   chunks of the admitted prompts in arrival order, as much of each prompt as the budget leaves. A long
   prompt is prefilled over several steps while other requests decode.
3. The allocator grows each scheduled sequence, `batch()` describes the call, the tokens are packed into
   one [1, rows] row (padding after them; rows: token_budget, or the smallest of `token_buckets` that
   holds them) and the jitted step runs: every layer writes the new keys and values into their pages
   and attends with `fl.paged_attention`. Every shape is fixed, so the step compiles once per bucket,
   whatever joins or leaves.
4. A request whose prompt is all in takes the greedy token of its last row's logits; when it has
   `max_new_tokens` it leaves, and its pages and slot go back to the allocator.

tests/test_serve.py checks that every request's tokens are those `decoder.generate` gives for its prompt
alone with the contiguous cache. Weights are random; the example is about the mechanics, not the text.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl
from examples import decoder
from flash_layers.layers.page_allocator import pages_for


@dataclasses.dataclass
class Request:
  """A prompt to continue by `max_new_tokens` greedy tokens, arriving at step `arrival`."""

  prompt: Sequence[int]
  max_new_tokens: int
  arrival: int = 0
  # Filled in by the server:
  slot: int | None = None
  fed: int = 0  # prompt tokens written to the cache so far
  tokens: list[int] = dataclasses.field(default_factory=list)  # generated
  logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # of each generated token
  admitted: int | None = None  # the step it got a slot
  finished: int | None = None  # the step of its last token

  @property
  def decoding(self) -> bool:
    return self.fed == len(self.prompt)

  @property
  def max_length(self) -> int:
    """The tokens it ever holds in the cache: the prompt and every generated token but the last."""
    return len(self.prompt) + self.max_new_tokens - 1


class Server:
  """Serves `model`'s greedy continuations with a paged cache and continuous batching (module doc)."""

  def __init__(self, model: decoder.CausalLM, params, *, num_pages: int = 16, page_size: int = 8,
               max_seqs: int = 4, pages_per_seq: int = 8, token_budget: int = 16,
               kv_cache_dtype: str | None = None, token_buckets: Sequence[int] = ()):
    self.model = model.clone(decode=True, cache="paged", num_pages=num_pages, page_size=page_size,
                             kv_cache_dtype=kv_cache_dtype)
    self.params = params
    self.token_budget = token_budget
    # The step's token rows: the smallest bucket that holds the step's tokens (one compile per bucket),
    # so a step of decoding tokens alone does not run token_budget rows of padding.
    self.buckets = sorted({int(b) for b in token_buckets if 0 < int(b) < token_budget} | {token_budget})
    self.allocator = fl.PageAllocator(num_pages, page_size, max_seqs, pages_per_seq)
    self.history: list[tuple[int, int, int]] = []  # per step run: (step, decoding tokens, prefill tokens)
    self.traces = 0  # times the step was traced (compiled): 1
    empty = fl.PagedBatch.empty(max_seqs, pages_per_seq)
    self.cache = self.model.init(jax.random.key(0), jnp.zeros((1, token_budget), jnp.int32),
                                 paged_batch=empty)["cache"]
    self._step = jax.jit(self._apply)
    for rows in self.buckets:  # compile now: the only compiles, one per bucket
      self._step(self.params, self.cache, jnp.zeros((1, rows), jnp.int32), empty)

  def _apply(self, params, cache, tokens, batch: fl.PagedBatch):
    """(the logits of each scheduled sequence's last row [max_seqs, vocab], the updated cache)."""
    self.traces += 1  # Python runs here only while jit traces
    logits, updated = self.model.apply({"params": params, "cache": cache}, tokens, paged_batch=batch,
                                       mutable=["cache"])
    last_rows = jnp.maximum(batch.cu_q_lens[1:] - 1, 0)
    return logits[0, last_rows], updated["cache"]

  def _admit(self, waiting: list[Request], running: list[Request], step: int) -> None:
    """Admit the first waiting requests while a slot is free and the pool holds them at their longest."""
    alloc = self.allocator
    promised = sum(pages_for(r.max_length, alloc.page_size) - len(alloc.pages(r.slot)) for r in running)
    while waiting and len(running) < alloc.max_seqs:
      request = waiting[0]
      need = pages_for(request.max_length, alloc.page_size)
      if need > min(alloc.pages_per_seq, alloc.num_pages):
        raise ValueError(f"a request of up to {request.max_length} tokens needs {need} pages of "
                         f"{alloc.page_size}: more than a page-table row ({alloc.pages_per_seq}) or the pool "
                         f"({alloc.num_pages}) holds")
      if need > alloc.free_pages - promised:
        return
      promised += need
      request.slot, request.admitted = alloc.admit(), step
      running.append(waiting.pop(0))

  def _schedule(self, running: list[Request]) -> list[tuple[Request, int]]:
    """(request, new tokens) of one step within the token budget: decoding tokens, then prefill chunks."""
    budget = self.token_budget
    schedule = []
    for request in sorted(running, key=lambda r: not r.decoding):  # stable: arrival order within each
      n = 1 if request.decoding else min(len(request.prompt) - request.fed, budget)
      if n and budget >= n:
        schedule.append((request, n))
        budget -= n
    return schedule

  def step(self, running: list[Request], step: int) -> int:
    """Run one step of the running requests; returns the tokens it fed."""
    schedule = self._schedule(running)
    rows = next(b for b in self.buckets if b >= sum(n for _, n in schedule))
    tokens = np.zeros((1, rows), np.int32)
    start = 0
    for request, n in schedule:
      self.allocator.grow(request.slot, n)
      tokens[0, start:start + n] = (request.prompt[request.fed:request.fed + n] if not request.decoding
                                    else request.tokens[-1:])
      start += n
    batch = self.allocator.batch([(request.slot, n) for request, n in schedule])
    decoding = sum(1 for request, _ in schedule if request.decoding)
    self.history.append((step, decoding, start - decoding))
    logits, self.cache = self._step(self.params, self.cache, jnp.asarray(tokens), batch)
    logits = np.asarray(logits)
    for row, (request, n) in enumerate(schedule):
      request.fed = min(request.fed + n, len(request.prompt))
      if not request.decoding:
        continue  # a prefill chunk short of the prompt's end: no token yet
      request.logits.append(logits[row])
      request.tokens.append(int(np.argmax(logits[row])))
      if len(request.tokens) == request.max_new_tokens:
        request.finished = step
        self.allocator.release(request.slot)
        running.remove(request)
    return start

  def run(self, requests: Sequence[Request]) -> dict[str, float]:
    """Serve every request to its end; returns the steps, tokens fed and generated, and seconds taken."""
    waiting = sorted(requests, key=lambda r: r.arrival)
    arrived: list[Request] = []
    running: list[Request] = []
    stats = {"steps": 0, "fed": 0, "generated": 0, "seconds": 0.0}
    started = time.perf_counter()
    step = 0
    while waiting or arrived or running:
      while waiting and waiting[0].arrival <= step:
        arrived.append(waiting.pop(0))
      self._admit(arrived, running, step)
      if running:
        stats["fed"] += self.step(running, step)
        stats["steps"] += 1
      step += 1
    stats["seconds"] = time.perf_counter() - started
    stats["generated"] = sum(len(r.tokens) for r in requests)
    return stats


def demo_requests(vocab_size: int, seed: int = 0) -> list[Request]:
  """Requests of different prompt lengths arriving over the first steps."""
  rng = np.random.default_rng(seed)
  shapes = ((11, 8, 0), (3, 12, 0), (25, 6, 1), (6, 10, 3), (17, 5, 4), (2, 9, 9), (9, 7, 12))
  return [Request(rng.integers(1, vocab_size, length).tolist(), new, arrival)
          for length, new, arrival in shapes]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m examples.serve", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--impl", default="auto")
  parser.add_argument("--kv-cache-dtype", default=None, choices=[None, "int8"])
  parser.add_argument("--token-budget", type=int, default=16)
  parser.add_argument("--max-seqs", type=int, default=4)
  parser.add_argument("--token-buckets", default="", help="comma-separated smaller step sizes, e.g. 4,8")
  args = parser.parse_args(argv)
  model = decoder.CausalLM(impl=args.impl)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  server = Server(model, params, max_seqs=args.max_seqs, token_budget=args.token_budget,
                  kv_cache_dtype=args.kv_cache_dtype,
                  token_buckets=[int(b) for b in args.token_buckets.split(",") if b])
  requests = demo_requests(model.vocab_size)
  stats = server.run(requests)
  for i, r in enumerate(requests):
    print(f"request {i}: prompt {len(r.prompt):2d} tokens, arrived at step {r.arrival:2d}, admitted "
          f"{r.admitted:2d}, done {r.finished:2d}: {r.tokens}")
  print(f"{stats['steps']} steps of at most {args.token_budget} tokens ({stats['fed']} fed); "
        f"{stats['generated']} tokens generated in {stats['seconds']:.2f} s = "
        f"{stats['generated'] / stats['seconds']:.1f} tokens/s ({stats['fed'] / stats['seconds']:.1f} fed/s, "
        f"compile excluded)")


if __name__ == "__main__":
  main()
