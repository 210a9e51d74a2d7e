"""`python -m benchmarks.test_coverage`: branch coverage of flash_layers/ by the test tiers.

The data come from runs with the `[tool.coverage.run]` settings of pyproject.toml (branch coverage,
subprocesses included), one data file per measurement, e.g.

    COVERAGE_DATA_DIR=DIR PYTEST_ADDOPTS="--cov --cov-append --cov-report=" bash .ci/run

copying DIR/.coverage when the default tier's run ends (the default tier alone) and keeping it at the
end (both tiers). This command reads each file and writes the totals side by side:

    python -m benchmarks.test_coverage --measure before=OLD/.coverage default=D.coverage both=DIR/.coverage \\
        --json benchmarks/results/test-coverage-2026-12-07.json

and, for the default tier, the share of the branches both tiers cover that it covers alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import coverage


def totals(data_file: str) -> dict:
  """Branch and line totals of flash_layers/ in one coverage data file."""
  cov = coverage.Coverage(data_file=data_file, config_file=str(pathlib.Path(__file__).parent.parent /
                                                                "pyproject.toml"))
  cov.load()
  data = cov.get_data()
  branches = covered = lines = lines_covered = 0
  arcs_by_file = {}
  for path in sorted(data.measured_files()):
    if "flash_layers" not in path:
      continue
    analysis = cov._analyze(path)  # noqa: SLF001 -- coverage's own per-file numbers
    numbers = analysis.numbers
    branches += numbers.n_branches
    covered += numbers.n_branches - numbers.n_missing_branches
    lines += numbers.n_statements
    lines_covered += numbers.n_executed
    rel = path[path.index("flash_layers"):]
    arcs_by_file[rel] = {(line, to) for line, tos in analysis.executed_branch_arcs().items() for to in tos}
  return {"branches": branches, "branches_covered": covered, "branch_percent": 100.0 * covered / branches,
          "statements": lines, "statements_covered": lines_covered}, arcs_by_file


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--measure", nargs="+", required=True, metavar="NAME=DATA_FILE")
  parser.add_argument("--json", type=pathlib.Path, required=True)
  args = parser.parse_args(argv)
  rows, arcs = {}, {}
  for item in args.measure:
    name, path = item.split("=", 1)
    rows[name], arcs[name] = totals(path)
    rows[name]["data_file"] = path
  if "default" in arcs and "both" in arcs:
    both = sum(len(a) for a in arcs["both"].values())
    alone = sum(len(arcs["default"].get(f, set()) & a) for f, a in arcs["both"].items())
    rows["default_share_of_both_branches_percent"] = 100.0 * alone / both
  result = {"date": datetime.date.today().isoformat(), "package": "flash_layers", "rows": rows}
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(result, indent=1) + "\n")
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
