"""End-to-end: training throughput of the document encoder, per impl, against Flax's stock attention.

    python -m benchmarks.e2e                      # 512, 2,048 and 8,192 tokens
    python -m benchmarks.e2e --lengths 512 --impls auto --steps 2 --json out.json

The model is `flash_layers.models.Bert` in a MiniLM shape (6 layers, hidden 384,
12 heads, MLP 1,536, BERT's 30,522-token vocabulary) with a classification head,
trained with AdamW on random tokens. The baseline ("flax") is the same model whose
attention layers are `flax.linen.MultiHeadDotProductAttention` with its default
attention (`nn.dot_product_attention` over a segment mask); it has the same
parameter tree, which the script asserts.

Each (variant, length) runs in a subprocess of its own so that its peak RSS is its
own and an out-of-memory kill ends one cell, not the benchmark. A cell is compiled
first; it is run only when its compiled memory (temp + arguments) fits the limit,
else reported as "not run" with the memory it would need (on a small machine the
baseline at 8,192 tokens is such a cell). Step time is the median over the timed
steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import flash_layers as fl
from benchmarks import harness
from flash_layers.training import compile_cache

STOCK = "flax"  # the baseline variant's name in the output
CONFIGS = ((512, 4), (2048, 1), (8192, 1))  # (tokens per row, batch): batch 1 for long rows
MINILM = dict(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12, mlp_dim=1536)
NUM_LABELS = 2


# ----------------------------------------------------------------------------
# The two variants of the model
# ----------------------------------------------------------------------------

class StockAttention(nn.MultiHeadDotProductAttention):
  """`flax.linen.MultiHeadDotProductAttention`, called the way the encoder's blocks call attention.

  Takes (and ignores) `impl`, and turns segment ids into flax's boolean attention mask;
  the attention itself is flax's default `nn.dot_product_attention`.
  """

  impl: str = STOCK
  calls = 0  # class-wide: how many layers were built on it (checked after tracing)

  @nn.compact
  def __call__(self, inputs_q, *, segment_ids, deterministic):
    type(self).calls += 1
    mask = nn.make_attention_mask(segment_ids, segment_ids, pairwise_fn=jnp.equal)
    return super().__call__(inputs_q, mask=mask, deterministic=deterministic)


@contextlib.contextmanager
def stock_attention():
  """While tracing inside this block, the encoder's attention layers are StockAttention.

  The encoder has no attention hook (it is built on fl.MultiHeadAttention on purpose),
  so the baseline swaps the class its blocks instantiate; jit traces once, so the swap
  only needs to cover tracing.
  """
  from flash_layers.models import bert

  saved = bert.MultiHeadAttention
  bert.MultiHeadAttention = StockAttention
  try:
    yield
  finally:
    bert.MultiHeadAttention = saved


def build(variant: str, seq_len: int, **overrides):
  """(model, params-init function) for "flax" or an fl impl name; `overrides` change MINILM's sizes."""
  from flash_layers.models import Bert, init_params

  impl = "auto" if variant == STOCK else variant
  model = Bert(**(MINILM | overrides), max_len=seq_len, num_labels=NUM_LABELS, pooling="mean",
               impl=impl, dropout_rate=0.1)

  def init(rng):
    scope = stock_attention() if variant == STOCK else contextlib.nullcontext()
    with scope:
      return init_params(model, rng)

  return model, init


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def tree_digest(params) -> str:
  """A digest of the parameter tree's names and shapes (equal across processes)."""
  shapes = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda x: tuple(x.shape), params))[0]
  return hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------
# One training step
# ----------------------------------------------------------------------------

def make_step(model, variant: str, tx):
  def loss_fn(params, batch, rng):
    logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                         deterministic=False, rngs={"dropout": rng})[:, 0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

  def step(params, opt_state, batch, rng):
    scope = stock_attention() if variant == STOCK else contextlib.nullcontext()
    with scope:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def random_batch(seq_len: int, batch: int, vocab_size: int = MINILM["vocab_size"],
                 seed: int = 0) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"input_ids": jax.random.randint(k1, (batch, seq_len), 1, vocab_size),
          "segment_ids": jnp.ones((batch, seq_len), jnp.int32),
          "labels": jax.random.randint(k2, (batch,), 0, NUM_LABELS)}


