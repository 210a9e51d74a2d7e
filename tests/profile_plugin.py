"""Per-test wall time, and how much of it JAX spent tracing, lowering and compiling.

Registered by conftest.py when asked for:

  python -m pytest -n 2 -q --profile-out=DIR           # DIR/profile-<worker>.json, DIR/profile.json merged
  python -m pytest -n 2 -q --write-durations            # also refresh tests/durations.json (docs/testing.md)

Compile time comes from jax.monitoring's duration events (the in-process ones: a test's subprocesses
count in its wall time only). The durations file orders the longest tests first under `-n 2` and is
what tests/test_tiers.py reads to keep the default tier fast; it is measured data, never a limit on
a live clock.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DURATIONS = os.path.join(HERE, "durations.json")

# jax.monitoring duration events that are compile work, by the stage they time.
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
STAGES = ("trace", "lower", "compile")


def add_options(parser: pytest.Parser) -> None:
  group = parser.getgroup("flash_layers profile")
  group.addoption("--profile-out", default=None, metavar="DIR",
                  help="write each test's wall seconds and JAX trace/lower/compile seconds to DIR")
  group.addoption("--write-durations", action="store_true",
                  help=f"merge the tests' wall seconds into {os.path.relpath(DURATIONS)}")


def load_durations() -> dict[str, float]:
  """Recorded wall seconds by test id (empty when the file is missing)."""
  try:
    with open(DURATIONS) as f:
      return json.load(f)["seconds"]
  except FileNotFoundError:
    return {}


class Profiler:
  """The pytest plugin: one per process (xdist workers each record their own tests)."""

  def __init__(self, config: pytest.Config):
    self.out = config.getoption("--profile-out")
    self.write_durations = config.getoption("--write-durations")
    if self.write_durations and not self.out:
      self.out = os.path.join(str(config.rootpath), ".pytest-profile")
    self.worker = os.environ.get("PYTEST_XDIST_WORKER")
    self.is_controller = not hasattr(config, "workerinput")
    self.records: list[dict] = []
    self.current: dict | None = None
    if self.is_controller:  # workers start after this: clear what an earlier run left
      for stale in glob.glob(os.path.join(self.out, "profile*.json")):
        os.remove(stale)
    if not self.is_controller or config.getoption("numprocesses", None) in (None, 0):
      import jax.monitoring
      jax.monitoring.register_event_duration_secs_listener(self._listener)

  def _listener(self, event: str, duration: float, **_) -> None:
    stage = COMPILE_EVENTS.get(event)
    if stage is not None and self.current is not None:
      self.current[stage] = self.current.get(stage, 0.0) + duration

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item, nextitem):
    self.current = {"test": item.nodeid}
    start = time.perf_counter()
    yield
    self.current["wall"] = time.perf_counter() - start
    self.records.append(self.current)
    self.current = None

  def pytest_sessionfinish(self, session):
    os.makedirs(self.out, exist_ok=True)
    if self.records:
      with open(os.path.join(self.out, f"profile-{self.worker or 'main'}.json"), "w") as f:
        json.dump(self.records, f)
    if not self.is_controller:
      return
    merged = []
    for path in sorted(glob.glob(os.path.join(self.out, "profile-*.json"))):
      with open(path) as f:
        merged += json.load(f)
    with open(os.path.join(self.out, "profile.json"), "w") as f:
      json.dump(sorted(merged, key=lambda r: -r["wall"]), f, indent=0)
    if self.write_durations:
      _merge_durations(merged, session.config)


def _merge_durations(records: list[dict], config: pytest.Config) -> None:
  seconds = load_durations()
  seconds.update({r["test"]: round(r["wall"], 2) for r in records})
  workers = config.getoption("numprocesses", None) or 0
  with open(DURATIONS, "w") as f:
    json.dump({
        "about": "wall seconds per test id, written by `python -m pytest -n 2 -q --write-durations` "
                 "(and `-m slow` for the second tier); read by conftest.py (order) and tests/test_tiers.py",
        "measured_on": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"pytest -n {workers}, {datetime.date.today().isoformat()}",
        "seconds": dict(sorted(seconds.items())),
    }, f, indent=0)
    f.write("\n")


def summarize(records: list[dict]) -> dict:
  """Totals of a profile: tests, wall and compile seconds, and per test module."""
  modules: dict[str, dict] = {}
  for r in records:
    m = modules.setdefault(r["test"].split("::")[0], {"tests": 0, "wall_s": 0.0, "compile_s": 0.0})
    m["tests"] += 1
    m["wall_s"] += r["wall"]
    m["compile_s"] += sum(r.get(k, 0.0) for k in STAGES)
  wall = sum(m["wall_s"] for m in modules.values())
  compile_s = sum(m["compile_s"] for m in modules.values())
  return {"tests": len(records), "wall_s": round(wall, 1), "compile_s": round(compile_s, 1),
          "compile_share": round(compile_s / wall, 3),
          "stages_s": {k: round(sum(r.get(k, 0.0) for r in records), 1) for k in STAGES},
          "modules": {k: {"tests": v["tests"], "wall_s": round(v["wall_s"], 1),
                          "compile_s": round(v["compile_s"], 1)}
                      for k, v in sorted(modules.items(), key=lambda kv: -kv[1]["wall_s"])},
          "slowest": [{"test": r["test"], "wall_s": round(r["wall"], 1),
                       "compile_s": round(sum(r.get(k, 0.0) for k in STAGES), 1)}
                      for r in sorted(records, key=lambda r: -r["wall"])[:60]]}


if __name__ == "__main__":  # python tests/profile_plugin.py DIR/profile.json [...]: the summary as JSON
  import sys
  rows = []
  for name in sys.argv[1:]:
    with open(name) as f:
      rows += json.load(f)
  print(json.dumps(summarize(rows), indent=1))
