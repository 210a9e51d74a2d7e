"""README command 1, run as written and timed: `python -m benchmarks.quickstart [--out FILE]`.

The command is read from README.md (the line after "# 1."), split at its `&&` into stages (install,
train, eval), and each stage runs in a shell from the repository root with its workdir moved to a fresh
temporary folder (an existing workdir would resume). Per stage: wall seconds and the CPU seconds of the
child processes. The stages share a fresh, empty compilation cache (FLASH_LAYERS_CACHE), so the
times are a first run's: a user's warm cache would make them shorter. The eval stage's
`eval_metrics.json` gives the test accuracy and macro-F1. The load
average before the run is recorded, so an idle run can be told from a busy one.

The result (JSON) is what README.md's quickstart row is rendered from (benchmarks/docs_numbers.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

from benchmarks.machine import children_cpu, cpu_model

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKDIR = "runs/quickstart"


def readme_command(readme: pathlib.Path = REPO / "README.md") -> str:
  """README command 1: the line after the comment that starts with "# 1."."""
  lines = readme.read_text().splitlines()
  for i, line in enumerate(lines):
    if line.startswith("# 1."):
      return lines[i + 1].strip()
  raise ValueError(f"{readme}: no line starting with '# 1.' (README command 1)")


def stages(command: str) -> list[tuple[str, str]]:
  """(name, shell command) per `&&`-separated part: "install" for pip, else the script's name."""
  named = []
  for part in (p.strip() for p in command.split("&&")):
    if part.startswith("pip "):
      name = "install"
    else:
      name = pathlib.Path(part.split()[1]).stem  # "python train.py ..." -> "train"
    if named and named[-1][0] == name:
      named[-1] = (name, f"{named[-1][1]} && {part}")
    else:
      named.append((name, part))
  return named


def run(out: pathlib.Path | None, plot: pathlib.Path | None = None,
        keep: pathlib.Path | None = None) -> dict:
  command = readme_command()
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="quickstart-"))
  env = {**os.environ, "FLASH_LAYERS_CACHE": str(workdir / "cache")}  # a first run: nothing compiled yet
  result = {"command": command, "date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()}-core CPU, {cpu_model()}",
            "load_average_before": os.getloadavg(), "compilation_cache": "empty (first run)",
            "stages": {}}
  try:
    for name, part in stages(command.replace(WORKDIR, str(workdir))):
      cpu0, wall0 = children_cpu(), time.perf_counter()
      subprocess.run(["bash", "-c", part], cwd=REPO, env=env, check=True)
      result["stages"][name] = {"wall_s": time.perf_counter() - wall0, "cpu_s": children_cpu() - cpu0}
      print(f"{name}: {result['stages'][name]}", flush=True)
    result["load_average_after"] = os.getloadavg()
    metrics = json.loads((workdir / "eval_metrics.json").read_text())
    if plot is not None:
      from flash_layers.training import plot as plot_lib
      plot_lib.plot(str(workdir), str(plot), title=f"quickstart, {result['date']}")
    if keep is not None:  # the trained run, e.g. to export it (flash_layers.export)
      shutil.rmtree(workdir / "cache", ignore_errors=True)
      shutil.copytree(workdir, keep)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  confusion = metrics["confusion_matrix"]
  result.update(
    split=metrics["split"], accuracy=metrics["accuracy"], macro_f1=metrics["macro_f1"],
    n_correct=int(sum(confusion[i][i] for i in range(len(confusion)))),
    n_total=int(sum(map(sum, confusion))),
    wall_s=sum(s["wall_s"] for s in result["stages"].values()),
    cpu_s=sum(s["cpu_s"] for s in result["stages"].values()))
  print(json.dumps({k: v for k, v in result.items() if k != "stages"}, indent=1))
  if out is not None:
    out.write_text(json.dumps(result, indent=1) + "\n")
  return result


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=None, help="write the result as JSON here")
  parser.add_argument("--plot", type=pathlib.Path, default=None,
                      help="also draw the run's training curve here (a PNG path)")
  parser.add_argument("--keep", type=pathlib.Path, default=None,
                      help="copy the run's workdir (checkpoints, metrics) here instead of only deleting it")
  args = parser.parse_args(argv)
  if args.keep is not None and args.keep.exists():
    parser.error(f"--keep {args.keep}: already exists")
  run(args.out, args.plot, args.keep)


if __name__ == "__main__":
  main()
