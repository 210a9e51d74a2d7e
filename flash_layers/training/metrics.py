"""Classification metrics, throughput/MFU, and where metrics are written.

Counts are accumulated on device as a confusion matrix (exact integers, so the
sum over batches does not depend on batch order); accuracy and macro-F1 are
derived from it on the host. Only process 0 writes: metrics.jsonl (one JSON
object per line, flushed each line), TensorBoard event files and the console.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("flash_layers.training")


# ----------------------------------------------------------------------------
# Classification metrics
# ----------------------------------------------------------------------------

def confusion_matrix(predictions: jax.Array, labels: jax.Array, weights: jax.Array,
                     num_labels: int) -> jax.Array:
  """int32 [true, predicted] counts of the examples with weight > 0 (jit-friendly)."""
  valid = (weights > 0).astype(jnp.int32)
  true = jax.nn.one_hot(labels, num_labels, dtype=jnp.int32) * valid[..., None]
  pred = jax.nn.one_hot(predictions, num_labels, dtype=jnp.int32)
  true = true.reshape(-1, num_labels)
  pred = pred.reshape(-1, num_labels)
  return jnp.einsum("nt,np->tp", true, pred, preferred_element_type=jnp.int32)


def accuracy(confusion: np.ndarray) -> float:
  total = confusion.sum()
  return float(np.trace(confusion) / total) if total else float("nan")


def macro_f1(confusion: np.ndarray) -> float:
  """Mean F1 over the classes that occur (as true or predicted labels)."""
  confusion = np.asarray(confusion, np.float64)
  true_pos = np.diag(confusion)
  support = confusion.sum(axis=1)
  predicted = confusion.sum(axis=0)
  present = (support + predicted) > 0
  if not present.any():
    return float("nan")
  f1 = 2 * true_pos[present] / (support[present] + predicted[present])
  return float(f1.mean())


def summarize(confusion: np.ndarray) -> dict:
  return {"accuracy": accuracy(confusion), "macro_f1": macro_f1(confusion)}


# ----------------------------------------------------------------------------
# Throughput and MFU
# ----------------------------------------------------------------------------

# Dense peak FLOP/s per chip (bf16 on TPUs/GPUs) by jax device_kind prefix.
# CPUs have no meaningful table entry: a rough 100 GFLOP/s per device is used
# and the MFU is labelled an estimate everywhere.
PEAK_FLOPS = {
  "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
  "TPU v6 lite": 918e12, "TPU v6e": 918e12, "NVIDIA H100": 989e12, "NVIDIA H200": 989e12,
  "NVIDIA A100": 312e12, "cpu": 100e9,
}

# HBM per chip in bytes, for the dry run's "fits" verdict.
HBM_BYTES = {
  "v4": 32 * 2**30, "v5e": 16 * 2**30, "v5litepod": 16 * 2**30, "v5p": 95 * 2**30,
  "v6e": 32 * 2**30,
}


def peak_flops_per_device(device_kind: str, override: float | None = None) -> float:
  if override:
    return float(override)
  for prefix, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
    if device_kind.lower().startswith(prefix.lower()):
      return flops
  return PEAK_FLOPS["cpu"]


def compiled_flops(compiled) -> float | None:
  """FLOPs of one call of a compiled function, from XLA's cost analysis (None if unknown)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends do not implement it
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  return float(cost["flops"])


# ----------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------

def _json_safe(value):
  if isinstance(value, (np.floating, float)):
    value = float(value)
    return value if math.isfinite(value) else str(value)
  if isinstance(value, np.integer):
    return int(value)
  if isinstance(value, np.ndarray):
    return value.tolist()
  return value


class MetricWriter:
  """metrics.jsonl + TensorBoard, process 0 only; other processes get a no-op writer."""

  def __init__(self, workdir: str, *, enabled: bool | None = None, resume_step: int = 0):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = None
    self._tb = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    _truncate_after(self.path, resume_step)
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- open for the whole run
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)
    except ImportError:
      log.warning("tensorboardX is not installed; writing metrics.jsonl only")

  def write(self, step: int, split: str, values: dict):
    if not self.enabled:
      return
    record = {"step": int(step), "split": split, **{k: _json_safe(v) for k, v in values.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for name, value in values.items():
        if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
          self._tb.add_scalar(f"{split}/{name}", float(value), int(step))

  def close(self):
    if self._file:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def _truncate_after(path: str, step: int):
  """On resume, drop records written after the restored step: those steps run again."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  kept = []
  for line in lines:
    try:
      if json.loads(line)["step"] <= step:
        kept.append(line)
    except (ValueError, KeyError):
      continue  # a line cut short by a kill
  if len(kept) != len(lines):
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(kept)


def read_metrics(workdir: str, split: str | None = None) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      if split is None or record.get("split") == split:
        records.append(record)
  return records


class Progress:
  """A logging-based progress line with ETA (process 0 only)."""

  def __init__(self, total_steps: int, start_step: int):
    self.total = total_steps
    self.start_step = start_step
    self.start_time = time.perf_counter()
    self.enabled = jax.process_index() == 0

  def update(self, step: int, values: dict):
    if not self.enabled:
      return
    done = step - self.start_step
    elapsed = time.perf_counter() - self.start_time
    eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
    width = 20
    filled = int(width * step / self.total)
    bar = "#" * filled + "." * (width - filled)
    shown = "  ".join(f"{k} {_fmt(v)}" for k, v in values.items())
    log.info("[%s] %d/%d  %s  elapsed %s  ETA %s", bar, step, self.total, shown,
             _duration(elapsed), _duration(eta))


def _fmt(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def summary_table(rows: dict[str, dict]) -> str:
  """A plain-text table: one row per split, one column per metric."""
  columns = []
  for values in rows.values():
    for name in values:
      if name not in columns:
        columns.append(name)
  header = ["split", *columns]
  body = [[split, *(_fmt(values.get(c, "")) for c in columns)] for split, values in rows.items()]
  widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header))]
  line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True))
  return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, body)])
