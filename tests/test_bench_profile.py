"""Profiler traces name our impls (benchmarks.profile).

A trace also carries the metadata of every program the process compiled before,
so each check runs in a fresh interpreter: a name found there came from the
traced program itself.
"""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _names_in_fresh_process(tmp_path, body: str) -> tuple[list[str], set[str]]:
  """Run `body` (which traces into OUT) in a new Python; return (trace files, our names found)."""
  code = textwrap.dedent("""
      import json, sys
      import jax, jax.numpy as jnp
      from benchmarks import cases, profile
      OUT = sys.argv[1]
      SMALL = cases.Shape(batch=1, heads=2, head_dim=16)
  """) + textwrap.dedent(body) + textwrap.dedent("""
      print(json.dumps([profile.trace_files(OUT), sorted(profile.names_in_trace(OUT))]))
  """)
  result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ))
  assert result.returncode == 0, result.stderr[-3000:]
  files, names = json.loads(result.stdout.strip().splitlines()[-1])
  return files, set(names)


def test_attention_trace_is_written_and_names_the_impl(tmp_path):
  files, found = _names_in_fresh_process(tmp_path, """
      profile.trace_attention(OUT, impl="xla_chunked", seq_len=256, shape=SMALL, repeats=1)
  """)
  assert files, "no .xplane.pb written"
  assert "flash_layers.xla_chunked" in found


def test_auto_trace_names_the_impl_it_chose(tmp_path):
  _, found = _names_in_fresh_process(tmp_path, """
      profile.trace_attention(OUT, impl="auto", seq_len=128, mask="packed", shape=SMALL, repeats=1)
  """)
  assert "flash_layers.xla_dense" in found  # auto's CPU choice below 1,024 keys


def test_plain_xla_trace_has_none_of_our_names(tmp_path):
  files, found = _names_in_fresh_process(tmp_path, """
      f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
      x = jnp.ones((64, 64))
      f(x).block_until_ready()
      with jax.profiler.trace(OUT):
        f(x).block_until_ready()
  """)
  assert files and found == set()


def test_train_step_trace_names_the_impl(tmp_path):
  _, found = _names_in_fresh_process(tmp_path, """
      profile.trace_train_step(OUT, impl="xla_native", seq_len=64, repeats=1, vocab_size=50,
                               hidden_size=32, num_layers=1, num_heads=2, mlp_dim=64)
  """)
  assert "flash_layers.xla_native" in found
