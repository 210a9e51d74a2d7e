"""Autotune a model's attention ahead of a run, and measure what tuning gains on this machine.

    python -m benchmarks.autotune --config configs/quickstart.py        # tune its train and eval calls
    python -m benchmarks.autotune --bench --json benchmarks/results/autotune-cpu.json

`--config`: builds the config's model, traces its training step (forward + backward, with
attention dropout if the config has it) and its evaluation step without running them, records
every attention call they make, and tunes each shape bucket once (`flash_layers.tuning`): train
calls by forward + backward time, eval calls by forward time. The winners go to the user cache
(`--cache-dir` or $FLASH_LAYERS_TUNING_DIR), where `impl="auto"` finds them in the run.

`--bench`: tuned against the fixed defaults on a 1-layer MiniLM-shaped encoder (hidden 384, 12
heads of 32, MLP 1,536; attention dropout 0.1 in training, as the quickstart), training step
(forward + backward + AdamW) and evaluation step (forward), at each length. Per length: tune
from an empty cache (its time is reported), then compile three variants, "default" and
"default_aa" (the same untuned step compiled twice: the A/A pair that states the noise) and
"tuned", and run them interleaved, round after round, so a change in the machine's load hits all
three alike. Times are process CPU seconds per step (all threads; steadier than wall time on a
shared machine), median over rounds; `uptime`'s load is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from flash_layers import auto, lowering
from flash_layers.impls.base import Request
from flash_layers.tuning import cache, tuner

HARDWARE = "2-core AMD EPYC VM, CPU only"
LENGTHS = ((512, 2), (2048, 1), (4096, 1))  # (tokens per row, batch)
MINILM_1L = dict(vocab_size=8192, hidden_size=384, num_layers=1, num_heads=12, mlp_dim=1536)


# ----------------------------------------------------------------------------
# Which attention calls a step makes
# ----------------------------------------------------------------------------

@contextlib.contextmanager
def recorded_calls():
  """Inside: every attention call traced on this platform is appended to the yielded list as
  (impl, request) (the request without block sizes; "autotune" counts as the defaults)."""
  calls: list[tuple[str, Request]] = []
  original = auto.choose
  here = lowering.default_platform()

  def recording(impl, request, platform):
    if platform == here:
      autotune = isinstance(request.block_sizes, str)
      plain = dataclasses.replace(request, block_sizes=None) if autotune else request
      if plain.block_sizes is None and (impl, plain) not in calls:
        calls.append((impl, plain))
    return original(impl, request, platform)

  auto.choose = recording
  try:
    yield calls
  finally:
    auto.choose = original


def tune_calls(calls: list[tuple[str, Request]], mode: str, *, cache_dir=None, force: bool = False,
               log=print) -> list[dict[str, Any]]:
  """Tune each distinct shape bucket among `calls` once; a report row per bucket."""
  rows, seen = [], set()
  for impl, request in calls:
    key = cache.bucket_key(impl, request)
    if key in seen:
      continue
    seen.add(key)
    hit = None if force else cache.lookup(impl, request, lowering.default_platform(), cache_dir=cache_dir)
    if hit is not None and hit.source == cache.SOURCE_CACHE:
      rows.append({"key": key, "mode": mode, "source": hit.source, "impl": hit.impl,
                   "block_sizes": cache.encode_block_sizes(hit.block_sizes)})
      continue
    log(f"tuning {key} ({mode})")
    result = tuner.tune_request(request, impl=impl, mode=mode, cache_dir=cache_dir, log=log)
    rows.append({"key": key, "mode": mode, "source": result.source, "impl": result.impl,
                 "block_sizes": cache.encode_block_sizes(result.block_sizes), "seconds": result.seconds,
                 "default_seconds": result.default_seconds, "tuning_seconds": round(result.tuning_seconds, 2),
                 "candidates": len(result.measured),
                 "rejected": [m.candidate.describe() for m in result.measured if not m.ok]})
    log(f"  -> {result.impl} {result.block_sizes} in {result.tuning_seconds:.1f} s")
  return rows


# ----------------------------------------------------------------------------
# --config: a training config's calls
# ----------------------------------------------------------------------------

def load_config(path: str):
  spec = importlib.util.spec_from_file_location("autotune_config", path)
  if spec is None or spec.loader is None:
    raise SystemExit(f"--config: cannot load {path!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def config_calls(config) -> dict[str, list[tuple[str, Request]]]:
  """{"train": calls of the training step's forward + backward, "eval": of the evaluation step}."""
  from flash_layers.training import task  # noqa: PLC0415 (the training stack only for --config)

  num_labels = config.model.num_labels or 2
  model, _ = task.build_model(config, num_labels, config.model.vocab_size or 30522)
  logits_fn = task.make_logits_fn(model)
  max_docs = config.data.max_docs_per_row if config.data.packing else 1
  from flash_layers import models  # noqa: PLC0415
  params = jax.eval_shape(lambda: models.init_params(model, jax.random.key(0)))

  def batch(rows: int) -> dict:
    shape = (rows, config.model.max_len)
    ids = jax.ShapeDtypeStruct(shape, jnp.int32)
    return {"input_ids": ids, "segment_ids": ids, "positions": ids,
            "labels": jax.ShapeDtypeStruct((rows, max_docs), jnp.int32)}

  train_rows = config.train.batch_size // config.train.grad_accum_steps
  eval_rows = task.eval_batch_size(config)

  def loss(params, batch):
    return jnp.sum(logits_fn(params, batch, train=True, rng=jax.random.key(0)).astype(jnp.float32))

  out = {}
  with recorded_calls() as calls:
    jax.eval_shape(jax.grad(loss), params, batch(train_rows))
  out["train"] = list(calls)
  with recorded_calls() as calls:
    jax.eval_shape(lambda p, b: logits_fn(p, b, train=False, rng=None), params, batch(eval_rows))
  out["eval"] = list(calls)
  return out


def tune_config(path: str, *, cache_dir=None, force: bool = False) -> dict[str, Any]:
  config = load_config(path)
  start = time.perf_counter()
  rows = []
  for mode, calls in config_calls(config).items():
    rows += tune_calls(calls, mode, cache_dir=cache_dir, force=force)
  return {"config": path, "device_kind": cache.device_kind(), "tuning_seconds": time.perf_counter() - start,
          "cache": str(cache.file_for(cache.user_dir(cache_dir), cache.device_kind())), "buckets": rows}


# ----------------------------------------------------------------------------
# --bench: tuned vs default on a 1-layer encoder
# ----------------------------------------------------------------------------

def _model(length: int):
  from flash_layers.models import Bert  # noqa: PLC0415
  return Bert(**MINILM_1L, max_len=length, num_labels=2, pooling="mean", impl="auto", dropout_rate=0.1,
              attention_dropout_rate=0.1)


def _data(length: int, batch: int) -> dict:
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"input_ids": jax.random.randint(k1, (batch, length), 1, MINILM_1L["vocab_size"]),
          "segment_ids": jnp.ones((batch, length), jnp.int32),
          "labels": jax.random.randint(k2, (batch,), 0, 2)}


