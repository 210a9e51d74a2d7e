"""A two-layer causal LM built from `fl.MultiHeadAttention`, and greedy generation with its KV cache.

    python -m examples.decoder                      # impl "auto"
    python -m examples.decoder --impl xla_chunked

The model: token embedding, two pre-LayerNorm blocks (attention with rotary positions, GQA, the second
layer with a sliding window, so its cache is a ring buffer of the window; then an MLP), a LayerNorm and
the logits. `generate` runs a batch of prompts of different lengths: each prompt is left-padded to the
longest, its padding gets segment id 0 (no real token sees it) and its positions start at 0 at its first
real token. The prompts are prefilled in one call, then each step feeds one token per row.
`generate_uncached` is the check: each row's whole sequence re-run from scratch at every step, without a
cache. tests/test_decoding.py asserts that both give the same tokens and logits for every impl that
serves decoding. examples/serve.py serves the same model with a paged cache (`cache="paged"`, each call's
`paged_batch` passed through to every layer) and continuous batching. Weights are random; the example is
about the mechanics, not the text.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl


class Block(nn.Module):
  num_heads: int
  num_kv_heads: int
  window: int | None
  impl: str
  decode: bool
  # The attention's cache fields: the contiguous cache by default; examples/serve.py sets cache="paged".
  cache: str = "contiguous"
  num_pages: int | None = None
  page_size: int | None = None
  kv_cache_dtype: str | None = None

  @nn.compact
  def __call__(self, x, segment_ids, positions, paged_batch=None):
    attention = fl.MultiHeadAttention(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, causal=True,
                                      window=None if self.window is None else (self.window, 0),
                                      rope_theta=10_000.0, impl=self.impl, decode=self.decode,
                                      cache=self.cache, num_pages=self.num_pages, page_size=self.page_size,
                                      kv_cache_dtype=self.kv_cache_dtype, name="attention")
    x = x + attention(nn.LayerNorm()(x), segment_ids=segment_ids, positions=positions,
                      paged_batch=paged_batch)
    h = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
    return x + nn.Dense(x.shape[-1])(h)


class CausalLM(nn.Module):
  vocab_size: int = 97
  features: int = 32
  num_heads: int = 4
  num_kv_heads: int = 2
  windows: tuple[int | None, ...] = (None, 4)  # per layer: None (full attention) or a window of keys
  impl: str = "auto"
  decode: bool = False
  # The paged KV cache (examples/serve.py): every layer's pool has num_pages pages of page_size tokens.
  cache: str = "contiguous"
  num_pages: int | None = None
  page_size: int | None = None
  kv_cache_dtype: str | None = None

  @nn.compact
  def __call__(self, tokens, segment_ids=None, positions=None, paged_batch=None):
    """tokens [batch, len] -> logits [batch, len, vocab_size].

    paged_batch: with decode=True and cache="paged", the call's ragged batch (`fl.PagedBatch`); tokens is
    then [1, token budget], every scheduled sequence's new tokens packed (examples/serve.py).
    """
    x = nn.Embed(self.vocab_size, self.features)(tokens)
    for window in self.windows:
      block = Block(self.num_heads, self.num_kv_heads, window, self.impl, self.decode, self.cache,
                    self.num_pages, self.page_size, self.kv_cache_dtype)
      x = block(x, segment_ids, positions, paged_batch)
    return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def _left_pad(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens, segment ids, positions) [batch, longest prompt] of left-padded prompts."""
  longest = max(len(p) for p in prompts)
  tokens = np.zeros((len(prompts), longest), np.int32)
  segment_ids = np.zeros_like(tokens)
  positions = np.zeros_like(tokens)
  for row, prompt in enumerate(prompts):
    pad = longest - len(prompt)
    tokens[row, pad:] = prompt
    segment_ids[row, pad:] = 1
    positions[row, pad:] = np.arange(len(prompt))
  return tokens, segment_ids, positions


def generate(model: CausalLM, params, prompts: Sequence[Sequence[int]], steps: int):
  """Greedy generation with the KV cache: (new tokens [batch, steps], their logits [batch, steps, vocab])."""
  tokens, segment_ids, positions = _left_pad(prompts)
  batch, longest = tokens.shape
  decoder = model.clone(decode=True)
  # The init call sizes every layer's cache (the windowed one keeps only its window).
  cache = decoder.init(jax.random.key(0), jnp.zeros((batch, longest + steps), jnp.int32))["cache"]

  @jax.jit
  def feed(cache, tokens, segment_ids, positions):
    logits, updated = decoder.apply({"params": params, "cache": cache}, tokens, segment_ids, positions,
                                    mutable=["cache"])
    return logits[:, -1], updated["cache"]

  logits, cache = feed(cache, tokens, segment_ids, positions)  # prefill: every prompt in one call
  lengths = np.array([len(p) for p in prompts], np.int32)
  out_tokens, out_logits = [], []
  for step in range(steps):
    out_logits.append(logits)
    next_token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out_tokens.append(next_token)
    if step + 1 < steps:
      logits, cache = feed(cache, next_token[:, None], jnp.ones((batch, 1), jnp.int32),
                           jnp.asarray(lengths + step)[:, None])
  return jnp.stack(out_tokens, 1), jnp.stack(out_logits, 1)


def generate_uncached(model: CausalLM, params, prompts: Sequence[Sequence[int]], steps: int):
  """The same greedy generation re-running each row's whole sequence at every step, without a cache."""
  apply = jax.jit(lambda tokens: model.apply({"params": params}, tokens)[:, -1])
  rows_tokens, rows_logits = [], []
  for prompt in prompts:
    sequence = list(prompt)
    new_tokens, new_logits = [], []
    for _ in range(steps):
      logits = apply(jnp.asarray([sequence], jnp.int32))[0]
      new_logits.append(logits)
      new_tokens.append(int(jnp.argmax(logits)))
      sequence.append(new_tokens[-1])
    rows_tokens.append(new_tokens)
    rows_logits.append(jnp.stack(new_logits))
  return jnp.asarray(rows_tokens, jnp.int32), jnp.stack(rows_logits)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m examples.decoder", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--impl", default="auto")
  parser.add_argument("--steps", type=int, default=8)
  args = parser.parse_args(argv)
  model = CausalLM(impl=args.impl)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  prompts = [[5, 17, 42, 8, 23, 61], [9, 3]]
  tokens, logits = generate(model, params, prompts, args.steps)
  want_tokens, want_logits = generate_uncached(model, params, prompts, args.steps)
  print("cached  :", np.asarray(tokens).tolist())
  print("uncached:", np.asarray(want_tokens).tolist())
  print(f"largest logit difference: {float(jnp.max(jnp.abs(logits - want_logits))):.2e}")


if __name__ == "__main__":
  main()
