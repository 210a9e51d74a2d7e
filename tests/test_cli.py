"""train.py and eval.py as a newcomer meets them: a mistake in a config, a flag or a data file is one
line naming it and exit status 2 (before anything compiles); a bug keeps its traceback; and on a
CPU-only host libtpu (installed for the ahead-of-time tests) prints nothing.

Every case runs the script as a subprocess with the environment a user has: no JAX_PLATFORMS and
none of the TPU variables conftest.py sets for the test process (unless this host has a TPU or a
GPU, where the scripts would use it; then the CPU is forced and the libtpu checks are skipped).
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from flash_layers import host

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300
# What libtpu (or jax, failing to start it) prints when it probes for a TPU that is not there.
LIBTPU_NOISE = ("TPU accelerator type", "host bounds", "Source Location Trace", "InitGoogle", "libtpu",
                "Unable to initialize backend")
CPU_ONLY = not host.accelerator_present()


def user_env() -> dict:
  test_only = ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE", "TPU_SKIP_MDS_QUERY", "ALLOW_MULTIPLE_LIBTPU_LOAD",
               "XLA_FLAGS")
  env = {k: v for k, v in os.environ.items() if k not in test_only}
  env["PYTHONPATH"] = str(REPO)
  if not CPU_ONLY:
    env["JAX_PLATFORMS"] = "cpu"
  return env


def assert_no_libtpu_noise(output: str):
  if not CPU_ONLY or importlib.util.find_spec("libtpu") is None:
    return
  for marker in LIBTPU_NOISE:
    assert marker not in output, f"{marker!r} printed:\n{output[-3000:]}"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
  root = tmp_path_factory.mktemp("cli")
  good = root / "good.jsonl"
  good.write_text("".join(f'{{"text": "word {i} word", "label": "{"ab"[i % 2]}"}}\n' for i in range(40)))
  undecodable = root / "latin1.jsonl"
  undecodable.write_bytes(b'{"text": "a b", "label": "x"}\n{"text": "c d", "label": "y"}\n'
                          b'{"text": "caf\xe9", "label": "x"}\n')
  columns = root / "columns.csv"
  columns.write_text("body,topic\nhello there,a\ngeneral kenobi,b\n")
  predict = root / "predict.jsonl"
  predict.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
  buggy = root / "buggy_config.py"
  buggy.write_text("def get_config():\n  return {}['missing']\n")
  splits = root / "splits"  # a dev split with a label training never saw
  splits.mkdir()
  (splits / "train.jsonl").write_text(good.read_text())
  (splits / "dev.jsonl").write_text('{"text": "word", "label": "a"}\n{"text": "word", "label": "c"}\n')
  (root / "empty_workdir").mkdir()
  return {"root": root, "good": good, "undecodable": undecodable, "columns": columns, "predict": predict,
          "buggy": buggy, "splits": splits, "empty_workdir": root / "empty_workdir"}


def run(script: str, *args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], env=user_env(), cwd=REPO,
                        capture_output=True, text=True, timeout=TIMEOUT)


def assert_user_error(result: subprocess.CompletedProcess, script: str, *named: str):
  """Exit status 2, one `<script>: error: ...` line naming every string in `named`, no traceback."""
  output = result.stdout + result.stderr
  assert result.returncode == 2, output[-3000:]
  assert "Traceback" not in output
  errors = [line for line in result.stderr.splitlines() if line.startswith(f"{script}: error: ")]
  assert len(errors) == 1 and result.stderr.splitlines()[-1] == errors[0], result.stderr[-3000:]
  for name in named:
    assert name in errors[0], errors[0]
  assert_no_libtpu_noise(output)


TINY = ("--config", "configs/tiny.py")


@pytest.mark.parametrize("case", ["unknown_field", "misspelt_section", "not_an_int", "missing_dataset",
                                  "missing_config_file"])
def test_train_py_config_mistake_is_one_line_before_anything_runs(files, case):
  workdir = files["root"] / f"run_{case}"
  data = f"--config.data.dataset={files['good']}"
  args, named = {
    # ml_collections raises KeyError/AttributeError for these: they must still be one line.
    "unknown_field": ((*TINY, data, "--config.train.bogus=1"),
                      ["--config.train.bogus", "config.train has no field 'bogus'", "num_steps"]),
    "misspelt_section": ((*TINY, data, "--config.trian.num_steps=3"),
                         ["--config.trian.num_steps", "did you mean config.train?"]),
    "not_an_int": ((*TINY, data, "--config.train.num_steps=ten"), ["--config.train.num_steps", "'ten'"]),
    "missing_dataset": ((*TINY, "--config.data.dataset=/no/such/data.jsonl"),
                        ["config.data.dataset: '/no/such/data.jsonl' does not exist"]),
    "missing_config_file": (("--config", "configs/no_such_config.py", data),
                            ["--config configs/no_such_config.py: no such file"]),
  }[case]
  result = run("train.py", *args, "--workdir", workdir)
  assert_user_error(result, "train.py", *named)
  assert len(result.stderr.splitlines()) == 1  # caught before the job logs anything
  assert not workdir.exists()


@pytest.mark.parametrize("case", ["undecodable", "columns", "splits"])
def test_train_py_data_file_mistake_names_the_file_and_line(files, case):
  workdir = files["root"] / f"run_{case}"
  named = {"undecodable": [f"{files['undecodable']}:3:", "not valid UTF-8"],
           "columns": [f"{files['columns']}:1:", "missing column(s) ['text', 'label']", "['body', 'topic']"],
           "splits": [f"{files['splits'] / 'dev.jsonl'}:2:", "label 'c' was not seen in training"]}
  result = run("train.py", *TINY, f"--config.data.dataset={files[case]}", "--workdir", workdir)
  assert_user_error(result, "train.py", *named[case])
  assert not (workdir / "checkpoints").exists()


def test_eval_py_missing_workdir_is_one_line_and_creates_nothing(files):
  workdir = files["root"] / "never_trained"
  result = run("eval.py", *TINY, f"--config.data.dataset={files['good']}", "--workdir", workdir)
  assert_user_error(result, "eval.py", f"--workdir {workdir}: no such directory")
  assert len(result.stderr.splitlines()) == 1
  assert not workdir.exists()


def test_eval_py_workdir_without_checkpoints(files):
  workdir = files["empty_workdir"]
  result = run("eval.py", *TINY, f"--config.data.dataset={files['good']}", "--workdir", workdir)
  assert_user_error(result, "eval.py", f"--workdir {workdir}: no latest checkpoint")
  assert os.listdir(workdir) == []


def test_eval_py_bad_predict_file_names_its_line(files):
  result = run("eval.py", *TINY, f"--config.data.dataset={files['good']}", f"--predict={files['predict']}",
               "--workdir", files["empty_workdir"])
  assert_user_error(result, "eval.py", f"{files['predict']}:2:", "string field 'text'")


def test_a_bug_keeps_its_traceback(files):
  """A config file that raises is a bug in it, not a mistake in a value: traceback, not status 2."""
  result = run("train.py", "--config", files["buggy"], "--workdir", files["root"] / "run_bug")
  assert result.returncode not in (0, 2)
  assert "Traceback" in result.stderr and "KeyError: 'missing'" in result.stderr
