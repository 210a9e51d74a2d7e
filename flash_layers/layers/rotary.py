"""Rotary position embeddings (RoPE, Su et al. 2021) for queries and keys.

The half-split convention of Hugging Face transformers' Llama / ModernBERT code: the first and
second halves of each head's features form the pairs that rotate together (not interleaved
even/odd features), so checkpoints trained with that code load unchanged. Pair i turns by
angle position * theta ** (-2i / head_dim). Computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_theta(theta) -> None:
  if theta is None:
    return
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
    raise ValueError(f"rope_theta must be a positive number or None; got {theta!r}")


def apply_rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """x [batch, len, heads, head_dim] (head_dim even), positions int [batch, len] -> x rotated."""
  check_theta(theta)
  depth = x.shape[-1]
  if depth % 2:
    raise ValueError(f"rotary embeddings need an even head_dim; got {depth}")
  if positions.shape != x.shape[:2]:
    raise ValueError(f"positions must have shape [batch, len] = {tuple(x.shape[:2])}; got "
                     f"{tuple(positions.shape)}")
  inv_freq = 1.0 / (theta ** (jnp.arange(0, depth, 2, dtype=jnp.float32) / depth))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, len, head_dim / 2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)