def _steps(model, tx):
  def loss_fn(params, batch, rng):
    logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"], deterministic=False,
                         rngs={"dropout": rng})[:, 0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

  def train(params, opt_state, batch, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def evaluate(params, batch):
    return model.apply({"params": params}, batch["input_ids"], batch["segment_ids"], deterministic=True)[:, 0]

  return train, evaluate


def _load() -> dict[str, Any]:
  return {"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
          "load_avg_1min": os.getloadavg()[0]}


def bench_length(length: int, batch: int, rounds: int, log=print) -> dict[str, Any]:
  """Tune one length's calls from an empty cache, then time default / default_aa / tuned."""
  from flash_layers.models import init_params  # noqa: PLC0415
  model = _model(length)
  params = jax.jit(lambda r: init_params(model, r))(jax.random.key(0))
  tx = optax.adamw(1e-4)
  train, evaluate = _steps(model, tx)
  data = _data(length, batch)
  rng = jax.random.key(1)
  opt_state = tx.init(params)
  row: dict[str, Any] = {"seq_len": length, "batch": batch, "load_before": _load()}

  # Which attention calls each step makes, then tune them (timed: what a user waits for).
  with recorded_calls() as train_calls:
    jax.eval_shape(train, params, opt_state, data, rng)
  with recorded_calls() as eval_calls:
    jax.eval_shape(evaluate, params, data)
  start = time.perf_counter()
  tuned_rows = tune_calls(train_calls, "train", log=log) + tune_calls(eval_calls, "eval", log=log)
  row["tuning_seconds"] = round(time.perf_counter() - start, 1)
  row["buckets"] = tuned_rows

  results = {}
  passes = (("train", train, (params, opt_state, data, rng)), ("eval", evaluate, (params, data)))
  for pass_, fn, args in passes:
    compiled = {}
    for variant in ("default", "default_aa", "tuned"):
      scope = cache.disabled() if variant.startswith("default") else contextlib.nullcontext()
      with scope:
        compiled[variant] = jax.jit(fn).lower(*args).compile()
    state = {v: args for v in compiled}
    for v, step in compiled.items():  # warm up every variant before timing any
      out = step(*state[v])
      jax.block_until_ready(out)
      if pass_ == "train":
        state[v] = (out[0], out[1], data, rng)
    cpu = {v: [] for v in compiled}
    wall = {v: [] for v in compiled}
    for i in range(rounds):
      for v, step in compiled.items():
        run_args = state[v] if pass_ == "eval" else (*state[v][:3], jax.random.fold_in(rng, i))
        start, start_cpu = time.perf_counter(), time.process_time()
        out = step(*run_args)
        jax.block_until_ready(out)
        cpu[v].append(time.process_time() - start_cpu)
        wall[v].append(time.perf_counter() - start)
        if pass_ == "train":
          state[v] = (out[0], out[1], data, rng)
    med = {v: statistics.median(x) for v, x in cpu.items()}
    results[pass_] = {
        "cpu_s": med, "cpu_s_min": {v: min(x) for v, x in cpu.items()},
        "wall_s": {v: statistics.median(x) for v, x in wall.items()}, "rounds": rounds,
        "speedup_tuned": med["default"] / med["tuned"],
        "aa_ratio": med["default_aa"] / med["default"],
        # per-round paired ratios: the spread the noise statement rests on
        "paired_tuned_over_default": [t / d for t, d in zip(cpu["tuned"], cpu["default"], strict=True)],
        "paired_aa_over_default": [a / d for a, d in zip(cpu["default_aa"], cpu["default"], strict=True)],
    }
    log(f"{length} {pass_}: default {med['default']:.3f} s, A/A {med['default_aa']:.3f} s, "
        f"tuned {med['tuned']:.3f} s -> {results[pass_]['speedup_tuned']:.2f}x "
        f"(A/A {results[pass_]['aa_ratio']:.2f})")
  row["passes"] = results
  row["explain_tuned"] = [str(x) for x in _explained(length, batch)]
  row["load_after"] = _load()
  return row


def _explained(length: int, batch: int) -> list:
  import flash_layers as fl  # noqa: PLC0415
  q = jax.ShapeDtypeStruct((batch, length, MINILM_1L["num_heads"], 32), jnp.float32)
  seg = jnp.ones((batch, length), jnp.int32)
  return [fl.explain(q, q, q, segment_ids=seg, dropout_rate=0.1, dropout_rng=jax.random.key(0)),
          fl.explain(q, q, q, segment_ids=seg)]


def bench(lengths, rounds: int, log=print, partial: str | None = None) -> dict[str, Any]:
  """Every length in turn; after each, the report so far is written to `partial` (if given)."""
  report = {"benchmark": "autotune", "date": datetime.date.today().isoformat(), "hardware": HARDWARE,
            "device_kind": cache.device_kind(), "jax": jax.__version__, "model": MINILM_1L | {"head_dim": 32},
            "timer": "process CPU time per step (all threads), median over interleaved rounds",
            "rows": [], "tuned_cache": None}
  with tempfile.TemporaryDirectory() as tmp:  # tune from empty: the tuning time is the real one
    saved = {k: os.environ.get(k) for k in (cache.ENV_DIR, cache.ENV_SHIPPED)}
    os.environ[cache.ENV_DIR], os.environ[cache.ENV_SHIPPED] = tmp, "0"
    try:
      for length, batch in lengths:
        report["rows"].append(bench_length(length, batch, rounds, log))
        report["tuned_cache"] = json.loads(cache.file_for(pathlib.Path(tmp), cache.device_kind()).read_text())
        if partial:
          pathlib.Path(partial).write_text(json.dumps(report, indent=1, default=str) + "\n")
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
  return report


def markdown(report: dict[str, Any]) -> str:
  """The --bench table: per length and pass, CPU s/step of default, A/A and tuned, the gain, tuning time."""
  lines = ["| tokens x batch | pass | default | A/A (noise) | tuned | tuned speedup | tuned/default time per "
           "round (min-max) | what tuning chose | tuning time | load (1 min) |", "|" + "---|" * 10]
  for row in report["rows"]:
    chosen = "; ".join(f"{b['mode']}: {b['impl']}"
                       + (f" ({_sizes(b['block_sizes'])})" if b["block_sizes"] else "")
                       for b in row["buckets"])
    for name, x in row["passes"].items():
      t = x["cpu_s"]
      paired = x["paired_tuned_over_default"]
      lines.append(
          f"| {row['seq_len']:,} x {row['batch']} | {name} | {t['default']:.3f} s | {t['default_aa']:.3f} s "
          f"({x['aa_ratio']:.2f}) | {t['tuned']:.3f} s | {x['speedup_tuned']:.2f}x | {min(paired):.2f}-"
          f"{max(paired):.2f} | {chosen if name == 'train' else ''} | "
          f"{str(row['tuning_seconds']) + ' s' if name == 'train' else ''} | "
          f"{row['load_before']['load_avg_1min']:.0f}-{row['load_after']['load_avg_1min']:.0f} |")
  return "\n".join(lines)


def _sizes(encoded: dict) -> str:
  return ", ".join(f"{k} {v}" for k, v in encoded.items() if k != "family" and v is not None) or "defaults"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", help="tune this training config's attention calls (train and eval)")
  p.add_argument("--bench", action="store_true", help="measure tuned vs default on a 1-layer encoder")
  p.add_argument("--lengths", default=",".join(f"{n}x{b}" for n, b in LENGTHS),
                 help="--bench: tokens x batch, comma-separated (default %(default)s)")
  p.add_argument("--rounds", type=int, default=7, help="--bench: interleaved rounds per pass")
  p.add_argument("--cache-dir", help="the tuning cache directory (default: $FLASH_LAYERS_TUNING_DIR or "
                 "~/.cache/flash_layers/tuning)")
  p.add_argument("--force", action="store_true", help="--config: tune buckets already in the cache again")
  p.add_argument("--ship", help="--bench: also write the tuned entries to this JSON file (shipped table)")
  p.add_argument("--json", help="write the results here")
  p.add_argument("--from-json", help="print the markdown table of a --bench results file")
  args = p.parse_args(argv)
  if sum(map(bool, (args.config, args.bench, args.from_json))) != 1:
    p.error("give exactly one of --config, --bench or --from-json")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.from_json:
    print(markdown(json.loads(pathlib.Path(args.from_json).read_text())))
    return 0
  if args.config:
    report = tune_config(args.config, cache_dir=args.cache_dir, force=args.force)
  else:
    lengths = [tuple(int(x) for x in item.split("x")) for item in args.lengths.split(",")]
    report = bench(lengths, args.rounds, partial=args.json)
    if args.ship:
      pathlib.Path(args.ship).write_text(json.dumps(report["tuned_cache"], indent=1, sort_keys=True) + "\n")
  text = json.dumps(report, indent=1, default=str)
  if args.json:
    pathlib.Path(args.json).write_text(text + "\n")
  print(text if not args.bench else json.dumps({r["seq_len"]: {p: (round(x["speedup_tuned"], 3),
                                                                    round(x["aa_ratio"], 3))
                                                                for p, x in r["passes"].items()}
                                                for r in report["rows"]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
