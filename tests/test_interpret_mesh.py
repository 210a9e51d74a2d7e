"""`fl.interpret_as("tpu")` under a multi-device mesh: runs and matches the reference, never hangs.

The TPU-semantics interpreter (`pltpu.InterpretParams`) stops every device at a barrier when a
kernel starts, and its callbacks copy their arguments through CPU device 0; on a multi-device
CPU host the two could wait on each other forever (seen with 8 query heads on 4 kv heads under
an 8-device data mesh). Inside a multi-device shard_map the TPU kernels therefore run under
the plain interpreter. Each case runs in a subprocess with 8 CPU devices, under a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import subprocess_xla_flags

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    import flash_layers as fl
    heads, kv_heads, axis = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    q = jax.random.normal(jax.random.key(0), (8, 64, heads, 32))
    k = jax.random.normal(jax.random.key(1), (8, 64, kv_heads, 32))
    v = jax.random.normal(jax.random.key(2), (8, 64, kv_heads, 32))
    mesh = fl.make_mesh(data=8) if axis == "data" else fl.make_mesh(data=2, **{axis: 4})
    def loss(q, k, v):
      return jnp.sum(fl.attention(q, k, v, impl="flash_pallas", causal=True, mesh=mesh) ** 2)
    with fl.interpret_as("tpu"):
      out, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref, ref_grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(fl.attention(q, k, v, impl="reference", causal=True) ** 2),
        argnums=(0, 1, 2))(q, k, v)
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(grads, ref_grads))
    print("ERR", float(abs(out - ref) / abs(ref)), err)
""")


@pytest.mark.parametrize("heads,kv_heads,axis", [(8, 4, "data"), (8, 1, "sequence")],
                         ids=["gqa-data-mesh", "mqa-ring"])
def test_tpu_interpret_under_a_mesh_runs_and_matches(heads, kv_heads, axis):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             XLA_FLAGS=subprocess_xla_flags(8))
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(heads), str(kv_heads), axis], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=420)
  assert proc.returncode == 0, proc.stderr[-4000:]
  (line,) = [x for x in proc.stdout.splitlines() if x.startswith("ERR ")]
  loss_err, grad_err = map(float, line.split()[1:])
  assert loss_err < 1e-5 and grad_err < 1e-5, line
