"""Training curves from a run's metrics.jsonl: `python -m flash_layers.training.plot WORKDIR [OUT.png]`.

Left: the per-step training loss and its moving average, with dev loss points.
Right: training-window accuracy, dev accuracy and dev macro-F1 (and the final
eval.py result if workdir/eval_metrics.json exists).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from flash_layers.training.metrics import read_metrics


def plot(workdir: str, out: str | None = None, title: str | None = None) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out = out or os.path.join(workdir, "training_curve.png")
  train = read_metrics(workdir, "train")
  windows = read_metrics(workdir, "train_window")
  dev = read_metrics(workdir, "dev")
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))

  steps = np.array([r["step"] for r in train])
  losses = np.array([r["loss"] for r in train], dtype=float)
  left.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss (per step)")
  if len(losses) >= 5:
    width = max(5, len(losses) // 20)
    smooth = np.convolve(losses, np.ones(width) / width, mode="valid")
    left.plot(steps[width - 1:], smooth, color="tab:blue", label=f"train loss ({width}-step mean)")
  if dev:
    left.plot([r["step"] for r in dev], [r["loss"] for r in dev], "o-", color="tab:orange", label="dev loss")
  left.set_xlabel("step")
  left.set_ylabel("cross-entropy")
  left.set_yscale("log")
  left.legend()
  left.grid(alpha=0.3)

  if windows:
    right.plot([r["step"] for r in windows], [r["accuracy"] for r in windows], color="tab:blue", alpha=0.6,
               label="train accuracy (window)")
  if dev:
    right.plot([r["step"] for r in dev], [r["accuracy"] for r in dev], "o-", color="tab:orange",
               label="dev accuracy")
    right.plot([r["step"] for r in dev], [r["macro_f1"] for r in dev], "s--", color="tab:green",
               label="dev macro-F1")
  eval_path = os.path.join(workdir, "eval_metrics.json")
  if os.path.exists(eval_path):
    with open(eval_path, encoding="utf-8") as f:
      final = json.load(f)
    right.plot([final["checkpoint_step"]], [final["accuracy"]], "*", markersize=14, color="tab:red",
               label=f"{final['split']} accuracy {final['accuracy']:.3f}")
  right.set_xlabel("step")
  right.set_ylabel("fraction")
  right.set_ylim(0, 1.02)
  right.legend(loc="lower right")
  right.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def main(argv: list[str]) -> None:
  if len(argv) not in (2, 3):
    raise SystemExit("usage: python -m flash_layers.training.plot WORKDIR [OUT.png]")
  print(plot(argv[1], argv[2] if len(argv) == 3 else None))


if __name__ == "__main__":
  main(sys.argv)
