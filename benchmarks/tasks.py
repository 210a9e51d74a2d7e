"""A task config's worked example, run as docs/training.md writes it and timed:

    python -m benchmarks.tasks --config configs/multi_label.py --out benchmarks/results/task-X.json


Runs `python train.py --config CONFIG --workdir W` then `python eval.py --config CONFIG --workdir W`
(W a fresh temporary folder, with a fresh, empty compilation cache, so the times are a first run's),
and records per stage the wall seconds and the CPU seconds of the child process, the load average
before, the CPU model, the final dev metrics (train_summary.json) and eval.py's report
(eval_metrics.json). docs/training.md's task rows are rendered from the result (docs_numbers.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks import cpu_dense
from benchmarks.machine import children_cpu

REPO = pathlib.Path(__file__).resolve().parents[1]


def run(config: str, overrides: list[str]) -> dict:
  work = pathlib.Path(tempfile.mkdtemp(prefix="fl-task-"))
  env = {**os.environ, "FLASH_LAYERS_CACHE": str(work / "cache")}
  record = {"config": config, "overrides": overrides, "date": datetime.date.today().isoformat(),
            "load_average_before": list(os.getloadavg()), "cpu_model": cpu_dense.cpu_model(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "stages": {}}
  try:
    for script in ("train.py", "eval.py"):
      command = [sys.executable, script, "--config", config, "--workdir", str(work / "run"), *overrides]
      cpu, wall = children_cpu(), time.perf_counter()
      result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
      if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
      record["stages"][script.removesuffix(".py")] = {"wall_s": round(time.perf_counter() - wall, 1),
                                                      "cpu_s": round(children_cpu() - cpu, 1)}
    record["dev"] = json.loads((work / "run" / "train_summary.json").read_text())["dev"]
    report = json.loads((work / "run" / "eval_metrics.json").read_text())
    report.pop("confusion_matrix", None)
    record["eval"] = report
  finally:
    shutil.rmtree(work, ignore_errors=True)
  record["wall_s"] = round(sum(s["wall_s"] for s in record["stages"].values()), 1)
  return record


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="configs/<name>.py")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="write the result as JSON here")
  parser.add_argument("overrides", nargs="*", help="--config.a.b=value flags for both scripts")
  args = parser.parse_args(argv)
  record = run(args.config, args.overrides)
  text = json.dumps(record, indent=1)
  if args.out:
    args.out.write_text(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
