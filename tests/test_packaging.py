"""What `pip install .` ships: the library and its public oracle, never the benchmarks or the tests."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_holds_the_library_only(tmp_path):
  subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                  "-q", "-w", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path)
  (wheel,) = tmp_path.glob("flash_layers-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
  assert top_level == {"flash_layers"}, top_level
  assert "flash_layers/testing/reference64.py" in names
  assert "flash_layers/impls/flash_pallas/tpu.py" in names
  assert "flash_layers/tuning/data/cpu_amd_epyc_2.json" in names  # the shipped tuning table
  assert not any("bench" in name for name in names), [n for n in names if "bench" in n]
