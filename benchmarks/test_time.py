"""`python -m benchmarks.test_time`: how long the test tiers take a newcomer, measured as one would.

Each round clones the repository (HEAD of this checkout) into a fresh folder, makes a fresh virtualenv,
installs as README command 2 does (timed apart), then times README command 2's test step, the default
tier, from a state with no compile or test caches. With `--ci` a round runs `.ci/run` instead, which
installs and then runs both tiers (the install is inside that figure). One JSON file records every
round: its wall time, the load average before it, pytest's summary line, and the machine.

    python -m benchmarks.test_time --rounds 3 --json benchmarks/results/test-time-default-2026-12-07.json
    python -m benchmarks.test_time --rounds 1 --ci --json benchmarks/results/test-time-ci-2026-12-07.json

Nothing else should run on the machine meanwhile: the figures are wall times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks import cpu_dense

ROOT = pathlib.Path(__file__).resolve().parent.parent
INSTALL = ("pip install -q -r requirements.txt && pip install -q --no-deps -r requirements-assets.txt && "
           "pip install -q --no-deps -e .")
TESTS = "python -m pytest -n 2 -q"  # README command 2's test step


def _readme_test_command() -> str:
  """README command 2, checked to be what this benchmark times."""
  text = (ROOT / "README.md").read_text()
  line = next(line for line in text.splitlines() if line.endswith(TESTS) and "pip install" in line)
  assert line.strip() == f"{INSTALL.replace(' -q', '')} && {TESTS}", line
  return line


def _sh(command: str, cwd: pathlib.Path, env: dict) -> tuple[float, str, int]:
  start = time.perf_counter()
  proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
  return time.perf_counter() - start, proc.stdout + proc.stderr, proc.returncode


def one_round(ci: bool, python: str, addopts: str = "") -> dict:
  work = pathlib.Path(tempfile.mkdtemp(prefix="fl-test-time-"))
  try:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work / "repo")], check=True)
    repo = work / "repo"
    subprocess.run([python, "-m", "venv", str(work / "venv")], check=True)
    ours = ("JAX_", "XLA_", "FLASH_LAYERS_", "PYTEST_", "COVERAGE_", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env["PATH"] = f"{work / 'venv' / 'bin'}:{env['PATH']}"
    env["HOME"] = str(work / "home")  # no user cache (JAX, pip wheels are pip's own) carries over
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR", str(pathlib.Path.home() / ".cache" / "pip"))
    if addopts:  # e.g. a shuffled order or another --dist mode: the same command, recorded as such
      env["PYTEST_ADDOPTS"] = addopts
    load = os.getloadavg()
    if ci:
      wall, out, rc = _sh("bash .ci/run", repo, env)
      install = None
    else:
      install, out, rc = _sh(INSTALL, repo, env)
      assert rc == 0, out[-3000:]
      load = os.getloadavg()
      wall, out, rc = _sh(TESTS, repo, env)
    summaries = re.findall(r"^=*\s*(\d+ passed.*?)\s*=*$", out, re.M) or out.splitlines()[-3:]
    tiers = tier_runs(summaries)
    return {"command": "bash .ci/run" if ci else TESTS, "pytest_addopts": addopts, "wall_s": round(wall, 1),
            "install_s": None if install is None else round(install, 1), "returncode": rc,
            "load_average_before": [round(x, 2) for x in load], "summary": summaries, "tiers": tiers,
            "tail": out[-2000:] if rc else ""}
  finally:
    shutil.rmtree(work, ignore_errors=True)


def tier_runs(summaries: list[str]) -> list[dict]:
  """Each pytest run's tests and seconds, from its summary line ("1309 passed in 680.1s (0:11:20)")."""
  runs = []
  for line in summaries:
    found = re.search(r"(\d+) passed.* in ([0-9.]+)s", line)
    if found:
      runs.append({"passed": int(found.group(1)), "seconds": float(found.group(2))})
  return runs


def _passed(round_: dict) -> int | None:
  found = re.search(r"(\d+) passed", " ".join(round_["summary"]))
  return int(found.group(1)) if found else None


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--ci", action="store_true", help="time `bash .ci/run` (install and both tiers)")
  parser.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
  parser.add_argument("--json", type=pathlib.Path, required=True)
  parser.add_argument("--addopts", action="append", default=[],
                      help="PYTEST_ADDOPTS of a round (repeat: one per round, cycled), e.g. "
                           "'--random-order-bucket=global --random-order-seed=1'")
  args = parser.parse_args(argv)
  _readme_test_command()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  rounds = []
  for i in range(args.rounds):
    addopts = args.addopts[i % len(args.addopts)] if args.addopts else ""
    rounds.append(one_round(args.ci, args.python, addopts))
    print(f"round {i + 1}: {rounds[-1]['wall_s']:.0f} s, {rounds[-1]['summary']}", flush=True)
  walls = sorted(r["wall_s"] for r in rounds)
  result = {
      "date": datetime.date.today().isoformat(), "commit": commit,
      "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
      "cpu_model": cpu_dense.cpu_model(), "rounds": rounds, "default_tests": _passed(rounds[0]),
      "median_wall_s": walls[len(walls) // 2], "median_wall_min": walls[len(walls) // 2] / 60}
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(result, indent=1) + "\n")
  print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))


if __name__ == "__main__":
  main()
