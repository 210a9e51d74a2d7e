"""Profiler traces name our impls (flash_layers.bench.profile)."""

import jax
import jax.numpy as jnp

from flash_layers.bench import cases, profile

SMALL = cases.Shape(batch=1, heads=2, head_dim=16)


def test_attention_trace_is_written_and_names_the_impl(tmp_path):
  found = profile.trace_attention(str(tmp_path), impl="xla_chunked", seq_len=256, shape=SMALL,
                                  repeats=1)
  assert profile.trace_files(str(tmp_path)), "no .xplane.pb written"
  assert "flash_layers.xla_chunked" in found


def test_auto_trace_names_the_impl_it_chose(tmp_path):
  found = profile.trace_attention(str(tmp_path), impl="auto", seq_len=128, mask="packed",
                                  shape=SMALL, repeats=1)
  assert found & {"flash_layers.xla_native", "flash_layers.xla_chunked"}


def test_plain_xla_trace_has_none_of_our_names(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    f(x).block_until_ready()
  assert profile.trace_files(str(tmp_path)) and profile.names_in_trace(str(tmp_path)) == set()


def test_train_step_trace_names_the_impl(tmp_path):
  found = profile.trace_train_step(str(tmp_path), impl="xla_native", seq_len=64, repeats=1,
                                   vocab_size=50, hidden_size=32, num_layers=1, num_heads=2,
                                   mlp_dim=64)
  assert "flash_layers.xla_native" in found
