"""Profiler traces of attention alone and of a training step, with our kernels named.

    python -m benchmarks.profile --out /tmp/fl-trace                 # impl auto, 2,048 tokens
    python -m benchmarks.profile --out /tmp/fl-trace --impl xla_chunked --seq-len 8192
    tensorboard --logdir /tmp/fl-trace      # Profile tab (tensorboard-plugin-profile / xprof)

Writes two jax.profiler traces, `OUT/attention` (forward + backward of `fl.attention`)
and `OUT/train_step` (one AdamW step of the MiniLM-shaped encoder of `bench.e2e`),
each a `plugins/profile/<run>/*.xplane.pb` plus a Perfetto `perfetto_trace.json.gz`
(open in ui.perfetto.dev).

How our code is named in them: `fl.attention` runs each impl under
`jax.named_scope("flash_layers.<impl>")`, so every XLA op of an impl carries that
prefix in its op name (e.g. `flash_layers.xla_chunked/while/body/dot_general`;
the backward as `transpose(jvp(flash_layers.xla_chunked))/...`); the Pallas kernels
are additionally `pallas_call`s named `flash_layers_fwd`, `flash_layers_bwd_delta`,
`flash_layers_bwd_dkv`, `flash_layers_bwd_dq` (TPU) and `flash_pallas_gpu_*` (GPU). On the CPU the op names
are in the .xplane.pb (the trace viewer's op details), not in the Perfetto JSON,
which names XLA ops only. After writing, this script lists the names it finds.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

import jax
import jax.numpy as jnp
import optax

import flash_layers as fl
from benchmarks import cases, e2e
from flash_layers.training import compile_cache

# What our code is called in a trace: named scopes and pallas_call names.
NAME_PATTERN = re.compile(rb"flash_layers[._][a-z_]+|flash_pallas_gpu_[a-z_]+")


def trace_files(trace_dir: str) -> list[str]:
  return sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.xplane.pb")))


def names_in_trace(trace_dir: str) -> set[str]:
  """Our names found in the trace's .xplane.pb files."""
  found = set()
  for path in trace_files(trace_dir):
    with open(path, "rb") as f:
      found |= {m.decode() for m in NAME_PATTERN.findall(f.read())}
  return found


def _traced(trace_dir: str, run_once, repeats: int) -> None:
  run_once()  # compile outside the trace
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for i in range(repeats):
      with jax.profiler.StepTraceAnnotation("step", step_num=i):
        run_once()


def trace_attention(trace_dir: str, *, impl: str = "auto", seq_len: int = 2048, mask: str = "causal",
                    shape: cases.Shape | None = None, repeats: int = 3) -> set[str]:
  """Trace forward + backward of fl.attention; returns our names found in the trace."""
  shape = shape or cases.Shape()
  kwargs = cases.mask_kwargs(mask, shape.batch, seq_len)
  segment_ids = kwargs.pop("segment_ids", None)
  q, k, v, _ = cases.inputs(shape, seq_len, "float32")

  def loss(q, k, v, segment_ids):
    out = fl.attention(q, k, v, impl=impl, segment_ids=segment_ids, **kwargs)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  seg = None if segment_ids is None else jnp.asarray(segment_ids)
  _traced(trace_dir, lambda: jax.block_until_ready(grad(q, k, v, seg)), repeats)
  return names_in_trace(trace_dir)


def trace_train_step(trace_dir: str, *, impl: str = "auto", seq_len: int = 2048, batch: int = 1,
                     repeats: int = 2, **model_overrides) -> set[str]:
  """Trace AdamW steps of the e2e encoder (MiniLM shape unless overridden); returns our names found."""
  model, init = e2e.build(impl, seq_len, **model_overrides)
  params = jax.jit(init)(jax.random.key(0))
  tx = optax.adamw(1e-4)
  step = e2e.make_step(model, impl, tx)
  data = e2e.random_batch(seq_len, batch, vocab_size=model.vocab_size)
  state = [params, tx.init(params)]

  def run_once():
    state[0], state[1], loss = step(state[0], state[1], data, jax.random.key(1))
    jax.block_until_ready(loss)

  _traced(trace_dir, run_once, repeats)
  return names_in_trace(trace_dir)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="directory for the two traces")
  p.add_argument("--impl", default="auto", help=f"one of {fl.IMPLS + ('auto',)}")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--mask", default="causal", choices=cases.MASK_KINDS,
                 help="mask of the attention-alone trace (the encoder uses its segment ids)")
  p.add_argument("--skip-train", action="store_true", help="trace attention alone only")
  compile_cache.add_argument(p)
  args = p.parse_args(argv)
  compile_cache.enable(args.compilation_cache_dir)
  traces = {"attention": lambda d: trace_attention(d, impl=args.impl, seq_len=args.seq_len,
                                                   mask=args.mask)}
  if not args.skip_train:
    traces["train_step"] = lambda d: trace_train_step(d, impl=args.impl, seq_len=args.seq_len)
  for name, run in traces.items():
    trace_dir = os.path.join(args.out, name)
    found = run(trace_dir)
    files = trace_files(trace_dir)
    print(f"{name}: {files[-1] if files else 'no .xplane.pb written'}")
    print(f"  names found: {', '.join(sorted(found)) or 'none'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
