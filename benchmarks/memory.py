"""Long-run memory check: does a training run's memory stay flat?

    python -m benchmarks.memory --steps 600 --json benchmarks/results/memory-cpu.json \\
        --plot docs/img/memory-plateau.png

Trains configs/tiny.py (a 2-layer, 32-wide BERT) through the real training loop,
`flash_layers.training.loop.train_and_evaluate`, on a small synthetic JSONL dataset,
with dev evaluations (a new best is also saved to best/) and checkpoints in between.
Every `--sample-every` steps the loop's `on_step` hook records, after a garbage
collection so that only what is still referenced counts:

* the process's resident memory (VmRSS from /proc/self/status), and its anonymous part
  (RssAnon: the heap and other private memory a leak grows; file-backed pages such as the
  mapped shared libraries can be dropped by the kernel under memory pressure),
* the number and bytes of live device arrays (`jax.live_arrays()`),
* the number of threads (a leaked thread pool shows here first).

Every 10 steps (the logging interval) it first waits for checkpoint saves in flight, so that
the live-array floor of each window is exactly what the run keeps between steps.

After warm-up (compilation, the first evaluation and the first saves), memory must
plateau: resident memory (both VmRSS and RssAnon) at the end at most `--max-growth` (5%)
above its value at 30% of the run, and no more live arrays (count or bytes) at the end
than at 30%.
The exit status is 1 when it does not.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import random
import resource
import sys
import tempfile
import time

import jax
import numpy as np

from flash_layers.training import compile_cache

REPO = pathlib.Path(__file__).resolve().parents[1]
HEAD = (0.3, 0.4)  # the first window after warm-up, as fractions of the run
TAIL = 0.9  # the last window: from 90% of the run to its end

TOPICS = {"sport": ["match", "goal", "team", "win", "player", "score", "league", "coach"],
          "tech": ["computer", "software", "chip", "phone", "internet", "data", "code", "network"],
          "food": ["bread", "cheese", "cook", "recipe", "taste", "dinner", "soup", "fruit"]}
FILLER = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "for", "on", "with", "at", "by"]


def write_dataset(root: pathlib.Path, *, train: int = 480, dev: int = 64) -> pathlib.Path:
  """train.jsonl and dev.jsonl of keyword-labelled documents (3 topics)."""
  rng = random.Random(0)
  root.mkdir(parents=True, exist_ok=True)
  for split, n in (("train", train), ("dev", dev)):
    with open(root / f"{split}.jsonl", "w", encoding="utf-8") as f:
      for _ in range(n):
        label = rng.choice(sorted(TOPICS))
        words = [rng.choice(TOPICS[label] if rng.random() < 0.3 else FILLER)
                 for _ in range(rng.randint(8, 40))]
        f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")
  return root


# ----------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------

def _proc_status() -> dict[str, str]:
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      return dict(line.split(":", 1) for line in f if ":" in line)
  except OSError:
    return {}


def resident_bytes() -> tuple[int, str]:
  """(bytes, source): the current RSS on Linux; elsewhere the peak RSS, which can only rise."""
  status = _proc_status()
  if "VmRSS" in status:
    return int(status["VmRSS"].split()[0]) * 1024, "VmRSS"
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak if sys.platform == "darwin" else peak * 1024, "ru_maxrss (peak)"


def sample(step: int) -> dict:
  gc.collect()
  arrays = jax.live_arrays()
  rss, source = resident_bytes()
  status = _proc_status()
  kib = lambda key: int(status[key].split()[0]) * 1024 if key in status else None
  threads = status.get("Threads")
  return {"step": step, "time_s": time.perf_counter(), "rss_bytes": rss, "rss_source": source,
          "rss_anon_bytes": kib("RssAnon"), "rss_file_bytes": kib("RssFile"),
          "live_arrays": len(arrays), "live_array_bytes": sum(a.nbytes for a in arrays),
          "threads": int(threads) if threads else None}


class Sampler:
  """The loop's `on_step` hook: a sample every `every` steps and at the last one.

  Every `settle_every` steps it first waits for the checkpoint saves in flight (`wait`), so that
  some samples in every window hold exactly what the run keeps between steps: how long a save
  stays in flight depends on the machine's load, and a floor taken only over unsettled samples
  would measure that load instead of a leak.
  """

  def __init__(self, every: int, num_steps: int, settle_every: int = 0, wait=None):
    self.every, self.num_steps = every, num_steps
    self.settle_every, self.wait = settle_every, wait
    self.samples: list[dict] = []

  def __call__(self, step: int, state) -> None:
    del state  # only the process-wide counts matter
    if step % self.every == 0 or step == self.num_steps:
      settle = bool(self.wait and self.settle_every and step % self.settle_every == 0)
      if settle:
        self.wait()
      self.samples.append({**sample(step), "settled": settle})


# ----------------------------------------------------------------------------
# Verdict
# ----------------------------------------------------------------------------

def plateau(samples: list[dict], num_steps: int, max_growth: float) -> dict:
  """Compare the start of the post-warm-up part of the run (30-40% of the steps) with its end (90-100%).

  Checkpoint saves in flight hold a copy of the state (orbax copies it so that training can go
  on), so single samples jump up and down; the comparison is between the medians of resident
  memory and between the floors (minimums) of the live arrays of the two windows. A leak raises
  both; a save in flight raises neither.
  """
  head = [s for s in samples if HEAD[0] * num_steps <= s["step"] <= HEAD[1] * num_steps]
  tail = [s for s in samples if s["step"] >= TAIL * num_steps]
  if len(head) < 2 or len(tail) < 2:
    raise ValueError(f"need two samples in each window; got {len(head)} and {len(tail)} "
                     "(lower --sample-every)")
  median = lambda values: float(np.median(values))
  rss = [median([s["rss_bytes"] for s in w]) for w in (head, tail)]
  has_anon = all(s.get("rss_anon_bytes") for s in head + tail)
  anon = [median([s["rss_anon_bytes"] for s in w]) for w in (head, tail)] if has_anon else None
  count = [min(s["live_arrays"] for s in w) for w in (head, tail)]
  nbytes = [min(s["live_array_bytes"] for s in w) for w in (head, tail)]
  after = [s for s in samples if s["step"] >= HEAD[0] * num_steps]
  steps = np.array([s["step"] for s in after], np.float64)
  slope = np.polyfit(steps, [s["rss_bytes"] for s in after], 1)[0] if len(after) > 2 else float("nan")
  result = {
    "head_steps": [head[0]["step"], head[-1]["step"]], "tail_steps": [tail[0]["step"], tail[-1]["step"]],
    "rss_median_bytes": rss, "rss_growth": rss[1] / rss[0] - 1,
    "rss_anon_median_bytes": anon, "rss_anon_growth": anon[1] / anon[0] - 1 if anon else None,
    "rss_endpoint_growth": after[-1]["rss_bytes"] / after[0]["rss_bytes"] - 1,
    "rss_slope_bytes_per_100_steps": float(slope * 100),
    "live_arrays_floor": count, "live_array_bytes_floor": nbytes,
    "threads_max": [max(s["threads"] or 0 for s in w) for w in (head, tail)],
    "max_growth": max_growth,
  }
  anon_ok = anon is None or result["rss_anon_growth"] <= max_growth
  result["flat"] = bool(result["rss_growth"] <= max_growth and anon_ok and count[1] <= count[0]
                        and nbytes[1] <= nbytes[0])
  return result


# ----------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------

def tiny_config(dataset: pathlib.Path, steps: int, eval_every: int, checkpoint_every: int):
  sys.path.insert(0, str(REPO))
  try:
    from configs import tiny
  finally:
    sys.path.remove(str(REPO))
  config = tiny.get_config()
  config.data.dataset = str(dataset)
  config.train.num_steps = steps
  config.train.eval_every = eval_every
  config.checkpoint.every_steps = checkpoint_every
  config.train.log_every = 10
  return config


def run(args: argparse.Namespace) -> dict:
  from flash_layers.training import loop

  every = args.sample_every or max(args.steps // 60, 1)
  eval_every = args.eval_every or max(args.steps // 6, 1)
  checkpoint_every = args.checkpoint_every or max(args.steps // 12, 1)
  with tempfile.TemporaryDirectory(prefix="memory-check-") as tmp:
    dataset = write_dataset(pathlib.Path(tmp) / "data")
    config = tiny_config(dataset, args.steps, eval_every, checkpoint_every)
    sampler = Sampler(every, args.steps, settle_every=config.train.log_every)
    sampler.samples.append({**sample(0), "settled": True})  # before anything is built
    # What train_and_evaluate runs, with the Trainer at hand so that the sampler can settle saves.
    trainer = loop.Trainer.from_config(config, os.path.join(tmp, "workdir"), on_step=sampler)
    sampler.wait = trainer.checkpoints.wait
    trainer.run()
  start = sampler.samples[0]["time_s"]
  for s in sampler.samples:
    s["time_s"] = round(s["time_s"] - start, 3)
  return {
    "what": "configs/tiny.py trained through train_and_evaluate; resident memory and live device arrays",
    "date": datetime.date.today().isoformat(),
    "host": {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
             "device": jax.devices()[0].device_kind, "jax": jax.__version__},
    "steps": args.steps, "sample_every": every, "eval_every": eval_every,
    "checkpoint_every": checkpoint_every, "log_every": config.train.log_every,
    "samples": sampler.samples,
    "plateau": plateau(sampler.samples, args.steps, args.max_growth),
  }


def plot(result: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  samples = [s for s in result["samples"] if s["step"] > 0]
  steps = [s["step"] for s in samples]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
  top.plot(steps, [s["rss_bytes"] / 2**20 for s in samples], marker=".", label="resident (VmRSS)")
  if all(s.get("rss_anon_bytes") for s in samples):
    top.plot(steps, [s["rss_anon_bytes"] / 2**20 for s in samples], marker=".", label="anonymous (RssAnon)")
  top.legend(loc="lower right", fontsize=8)
  top.set_ylabel("resident memory (MiB)")
  top.set_ylim(bottom=0)
  bottom.plot(steps, [s["live_array_bytes"] / 2**20 for s in samples], marker=".", color="tab:green")
  bottom.set_ylabel("live device arrays (MiB)", color="tab:green")
  bottom.set_ylim(bottom=0)
  count = bottom.twinx()
  count.plot(steps, [s["live_arrays"] for s in samples], linestyle="--", color="tab:purple")
  count.set_ylabel("live device arrays (count)", color="tab:purple")
  count.set_ylim(bottom=0)
  bottom.set_xlabel("training step")
  p = result["plateau"]
  for ax in (top, bottom):
    for first, last in (p["head_steps"], p["tail_steps"]):
      ax.axvspan(first, last, color="grey", alpha=0.15)
    for step in range(result["eval_every"], result["steps"], result["eval_every"]):
      ax.axvline(step, color="tab:orange", alpha=0.4, linewidth=0.8)
  top.set_title(f"configs/tiny.py, {result['steps']} steps, {result['host']['cpus']}-core "
                f"{result['host']['device'].upper()} ({result['date']}): resident memory "
                f"{p['rss_growth']:+.1%} from 30% to the end", fontsize=9)
  fig.text(0.01, 0.005, "grey: the windows compared (30-40% and 90-100% of the run); orange: dev "
           "evaluations", fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--sample-every", type=int, help="default: steps/60")
  p.add_argument("--eval-every", type=int, help="dev evaluation every N steps (default: steps/6)")
  p.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (default: steps/12)")
  p.add_argument("--max-growth", type=float, default=0.05,
                 help="largest allowed resident-memory growth after 30%% of the run (default 0.05)")
  p.add_argument("--json", metavar="PATH", help="write the samples and the verdict here")
  p.add_argument("--plot", metavar="PNG", help="plot resident memory and live arrays against steps")
  compile_cache.add_argument(p)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  compile_cache.enable(args.compilation_cache_dir)
  result = run(args)
  if args.json:
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  if args.plot:
    plot(result, args.plot)
  p = result["plateau"]
  mib = lambda n: f"{n / 2**20:.1f} MiB"
  (h0, h1), (t0, t1) = p["head_steps"], p["tail_steps"]
  rss, count, nbytes = p["rss_median_bytes"], p["live_arrays_floor"], p["live_array_bytes_floor"]
  anon = (f"; anonymous {mib(p['rss_anon_median_bytes'][0])} -> {mib(p['rss_anon_median_bytes'][1])} "
          f"({p['rss_anon_growth']:+.2%})") if p["rss_anon_median_bytes"] else ""
  print(f"steps {h0}-{h1} -> {t0}-{t1}: resident (median) {mib(rss[0])} -> {mib(rss[1])} "
        f"({p['rss_growth']:+.2%}{anon}; end points {p['rss_endpoint_growth']:+.2%}, slope "
        f"{mib(p['rss_slope_bytes_per_100_steps'])} per 100 steps); live arrays (floor) {count[0]} -> "
        f"{count[1]}, {mib(nbytes[0])} -> {mib(nbytes[1])}; threads (max) {p['threads_max'][0]} -> "
        f"{p['threads_max'][1]}: {'flat' if p['flat'] else 'NOT FLAT'}")
  return 0 if p["flat"] else 1


if __name__ == "__main__":
  sys.exit(main())