def run_one(variant: str, seq_len: int, batch: int, *, steps: int, mem_limit: int) -> dict[str, Any]:
  """Compile, check memory, then time `steps` training steps after one warm-up step."""
  row: dict[str, Any] = {"variant": variant, "seq_len": seq_len, "batch": batch,
                         "tokens_per_step": seq_len * batch}
  model, init = build(variant, seq_len)
  params = jax.jit(init)(jax.random.key(0))
  row["params"] = count_params(params)
  row["param_tree"] = tree_digest(params)
  if variant != STOCK:
    q = jax.ShapeDtypeStruct((batch, seq_len, MINILM["num_heads"],
                              MINILM["hidden_size"] // MINILM["num_heads"]), jnp.float32)
    seg = jnp.ones((batch, seq_len), jnp.int32)
    row["impl_chosen"] = fl.explain(q, q, q, impl=variant, segment_ids=seg).impl
  tx = optax.adamw(1e-4)
  opt_state = tx.init(params)
  data = random_batch(seq_len, batch)
  step = make_step(model, variant, tx)
  rng = jax.random.key(1)
  start = time.perf_counter()
  StockAttention.calls = 0
  compiled = step.lower(params, opt_state, data, rng).compile()
  row["compile_s"] = time.perf_counter() - start
  if variant == STOCK and StockAttention.calls != MINILM["num_layers"]:
    raise AssertionError(f"the baseline step traced {StockAttention.calls} StockAttention layers, "
                         f"expected {MINILM['num_layers']}: the encoder's attention class was not swapped")
  memory = compiled.memory_analysis()
  row["temp_bytes"] = int(memory.temp_size_in_bytes)
  row["arg_bytes"] = int(memory.argument_size_in_bytes)
  row["compiled_peak_bytes"] = row["temp_bytes"] + row["arg_bytes"]
  if row["compiled_peak_bytes"] > mem_limit:
    return row | {"status": "not run", "reason": f"compiled memory {row['compiled_peak_bytes'] / 2**30:.1f}"
                  f" GiB > limit {mem_limit / 2**30:.1f} GiB"}
  times, cpu_times = [], []
  for i in range(steps + 1):
    start, start_cpu = time.perf_counter(), time.process_time()
    params, opt_state, loss = compiled(params, opt_state, data, jax.random.fold_in(rng, i))
    jax.block_until_ready(loss)
    if i:  # step 0 is the warm-up
      times.append(time.perf_counter() - start)
      cpu_times.append(time.process_time() - start_cpu)
  step_s = statistics.median(times)
  # CPU seconds of this process per step: steadier than wall time on a shared machine.
  return row | {"status": "ok", "step_s": step_s, "step_cpu_s": statistics.median(cpu_times),
                "steps": len(times),
                "tokens_per_s": seq_len * batch / step_s, "loss": float(loss),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# ----------------------------------------------------------------------------
# The table of variants x lengths
# ----------------------------------------------------------------------------

def _subprocess_row(variant, seq_len, batch, args) -> dict[str, Any]:
  cmd = [sys.executable, "-m", "benchmarks.e2e", "--one", variant, str(seq_len), str(batch),
         "--steps", str(args.steps), "--mem-limit-gb", str(args.mem_limit_gb)]
  if args.compilation_cache_dir is not None:
    cmd.append(f"--compilation-cache-dir={args.compilation_cache_dir}")
  proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
  status = "oom" if proc.returncode in (-9, 137) or "RESOURCE_EXHAUSTED" in proc.stderr else "error"
  return {"variant": variant, "seq_len": seq_len, "batch": batch, "tokens_per_step": seq_len * batch,
          "status": status, "reason": f"exit {proc.returncode}: {tail}"}


def add_ratios(rows: list[dict[str, Any]]) -> None:
  """speedup = tokens/s over the baseline's at the same length; memory ratio = baseline's / ours."""
  base = {r["seq_len"]: r for r in rows if r["variant"] == STOCK}
  for r in rows:
    b = base.get(r["seq_len"])
    if b is None or r["variant"] == STOCK:
      continue
    if r.get("tokens_per_s") and b.get("tokens_per_s"):
      r["speedup_vs_flax"] = r["tokens_per_s"] / b["tokens_per_s"]
    if r.get("step_cpu_s") and b.get("step_cpu_s"):
      r["cpu_speedup_vs_flax"] = b["step_cpu_s"] / r["step_cpu_s"]
    if r.get("compiled_peak_bytes") and b.get("compiled_peak_bytes"):
      r["memory_ratio_flax_over_ours"] = b["compiled_peak_bytes"] / r["compiled_peak_bytes"]
    if "params" in r and "params" in b and (r["params"], r["param_tree"]) != (b["params"], b["param_tree"]):
      raise AssertionError(f"parameters differ at {r['seq_len']}: {r['variant']} has {r['params']} "
                           f"(tree {r['param_tree']}), flax {b['params']} (tree {b['param_tree']})")


def markdown(rows: list[dict[str, Any]]) -> str:
  header = ["variant", "impl run", "tokens", "batch", "step s", "tokens/s", "x flax", "CPU s/step",
            "x flax (CPU)", "compiled MiB", "peak RSS MiB", "status"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  mib = lambda v: f"{v / 2**20:.0f}" if v else ""
  for r in rows:
    status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
    lines.append("| " + " | ".join([
        r["variant"], r.get("impl_chosen", "nn.dot_product_attention" if r["variant"] == STOCK else ""),
        str(r["seq_len"]), str(r["batch"]), f"{r['step_s']:.2f}" if r.get("step_s") else "",
        f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "",
        f"{r['speedup_vs_flax']:.2f}" if r.get("speedup_vs_flax") else "",
        f"{r['step_cpu_s']:.2f}" if r.get("step_cpu_s") else "",
        f"{r['cpu_speedup_vs_flax']:.2f}" if r.get("cpu_speedup_vs_flax") else "",
        mib(r.get("compiled_peak_bytes")), mib(r.get("peak_rss_bytes")), status]) + " |")
  return "\n".join(lines)


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lengths", default=",".join(str(n) for n, _ in CONFIGS),
                 help="comma-separated lengths among " + ",".join(str(n) for n, _ in CONFIGS)
                 + " (batch 4 at 512, else 1) or any other (batch 1)")
  p.add_argument("--impls", default="auto,xla_native,xla_chunked",
                 help=f"fl impls to compare with the flax baseline; among {fl.IMPLS + ('auto',)}")
  p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
  p.add_argument("--mem-limit-gb", type=float,
                 default=round(harness.default_mem_limit() * 2 / 2**30, 1),
                 help="don't run a cell whose compiled memory exceeds this (default: half the memory "
                      "available, at most 16)")
  p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
  p.add_argument("--one", nargs=3, metavar=("VARIANT", "LEN", "BATCH"), help=argparse.SUPPRESS)
  compile_cache.add_argument(p)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  compile_cache.enable(args.compilation_cache_dir)
  mem_limit = int(args.mem_limit_gb * 2**30)
  if args.one:
    variant, seq_len, batch = args.one[0], int(args.one[1]), int(args.one[2])
    print(json.dumps(run_one(variant, seq_len, batch, steps=args.steps, mem_limit=mem_limit)))
    return 0
  batches = dict(CONFIGS)
  variants = [STOCK] + [v for v in args.impls.split(",") if v]
  rows = []
  for seq_len in (int(n) for n in args.lengths.split(",") if n):
    for variant in variants:
      row = _subprocess_row(variant, seq_len, batches.get(seq_len, 1), args)
      print(f"  {variant:12s} {seq_len:6d} {row['status']:8s} "
            f"{row.get('step_s', 0):.2f} s/step {row.get('reason', '')}", file=sys.stderr, flush=True)
      rows.append(row)
  add_ratios(rows)
  print(markdown(rows))
  if args.json:
    harness_dir = os.path.dirname(os.path.abspath(args.json))
    os.makedirs(harness_dir, exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
