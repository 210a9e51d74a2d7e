"""A one-minute tour: run every impl on the same packed, causal request and compare.

    python -m flash_layers.demo
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import flash_layers as fl


def main() -> None:
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  batch, length, heads, kv_heads, head_dim = 2, 1024, 8, 2, 64
  q = jax.random.normal(kq, (batch, length, heads, head_dim), jnp.float32)
  k = jax.random.normal(kk, (batch, length, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(kv, (batch, length, kv_heads, head_dim), jnp.float32)
  # Two documents of 400 and 500 tokens packed in each row, then padding (segment 0).
  segment_ids = jnp.concatenate([jnp.full((batch, 400), 1), jnp.full((batch, 500), 2),
                                 jnp.zeros((batch, length - 900))], axis=1).astype(jnp.int32)
  kwargs = dict(causal=True, segment_ids=segment_ids)

  print(f"backend: {jax.default_backend()}   request: {batch}x{length} tokens, {heads} heads "
        f"({kv_heads} kv heads) of {head_dim}, causal, 2 packed documents + padding\n")
  print("auto ->", fl.explain(q, k, v, **kwargs))
  expected = fl.attention(q, k, v, impl="reference", **kwargs)
  for impl in fl.IMPLS:
    try:
      why = fl.explain(q, k, v, impl=impl, **kwargs)
      out = fl.attention(q, k, v, impl=impl, **kwargs)
    except fl.UnsupportedError as err:
      print(f"{impl:>13}: unsupported here: {err}")
      continue
    err = float(jnp.max(jnp.abs(out - expected)))
    print(f"{impl:>13}: max |out - reference| = {err:.2e}   {why}")


if __name__ == "__main__":
  main()
