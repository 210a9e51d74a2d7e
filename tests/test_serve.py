"""Continuous batching with the paged cache (examples/serve.py) gives every request the tokens it gets alone.

Requests of different prompt lengths arrive over time, wait for a slot or for pages, are prefilled in
chunks mixed with other requests' decoding tokens in one packed call of a fixed token budget, and leave
when done. Each request's greedy tokens and logits must be those of `examples/decoder.generate` on its
prompt alone, with the contiguous cache. With int8 pages the tokens agree until a near tie of the random
model's logits (here the third token of one request) and the logits stay within a stated bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples import decoder, serve

# (prompt length, new tokens, arrival step): 4 requests for 3 slots and a pool of 10 pages of 4 tokens,
# so the fourth waits for a slot and some wait for pages; a 12-token prompt is prefilled in two chunks.
SHAPES = ((7, 6, 0), (3, 8, 0), (12, 4, 1), (5, 5, 3))
# int8 keys and values (each element within its token-head's absmax / 254) move the logits by up to about
# 0.02 here; the bound leaves room for other platforms' rounding.
INT8_LOGITS_ATOL = 0.05


@pytest.fixture(scope="module")
def setup():
  model = decoder.CausalLM(impl="xla_chunked", features=16, num_heads=2, num_kv_heads=1)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, model.vocab_size, length).tolist() for length, _, _ in SHAPES]
  alone = [decoder.generate(model, params, [prompt], new) for prompt, (_, new, _) in zip(prompts, SHAPES,
                                                                                          strict=True)]
  return model, params, prompts, [(np.asarray(tokens[0]), np.asarray(logits[0])) for tokens, logits in alone]


def _serve(model, params, prompts, kv_cache_dtype=None, token_buckets=()):
  server = serve.Server(model, params, num_pages=10, page_size=4, max_seqs=3, pages_per_seq=6, token_budget=8,
                        kv_cache_dtype=kv_cache_dtype, token_buckets=token_buckets)
  requests = [serve.Request(prompt, new, arrival) for prompt, (_, new, arrival) in zip(prompts, SHAPES,
                                                                                        strict=True)]
  stats = server.run(requests)
  return server, requests, stats


def test_every_request_gets_the_tokens_it_gets_alone(setup):
  model, params, prompts, alone = setup
  server, requests, stats = _serve(model, params, prompts)
  for request, (tokens, logits) in zip(requests, alone, strict=True):
    assert request.tokens == tokens.tolist()
    np.testing.assert_allclose(np.stack(request.logits), logits, atol=1e-5, rtol=0)
  # The mechanics the equality covers: one compile; prefill mixed with decoding in a call; a prompt
  # longer than the budget prefilled over two calls; requests waiting, then taking a freed slot.
  assert server.traces == 1
  assert any(decoding and prefill for _, decoding, prefill in server.history)
  assert requests[2].admitted == 1 and requests[3].admitted > requests[3].arrival
  assert stats["generated"] == sum(new for _, new, _ in SHAPES)
  assert stats["fed"] == sum(length + new - 1 for length, new, _ in SHAPES)
  assert server.allocator.pages_in_use == 0 and server.allocator.active_slots == []
  server.allocator.check_invariants()


def test_token_buckets_give_the_same_tokens(setup):
  """Steps of few tokens run in the smaller bucket (one compile per bucket): the same tokens as alone."""
  model, params, prompts, alone = setup
  server, requests, _ = _serve(model, params, prompts, token_buckets=(3,))
  for request, (tokens, logits) in zip(requests, alone, strict=True):
    assert request.tokens == tokens.tolist()
    np.testing.assert_allclose(np.stack(request.logits), logits, atol=1e-5, rtol=0)
  assert server.buckets == [3, 8] and server.traces == 2


def test_int8_pages_stay_within_their_rounding(setup):
  """int8 pages: each request's logits stay within INT8_LOGITS_ATOL of its float tokens' logits, up to
  the first token the two choose differently (random weights have near ties: past it the sequences differ),
  and there the float logits of the two choices are within twice the bound of each other: a tie the
  rounding may break either way."""
  model, params, prompts, alone = setup
  _, requests, _ = _serve(model, params, prompts, kv_cache_dtype="int8")
  agreed = 0
  for request, (tokens, logits) in zip(requests, alone, strict=True):
    got = np.stack(request.logits)
    for i, (mine, theirs) in enumerate(zip(request.tokens, tokens, strict=True)):
      error = float(np.max(np.abs(got[i] - logits[i])))
      assert 0 < error < INT8_LOGITS_ATOL, (i, error)
      if mine != theirs:
        assert logits[i, theirs] - logits[i, mine] < 2 * INT8_LOGITS_ATOL
        break
      agreed += 1
  assert agreed >= sum(new for _, new, _ in SHAPES) // 2


def test_the_example_runs(capsys):
  serve.main(["--impl", "xla_chunked", "--max-seqs", "3"])
  out = capsys.readouterr().out
  assert out.count("request ") == len(serve.demo_requests(97)) and "tokens/s" in out
