"""train.py / eval.py and flash_layers.training: optimizer, metrics, config errors, checkpoints,
resume after SIGKILL/SIGTERM, restore on fewer devices, 2 processes vs 1, the TPU pod dry run.

The end-to-end tests run train.py and eval.py as subprocesses (as users do) with configs/tiny.py
on a small synthetic JSONL dataset whose label is decided by keywords, so a model that learns
gets well above chance.
"""

import importlib.util
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
import tensorstore
from conftest import subprocess_xla_flags

from flash_layers import host
from flash_layers.training import checkpoint as checkpoint_lib
from flash_layers.training import config as config_lib
from flash_layers.training import metrics as metrics_lib
from flash_layers.training import objectives
from flash_layers.training import optimizer as optimizer_lib
from flash_layers.training import state as state_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 600
_CLASSES3 = objectives.build("classification", ["a", "b", "c"])

# A run long enough (in steps) that a signal sent while it trains lands mid-way.
KILL_RUN = ["--config.train.num_steps=240", "--config.train.batch_size=16", "--config.model.max_len=64",
            "--config.train.log_every=2", "--config.train.eval_every=120",
            "--config.checkpoint.every_steps=20", "--config.checkpoint.max_to_keep=3"]


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------

TOPICS = {"sport": ["match", "goal", "team", "win", "player", "score", "league", "coach"],
          "tech": ["computer", "software", "chip", "phone", "internet", "data", "code", "network"],
          "food": ["bread", "cheese", "cook", "recipe", "taste", "dinner", "soup", "fruit"]}
FILLER = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "for", "on", "with", "at", "by", "from"]


def _write_dataset(root: pathlib.Path, lengths=(8, 40), sizes=(240, 48, 48)) -> pathlib.Path:
  rng = random.Random(0)
  root.mkdir(parents=True, exist_ok=True)
  for split, n in zip(("train", "dev", "test"), sizes, strict=True):
    with open(root / f"{split}.jsonl", "w") as f:
      for _ in range(n):
        label = rng.choice(sorted(TOPICS))
        length = rng.randint(*lengths)
        words = [rng.choice(TOPICS[label] if rng.random() < 0.3 else FILLER) for _ in range(length)]
        f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")
  return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> pathlib.Path:
  return _write_dataset(tmp_path_factory.mktemp("data"))


def _env(devices: int = 1, *, as_user: bool = False) -> dict:
  """as_user: what a user's shell has, without the CPU and libtpu settings conftest.py makes for tests
  (kept on a host with a TPU or GPU, where the scripts would otherwise use it)."""
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", TPU_ACCELERATOR_TYPE="v5litepod-4", TPU_SKIP_MDS_QUERY="1",
             PYTHONPATH=str(REPO), XLA_FLAGS=subprocess_xla_flags(devices))
  if as_user and not host.accelerator_present():
    for name in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE", "TPU_SKIP_MDS_QUERY", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
      env.pop(name, None)
  return env


def _command(script: str, workdir, dataset, *overrides) -> list[str]:
  return [sys.executable, str(REPO / script), "--config", str(REPO / "configs/tiny.py"),
          "--workdir", str(workdir), f"--config.data.dataset={dataset}", *overrides]


def _run(script, workdir, dataset, *overrides, devices=1, check=True,
         as_user=False) -> subprocess.CompletedProcess:
  result = subprocess.run(_command(script, workdir, dataset, *overrides), env=_env(devices, as_user=as_user),
                          cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
  if check and result.returncode != 0:
    raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stderr[-4000:]}")
  return result


def _losses(workdir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in metrics_lib.read_metrics(str(workdir), "train")}


def _start(script, workdir, dataset, *overrides, devices=1) -> subprocess.Popen:
  return subprocess.Popen(_command(script, workdir, dataset, *overrides), env=_env(devices), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(process: subprocess.Popen, workdir, step: int):
  """Poll metrics.jsonl until training has logged `step` (the run must still be going)."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  deadline = time.monotonic() + TIMEOUT
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise AssertionError(f"the run ended before step {step}:\n{process.stderr.read()[-3000:]}")
    if path.exists():
      steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]
      if steps and max(steps) >= step:
        return
    time.sleep(0.02)
  raise AssertionError(f"step {step} not reached in {TIMEOUT}s")


# ----------------------------------------------------------------------------
# Optimizer and metrics (in process)
# ----------------------------------------------------------------------------

def test_weight_decay_mask_skips_norms_biases_and_embeddings():
  params = {"word_embeddings": {"embedding": jnp.ones((10, 4))},
            "layers_0": {"mlp_in": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)},
                         "attention": {"query": {"kernel": jnp.ones((4, 2, 2)), "bias": jnp.ones((2, 2))}},
                         "attention_norm": {"scale": jnp.ones(4), "bias": jnp.ones(4)}}}
  mask = optimizer_lib.decay_mask(params)
  assert mask["word_embeddings"]["embedding"] is False
  assert mask["layers_0"]["mlp_in"] == {"kernel": True, "bias": False}
  assert mask["layers_0"]["attention"]["query"] == {"kernel": True, "bias": False}
  assert mask["layers_0"]["attention_norm"] == {"scale": False, "bias": False}

  # With zero gradients, AdamW changes exactly the decayed params, by lr * wd * value.
  train = config_lib.default_config().train
  train.update(learning_rate=0.1, warmup_steps=0, weight_decay=0.5, schedule="constant", grad_clip_norm=0.0)
  tx = optimizer_lib.make_optimizer(train)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  new = optax.apply_updates(params, updates)
  for decays, before, after in zip(jax.tree.leaves(mask), jax.tree.leaves(params), jax.tree.leaves(new),
                                   strict=True):
    np.testing.assert_allclose(after, before * (1 - 0.1 * 0.5) if decays else before, rtol=1e-6)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_schedule_warms_up_then_decays(schedule):
  train = config_lib.default_config().train
  train.update(learning_rate=1e-3, warmup_steps=10, num_steps=110, schedule=schedule)
  lr = optimizer_lib.learning_rate_schedule(train)
  assert float(lr(0)) == 0.0
  np.testing.assert_allclose(float(lr(5)), 5e-4, rtol=1e-6)
  np.testing.assert_allclose(float(lr(10)), 1e-3, rtol=1e-6)
  middle = 0.5e-3 if schedule == "linear" else 0.5e-3 * (1 + np.cos(np.pi * 0.5))
  np.testing.assert_allclose(float(lr(60)), middle, rtol=1e-5)
  assert abs(float(lr(110))) < 1e-9


def test_gradient_clipping_bounds_the_update():
  train = config_lib.default_config().train
  train.update(learning_rate=1.0, warmup_steps=0, schedule="constant", weight_decay=0.0, grad_clip_norm=1.0,
               adam_b1=0.0, adam_b2=0.0, adam_eps=0.0)
  params = {"kernel": jnp.zeros((3, 3))}
  grads = {"kernel": jnp.full((3, 3), 100.0)}
  tx = optimizer_lib.make_optimizer(train)
  # Clipped to global norm 1; Adam with b1=b2=0 then gives sign(g) * lr.
  clipped, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  np.testing.assert_allclose(optax.global_norm(clipped), 1.0, rtol=1e-6)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["kernel"], -1.0, rtol=1e-5)


def test_metrics_match_plain_counting():
  rng = np.random.default_rng(0)
  labels = rng.integers(-1, 4, size=(50, 2))  # -1: padding slots, skipped
  predictions = rng.integers(0, 4, size=(50, 2))
  confusion = np.asarray(metrics_lib.confusion_matrix(jnp.asarray(predictions), jnp.asarray(labels),
                                                      jnp.asarray((labels >= 0).astype(np.float32)), 4))
  pairs = [(t, p) for t, p in zip(labels.ravel(), predictions.ravel(), strict=True) if t >= 0]
  assert confusion.sum() == len(pairs)
  assert metrics_lib.accuracy(confusion) == pytest.approx(sum(t == p for t, p in pairs) / len(pairs))
  f1s = []
  for c in range(4):
    tp = sum(t == c and p == c for t, p in pairs)
    fp = sum(t != c and p == c for t, p in pairs)
    fn = sum(t == c and p != c for t, p in pairs)
    f1s.append(2 * tp / (2 * tp + fp + fn))
  assert metrics_lib.macro_f1(confusion) == pytest.approx(np.mean(f1s))


# ----------------------------------------------------------------------------
# Bad config values: a ValueError naming the field, before anything compiles
# ----------------------------------------------------------------------------

def _tiny(dataset) -> ml_collections.ConfigDict:
  sys.path.insert(0, str(REPO))
  try:
    from configs import tiny
  finally:
    sys.path.remove(str(REPO))
  config = tiny.get_config()
  config.data.dataset = str(dataset)
  return config


@pytest.mark.parametrize("field,value,message", [
  ("model.impl", "flashy", "config.model.impl: must be one of"),
  ("train.learning_rate", -1e-3, "config.train.learning_rate: must be a number > 0"),
  ("train.num_steps", 0, "config.train.num_steps"),
  ("data.dataset", "/no/such/data.jsonl", "config.data.dataset: '/no/such/data.jsonl' does not exist"),
  ("mesh.data", 3, "config.mesh.data*fsdp*tensor*sequence: data=3 needs 3 devices but there are 4"),
  ("mesh.tensor", 3, "config.mesh.data: -1 takes the rest, but the other sizes' product 3 does not divide "
   "the 4 devices"),
  ("train.grad_accum_steps", 3, "config.train.grad_accum_steps: must divide train.batch_size=8"),
  ("model.max_len", 512 * 16 + 1, "config.model.max_len: 8193 is above what the checkpoint's 512-row"),
  ("checkpoint.best_metric", "auc", "config.checkpoint.best_metric"),
  ("model.attention_dropout", 1.0, "config.model.attention_dropout: must be None or in [0, 1)"),
  ("model.attention_dropout", 0.1, "model.impl='xla_native' has no attention dropout"),
  ("model.num_heads", 0, "config.model.num_heads: must be an integer > 0; got 0"),
  ("data.eval_batch_size", -4, "config.data.eval_batch_size: must be an integer > 0; got -4"),
])
def test_bad_config_value_names_the_field(dataset, field, value, message):
  config = _tiny(dataset)
  if field == "model.max_len":
    config.model.pretrained = "minilm"
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.validate(config, num_devices=4)
  assert message in str(error.value)


def test_attention_dropout_resolves_from_the_checkpoint(dataset):
  config = _tiny(dataset)
  assert config_lib.attention_dropout(config) == 0.0  # tiny sets 0.0 (xla_native has none)
  config.model.attention_dropout = None  # from scratch: the hidden dropout rate
  config.model.dropout_rate = 0.2
  assert config_lib.attention_dropout(config) == 0.2
  config.model.pretrained = "minilm"  # the checkpoint's attention_probs_dropout_prob
  assert config_lib.attention_dropout(config) == 0.1
  with pytest.raises(ValueError, match="config.model.attention_dropout: is 0.1 .*xla_native"):
    config_lib.validate(config, num_devices=4)
  config.model.impl = "auto"
  config_lib.validate(config, num_devices=4)


# ----------------------------------------------------------------------------
# Attention dropout: the resolved rate reaches every layer, 0.0 included
# ----------------------------------------------------------------------------

MODERNBERT_TINY = REPO / "tests" / "golden" / "hf_tiny" / "modernbert"


def _quickstart() -> ml_collections.ConfigDict:
  sys.path.insert(0, str(REPO))
  try:
    from configs import quickstart
  finally:
    sys.path.remove(str(REPO))
  return quickstart.get_config()


@pytest.fixture
def traced_dropout_rates(monkeypatch) -> list[float]:
  """The dropout rate of every attention call traced while the fixture is live (read by the
  dispatcher, whatever impl runs)."""
  from flash_layers import dispatch
  rates, run = [], dispatch._run

  def recording_run(name, query, key, value, request, args):
    rates.append(request.dropout_rate)
    return run(name, query, key, value, request, args)

  monkeypatch.setattr(dispatch, "_run", recording_run)
  return rates


def _trace_training_forward(config, rates: list[float], num_labels=3) -> None:
  """Trace (no compute) one training-mode forward of the model the config builds; `rates` then holds
  only that forward's calls (one per layer and platform branch of "auto")."""
  from flash_layers.training import task as task_lib
  model, _ = task_lib.build_model(config, num_labels, vocab_size=None)
  ids = jnp.ones((2, 16), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, method=model.classify))
  rates.clear()
  jax.eval_shape(lambda p: model.apply(p, ids, ids, deterministic=False, method=model.classify,
                                       rngs={"dropout": jax.random.key(1)}), params)


@pytest.mark.parametrize("setting,expected", [(None, 0.1), (0.0, 0.0), (0.2, 0.2)])
def test_every_layer_receives_the_resolved_attention_dropout(traced_dropout_rates, setting, expected):
  config = _quickstart()  # MiniLM: attention_probs_dropout_prob 0.1 in its config.json
  config.model.max_len = 16
  config.model.attention_dropout = setting
  _trace_training_forward(config, traced_dropout_rates)
  assert len(traced_dropout_rates) >= 6 and set(traced_dropout_rates) == {expected}  # MiniLM: 6 layers


@pytest.mark.parametrize("setting", [None, 0.0])
def test_modernbert_takes_no_attention_dropout(traced_dropout_rates, setting):
  config = _quickstart()
  config.model.pretrained = str(MODERNBERT_TINY)
  config.model.max_len = 16
  config.model.attention_dropout = setting
  _trace_training_forward(config, traced_dropout_rates)
  assert traced_dropout_rates and set(traced_dropout_rates) == {0.0}


def test_modernbert_refuses_a_nonzero_attention_dropout(dataset):
  from flash_layers.training import task as task_lib
  config = _quickstart()
  config.model.pretrained = str(MODERNBERT_TINY)
  config.model.attention_dropout = 0.2
  with pytest.raises(config_lib.ConfigError, match="attention_dropout: is 0.2 but .* ModernBERT"):
    task_lib.build_model(config, 3, vocab_size=None)
  config.data.dataset = str(dataset)
  with pytest.raises(config_lib.ConfigError, match="ModernBERT checkpoint, which has no attention-prob"):
    config_lib.validate(config, num_devices=4)


@pytest.mark.parametrize("impl", ["auto", "xla_native"])
def test_quickstart_step_with_attention_dropout_zero_applies_none(traced_dropout_rates, impl, tmp_path):
  """One real training step of the quickstart model (MiniLM, 32 tokens) with attention dropout off:
  no traced attention call carries dropout, and xla_native (which has none) trains."""
  from flash_layers.training import loop
  config = _quickstart()
  config.model.impl = impl
  config.model.attention_dropout = 0.0
  config.model.max_len = 32
  config.train.num_steps, config.train.batch_size, config.train.warmup_steps = 1, 2, 0
  config.train.log_every, config.train.eval_max_batches, config.data.eval_batch_size = 1, 1, 2
  config.checkpoint.every_steps = 1000
  result = loop.train_and_evaluate(config, str(tmp_path))
  assert result["step"] == 1 and np.isfinite(result["dev"]["loss"])
  assert len(traced_dropout_rates) >= 12  # the train step's six layers, then the dev eval's
  assert set(traced_dropout_rates) == {0.0}


@pytest.mark.parametrize("value", [0, -1])
def test_eval_max_batches_is_none_or_positive(dataset, value):
  from flash_layers.training import task as task_lib
  config = _tiny(dataset)
  config.train.eval_max_batches = value
  with pytest.raises(config_lib.ConfigError, match="config.train.eval_max_batches: must be an integer > 0"):
    config_lib.validate(config, num_devices=4)
  records = list(range(10))
  assert task_lib.sample_documents(records, None, 4) == records
  assert len(task_lib.sample_documents(records, 1, 4)) == 4


def test_train_py_rejects_bad_config_before_compiling(dataset, tmp_path):
  result = _run("train.py", tmp_path, dataset, "--config.train.learning_rate=-0.1", check=False)
  assert result.returncode == 2
  message = "train.py: error: config.train.learning_rate: must be a number > 0; got -0.1"
  assert result.stderr.strip() == message
  assert not (tmp_path / "checkpoints").exists()


# ----------------------------------------------------------------------------
# Checkpoints (in process)
# ----------------------------------------------------------------------------

def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
  state = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "step": jnp.int32(0)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), max_to_keep=3, best_metric="accuracy")
  for step in (10, 20):
    ckpt.save(step, jax.tree.map(lambda x, s=step: x + s, state), {"position": step}, '{"seed": 0}')
  ckpt.wait()
  ckpt.close()
  # Damage every data file of step 20; and leave a half-written step 30 as a killed save would.
  for path in (tmp_path / "checkpoints" / "20" / "state").rglob("*"):
    if path.is_file() and path.stat().st_size > 0 and "metadata" not in path.name:
      path.write_bytes(b"\0" * 7)
  (tmp_path / "checkpoints" / "30.orbax-checkpoint-tmp-123" / "state").mkdir(parents=True)

  # A reader (eval.py's restore_params) falls back too, and leaves the damaged step where it is.
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), max_to_keep=3, best_metric="accuracy")
  with caplog.at_level("WARNING", logger="flash_layers.training"):
    step, params, _ = ckpt.restore_params(abstract["params"])
  ckpt.close()
  assert step == 10
  np.testing.assert_array_equal(params["w"], state["params"]["w"] + 10)
  assert "checkpoint step 20" in caplog.text and "moving it aside" not in caplog.text
  assert (tmp_path / "checkpoints" / "20").is_dir()
  assert not list((tmp_path / "checkpoints").glob("20.corrupt-*"))

  # A model whose params the checkpoint lacks is an error naming them, not abstract leaves.
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), max_to_keep=3, best_metric="accuracy")
  with pytest.raises(ValueError, match=r"no params at \['u'\]"):
    ckpt.restore_params({"u": abstract["params"]["w"]})
  ckpt.close()

  # Training's restore moves it aside, so that the next save does not meet it again.
  caplog.clear()
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), max_to_keep=3, best_metric="accuracy")
  with caplog.at_level("WARNING", logger="flash_layers.training"):
    step, restored, data_state, config_json = ckpt.restore(abstract)
  ckpt.close()
  assert step == 10
  assert data_state == {"position": 10} and json.loads(config_json) == {"seed": 0}
  np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"] + 10)
  assert "checkpoint step 20" in caplog.text and "cannot be restored" in caplog.text
  assert (tmp_path / "checkpoints" / "20.corrupt-0").is_dir()
  assert not (tmp_path / "checkpoints" / "20").exists()


def test_best_checkpoint_keeps_the_best_dev_metric(tmp_path):
  state = {"w": jnp.zeros(3)}
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), max_to_keep=1, best_metric="accuracy")
  saved = [ckpt.save_best(step, jax.tree.map(lambda x, s=step: x + s, state), None, "{}", {"accuracy": acc})
           for step, acc in ((1, 0.5), (2, 0.7), (3, 0.6), (4, 0.7))]
  ckpt.wait()
  assert saved == [True, True, False, False]
  assert ckpt.steps("best") == [2]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  step, restored, _, _ = ckpt.restore(abstract, which="best")
  ckpt.close()
  assert step == 2
  np.testing.assert_array_equal(restored["w"], 2.0)


def _file_bytes_read() -> int:
  """Bytes tensorstore (orbax's storage layer) has read from files so far in this process."""
  metrics = tensorstore.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
  return sum(value["value"] for metric in metrics for value in metric["values"])


def test_restore_params_reads_no_optimizer_state(tmp_path):
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"dense": {"kernel": jax.random.normal(keys[0], (384, 384)),
                      "bias": jax.random.normal(keys[1], (384,))}}
  # Adam's moments filled with random numbers, as incompressible on disk as the params.
  opt_state = jax.tree.map(
    lambda x: jax.random.normal(keys[2], x.shape) if jnp.issubdtype(x.dtype, jnp.floating) else x,
    optax.adamw(1e-3).init(params))
  state = state_lib.TrainState(step=jnp.int32(7), params=params, opt_state=opt_state)
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), max_to_keep=3, best_metric="accuracy")
  for step in (1, 2):  # two steps, so that the two restores below cannot share a cache
    ckpt.save(step, jax.tree.map(lambda x, s=step: x + s, state), None, '{"seed": 0}')
  ckpt.wait()
  ckpt.close()
  abstract = lambda tree: jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), max_to_keep=3, best_metric="accuracy")
  existing = {id(a) for a in jax.live_arrays()}
  before = _file_bytes_read()
  step, restored, config_json = ckpt.restore_params(abstract(params), which=1)
  params_read = _file_bytes_read() - before
  materialised = [a for a in jax.live_arrays() if id(a) not in existing]
  before = _file_bytes_read()
  full = ckpt.restore(abstract(state), which=2)
  full_read = _file_bytes_read() - before
  ckpt.close()

  assert step == 1 and json.loads(config_json) == {"seed": 0}
  jax.tree.map(lambda r, p: np.testing.assert_array_equal(r, p + 1), restored, params)
  assert sum(a.nbytes for a in materialised) == nbytes(params)  # no optimizer-state arrays were made
  # On disk the optimizer state (Adam's two moments) is twice the params: a restore that read it
  # would read about three times the params' bytes, as the full restore does.
  assert full_read > 2.5 * nbytes(params)
  assert params_read < 1.2 * nbytes(params), (params_read, full_read)
  jax.tree.map(lambda r, p: np.testing.assert_array_equal(r, p + 2), full[1].opt_state, opt_state)


# ----------------------------------------------------------------------------
# End to end (subprocesses, as users run them)
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, dataset) -> pathlib.Path:
  """An uninterrupted run of KILL_RUN (also the end-to-end test's run), with a profile, started from
  a user's environment; its console output is kept in workdir/../console.txt."""
  workdir = tmp_path_factory.mktemp("reference")
  result = _run("train.py", workdir, dataset, *KILL_RUN, "--config.profile_steps=2", as_user=True)
  (workdir.parent / "console.txt").write_text(result.stdout + result.stderr)
  return workdir


def test_first_run_prints_no_libtpu_warnings(reference_run):
  """libtpu is installed (for the TPU ahead-of-time tests); on a CPU-only host it must stay quiet."""
  if host.accelerator_present() or importlib.util.find_spec("libtpu") is None:
    pytest.skip("only a CPU-only host with libtpu installed can show libtpu's warnings")
  console = (reference_run.parent / "console.txt").read_text()
  assert "finished 240 steps" in console  # our own progress is there
  for marker in ("TPU accelerator type", "host bounds", "Source Location Trace", "InitGoogle", "libtpu",
                 "Unable to initialize backend"):
    assert marker not in console, f"{marker!r} printed:\n{console[:3000]}"


def test_train_then_eval_end_to_end(reference_run, dataset, tmp_path):
  workdir = reference_run
  # train.py keeps its compiled programs in the default cache (conftest.py moves it to a temp dir)
  assert list((pathlib.Path(os.environ["FLASH_LAYERS_CACHE"]) / "jax_compilation_cache").iterdir())
  losses = _losses(workdir)
  assert sorted(losses) == list(range(1, 241))
  assert np.mean([losses[s] for s in range(231, 241)]) < 0.5 * np.mean([losses[s] for s in range(1, 11)])
  windows = metrics_lib.read_metrics(str(workdir), "train_window")
  for key in ("loss", "accuracy", "macro_f1", "learning_rate", "grad_norm", "tokens_per_s", "mfu_estimate"):
    assert all(np.isfinite(w[key]) for w in windows), key
  dev = metrics_lib.read_metrics(str(workdir), "dev")
  assert [r["step"] for r in dev] == [120, 240] and dev[-1]["accuracy"] > 0.8
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  assert list((workdir / "profile").rglob("*.xplane.pb")), "profile_steps wrote no trace"
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [200, 220, 240]
  assert len(list((workdir / "best").iterdir())) == 1

  docs = tmp_path / "docs.jsonl"
  texts = ["goal match team win score", "software chip data code", "bread soup taste"]
  docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
  _run("eval.py", workdir, dataset, *KILL_RUN, "--config.data.eval_split=test", "--checkpoint=best",
       f"--predict={docs}")
  report = json.loads((workdir / "eval_metrics.json").read_text())
  assert report["split"] == "test" and report["num_examples"] == 48
  confusion = np.asarray(report["confusion_matrix"])
  assert confusion.shape == (3, 3) and confusion.sum() == 48
  assert report["accuracy"] == pytest.approx(np.trace(confusion) / 48)
  assert report["accuracy"] > 0.8 and 0.0 < report["macro_f1"] <= 1.0
  predictions = [json.loads(line) for line in (workdir / "predictions.jsonl").read_text().splitlines()]
  assert [p["id"] for p in predictions] == [0, 1, 2]
  assert [p["prediction"] for p in predictions] == ["sport", "tech", "food"]
  assert all(sum(p["probabilities"].values()) == pytest.approx(1.0, abs=1e-4) for p in predictions)


def test_long_docs_config_smoke_trains_on_one_cpu_device(tmp_path):
  # configs/long_docs.py as shipped (built-in BBC News, packing, bf16, remat), shrunk only in
  # steps, row length and batch so CI stays fast; the full 4,096 tokens run the same code.
  result = subprocess.run(
    [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/long_docs.py"),
     "--workdir", str(tmp_path), "--config.train.num_steps=2", "--config.model.max_len=256",
     "--config.train.batch_size=2", "--config.train.eval_max_batches=1", "--config.data.num_workers=0"],
    env=_env(1), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
  assert result.returncode == 0, result.stderr[-4000:]
  losses = _losses(tmp_path)
  assert sorted(losses) == [1, 2] and all(np.isfinite(list(losses.values())))
  dev = metrics_lib.read_metrics(str(tmp_path), "dev")
  assert dev[-1]["step"] == 2 and dev[-1]["count"] >= 2
  assert (tmp_path / "checkpoints" / "2").is_dir()


def test_windows_eval_and_predict_give_one_entry_per_document(reference_run, tmp_path):
  # Documents of 70-200 words, each several 64-token windows: metrics, the confusion matrix and
  # predictions.jsonl count documents, each predicted from the mean of its windows' logits.
  import shutil
  workdir = shutil.copytree(reference_run, tmp_path / "run")
  long_data = _write_dataset(tmp_path / "long", lengths=(70, 200), sizes=(30, 12, 20))
  docs = tmp_path / "docs.jsonl"
  texts = [" ".join(["match goal team the of win"] * 30), "bread soup taste",
           " ".join(["software chip and data code in it"] * 25)]
  docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
  _run("eval.py", workdir, long_data, *KILL_RUN, "--config.data.eval_split=test", "--checkpoint=best",
       "--config.data.long_documents=windows", "--config.data.window_stride=8", f"--predict={docs}")
  report = json.loads((workdir / "eval_metrics.json").read_text())
  assert report["num_examples"] == 20 and np.sum(report["confusion_matrix"]) == 20
  assert report["num_windows"] > 2 * 20
  assert report["accuracy"] > 0.8
  predictions = [json.loads(line) for line in (workdir / "predictions.jsonl").read_text().splitlines()]
  assert [p["id"] for p in predictions] == [0, 1, 2]
  assert [p["prediction"] for p in predictions] == ["sport", "food", "tech"]


def test_sigterm_then_sigkill_then_resume_gives_identical_losses(reference_run, dataset, tmp_path):
  # SIGTERM: the run saves at the step it is on and exits 0.
  process = _start("train.py", tmp_path, dataset, *KILL_RUN)
  _wait_for_step(process, tmp_path, 30)
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=TIMEOUT)
  assert process.returncode == 0, stderr[-3000:]
  assert "stopped by SIGTERM at step" in stderr
  stopped = int(stderr.split("stopped by SIGTERM at step ")[1].split(";")[0])
  assert 30 <= stopped < 240
  assert stopped in [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]

  # Resume, then SIGKILL mid-way (possibly during an async save).
  process = _start("train.py", tmp_path, dataset, *KILL_RUN)
  _wait_for_step(process, tmp_path, stopped + 70)
  process.kill()
  process.communicate(timeout=TIMEOUT)

  # Resume to the end: every step's loss equals the uninterrupted run's, bit for bit.
  result = _run("train.py", tmp_path, dataset, *KILL_RUN)
  assert "resumed from checkpoint step" in result.stderr
  assert _losses(tmp_path) == _losses(reference_run)


@pytest.mark.slow
def test_four_device_checkpoint_restores_on_two_devices(dataset, tmp_path):
  mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=2"]
  _run("train.py", tmp_path, dataset, *mesh, "--config.train.num_steps=10", "--config.train.eval_every=0",
       devices=4)
  _run("eval.py", tmp_path, dataset, *mesh, devices=4)
  on_four = json.loads((tmp_path / "eval_metrics.json").read_text())
  _run("eval.py", tmp_path, dataset, "--config.mesh.data=1", "--config.mesh.fsdp=-1", devices=2)
  on_two = json.loads((tmp_path / "eval_metrics.json").read_text())
  assert on_two["checkpoint_step"] == on_four["checkpoint_step"] == 10
  assert on_two["confusion_matrix"] == on_four["confusion_matrix"]
  assert on_two["loss"] == pytest.approx(on_four["loss"], rel=1e-5)
  # Training continues on the smaller mesh.
  result = _run("train.py", tmp_path, dataset, "--config.mesh.data=-1", "--config.train.num_steps=14",
                "--config.train.eval_every=0", devices=2)
  assert "resumed from checkpoint step 10" in result.stderr
  assert max(_losses(tmp_path)) == 14


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_reach_the_loss_of_one(dataset, tmp_path):
  # One global shuffle dealt out to the processes: each global batch holds the same documents
  # however its rows are split, and without dropout the mean loss differs only by summation order.
  common = ["--config.train.num_steps=8", "--config.train.eval_every=0",
            "--config.model.dropout_rate=0.0", "--config.checkpoint.every_steps=4"]
  _run("train.py", tmp_path / "one", dataset, *common, devices=4)
  port = _free_port()
  processes = [subprocess.Popen(
    _command("train.py", tmp_path / "two", dataset, *common, f"--coordinator_address=127.0.0.1:{port}",
             "--num_processes=2", f"--process_id={i}"),
    env=_env(2), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    outputs = [p.communicate(timeout=TIMEOUT) for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
  for p, (_, err) in zip(processes, outputs, strict=True):
    assert p.returncode == 0, err[-3000:]
  one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
  assert sorted(two) == sorted(one) == list(range(1, 9))
  np.testing.assert_allclose([two[s] for s in range(1, 9)], [one[s] for s in range(1, 9)], rtol=1e-5)
  assert (tmp_path / "two" / "checkpoints" / "8").is_dir()


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(dataset, tmp_path):
  result = _run("train.py", tmp_path, dataset, "--config.train.learning_rate=1e30",
                "--config.train.grad_clip_norm=0.0", "--config.checkpoint.every_steps=1",
                "--config.train.warmup_steps=0", "--config.train.eval_every=0", check=False)
  assert result.returncode != 0
  assert "NonFiniteLossError" in result.stderr and "at step" in result.stderr
  bad_step = int(result.stderr.split(" at step ")[1].split()[0])
  steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
  assert steps and max(steps) < bad_step


@pytest.mark.aot
@pytest.mark.slow
def test_pod_dry_run_compiles_for_two_v5p_2x2x2_slices(tmp_path):
  pytest.importorskip("libtpu")
  result = subprocess.run(
    [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tpu_pod.py"),
     "--aot_topology=v5p:2x2x2", "--aot_num_slices=2", "--config.model.num_layers=1",
     "--config.model.max_len=1024", "--config.train.batch_size=8"],
    env=_env(1), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
  assert result.returncode == 0, result.stderr[-4000:]
  report = json.loads(result.stdout[result.stdout.index("{"):])
  # Per slice fsdp 2 x sequence 4 (tpu_pod's fsdp=-1 on 8 chips); the slices are data parallel.
  assert report["chips"] == 16 and report["slices"] == 2
  assert report["dcn_mesh"] == {"dcn_data": 2, "dcn_fsdp": 1}
  assert report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1, "sequence": 4}
  assert report["fits"] is True and report["hbm_per_chip_bytes"] == 95 * 2**30
  assert report["per_chip_bytes"]["peak_estimate"] > report["per_chip_bytes"]["arguments"] > 0
  assert report["flops_per_step_per_chip"] > 0
  traffic = report["collective_bytes_per_step_per_chip"]
  # fsdp and the ring stay on ICI; DCN carries the data-parallel gradient reduction (and a few
  # point-to-point bytes of the batch-sharded classifier head, which move along data too).
  dcn = {k: v for k, v in traffic["by_axes"].items() if k.startswith("dcn:")}
  assert all(k.startswith("dcn:data") for k in dcn), dcn
  assert dcn["dcn:data"] > 0.99 * traffic["dcn_bytes_per_step_per_chip"]
  assert traffic["by_axes"]["ici:fsdp"] > 0 and traffic["by_axes"]["ici:sequence"] > 0


# ----------------------------------------------------------------------------
# Gradient accumulation and the shipped configs (in process)
# ----------------------------------------------------------------------------

def test_gradient_accumulation_matches_one_big_batch():
  from flash_layers.training import state as state_lib
  from flash_layers.training import steps as steps_lib

  def logits_fn(params, batch, *, train, rng):
    embedded = params["embedding"][batch["input_ids"]].mean(axis=1)  # [batch, 4]
    return jnp.tanh(embedded @ params["hidden"]) @ params["out"]  # [batch, 3]

  rng = np.random.default_rng(0)
  params = {"embedding": jnp.asarray(rng.normal(size=(20, 4)), jnp.float32),
            "hidden": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32),
            "out": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
  batch = {"input_ids": jnp.asarray(rng.integers(0, 20, (8, 5)), jnp.int32),
           "segment_ids": jnp.ones((8, 5), jnp.int32),
           "labels": jnp.asarray([[0], [1], [2], [-1], [1], [0], [2], [-1]], jnp.int32)}
  train = config_lib.default_config().train
  train.update(learning_rate=0.1, warmup_steps=0, schedule="constant")
  tx = optimizer_lib.make_optimizer(train)
  schedule = optimizer_lib.learning_rate_schedule(train)
  # Labels are per document slot: logits [batch, 3] -> [batch, 1, 3].
  slot_logits = lambda p, b, **kw: logits_fn(p, b, **kw)[:, None, :]
  results = []
  for accum in (1, 2, 4):
    step = jax.jit(steps_lib.make_train_step(slot_logits, tx, schedule, objective=_CLASSES3, seed=0,
                                             grad_accum_steps=accum))
    state = state_lib.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params))
    results.append(step(state, batch))
  (one, one_metrics), *others = results
  for state, metrics in others:
    assert int(metrics["count"]) == int(one_metrics["count"]) == 6  # padding rows (label -1) skipped
    np.testing.assert_allclose(metrics["loss"], one_metrics["loss"], rtol=1e-6)
    np.testing.assert_array_equal(metrics["stats"]["confusion"], one_metrics["stats"]["confusion"])
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(one.params), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,devices", [("quickstart", 1), ("listops", 1), ("long_docs", 1),
                                          ("long_docs", 8), ("modernbert_long", 8), ("tpu_pod", 64),
                                          ("tpu_multislice", 128), ("tiny", 1), ("multi_label", 1),
                                          ("regression", 1), ("token_classification", 1),
                                          ("continued_pretraining", 8), ("hierarchical", 1)])
def test_shipped_configs_are_valid(name, devices):
  sys.path.insert(0, str(REPO))
  try:
    module = __import__(f"configs.{name}", fromlist=["get_config"])
  finally:
    sys.path.remove(str(REPO))
  config = module.get_config()
  config_lib.validate(config, num_devices=devices, check_data=False)
  for field in ("seed", "model.impl", "model.max_len", "data.dataset", "train.num_steps", "train.batch_size",
                "train.learning_rate", "checkpoint.every_steps"):
    section, _, leaf = field.rpartition(".")
    assert leaf in (config[section] if section else config), field
  source = (REPO / "flash_layers/training/config.py").read_text()
  for line in ("c.seed = 0", "m.impl = ", "m.max_len = ", "d.dataset = ", "t.num_steps = ", "t.batch_size = ",
               "t.learning_rate = ", "k.every_steps = "):
    before = source[:source.index(line)].rstrip().splitlines()[-1].strip()
    assert before.startswith("#"), f"{line!r} has no comment above it in config.py"


@pytest.mark.parametrize("aggregation", ["mean", "max"])
def test_evaluate_scores_each_document_once_from_its_windows(aggregation):
  from flash_layers import data as data_lib
  from flash_layers.training import evaluate as evaluate_lib
  from flash_layers.training import sharding as sharding_lib
  from flash_layers.training import steps as steps_lib

  def logits_fn(params, batch, *, train, rng):  # a window's logits: its mean token id times params
    mask = batch["segment_ids"][:, None, :] == jnp.arange(1, batch["labels"].shape[1] + 1)[None, :, None]
    mean_id = (mask * batch["input_ids"][:, None, :]).sum(-1) / jnp.maximum(mask.sum(-1), 1)
    return mean_id[..., None] * params

  params = jnp.asarray([0.3, -0.2, 0.05], jnp.float32)
  rng = random.Random(1)
  texts = [" ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 60))) for _ in range(23)]
  labels = [rng.randint(0, 2) for _ in texts]
  tok = data_lib.TextTokenizer("listops", max_len=16, long_docs="windows", stride=3)
  windows = tok.encode(texts)
  assert sum(len(w) > 1 for w in windows) > 10  # most documents are longer than max_len
  batches = data_lib.eval_batches(texts, labels, tok, batch_size=4, max_docs_per_row=3)
  mesh = sharding_lib.mesh_from_config(config_lib.default_config())
  result = evaluate_lib.evaluate(jax.jit(steps_lib.make_eval_step(logits_fn)), params, iter(batches),
                                 len(batches), mesh, objective=_CLASSES3, aggregation=aggregation,
                                 keep_logits=True)
  # Independently: each window's logits from its token ids, combined per document.
  per_window = [[np.mean(w) * np.asarray(params, np.float64) for w in ws] for ws in windows]
  combine = (lambda x: np.mean(x, axis=0)) if aggregation == "mean" else (lambda x: np.max(x, axis=0))
  doc_logits = np.stack([combine(np.stack(ws)) for ws in per_window])
  predicted = doc_logits.argmax(-1)
  assert result["count"] == len(texts) and result["num_windows"] == sum(len(w) for w in windows)
  assert list(result["doc_ids"]) == list(range(len(texts)))
  confusion = np.zeros((3, 3), np.int64)
  for t, p in zip(labels, predicted, strict=True):
    confusion[t, p] += 1
  np.testing.assert_array_equal(result["confusion_matrix"], confusion)
  log_probs = doc_logits - np.log(np.exp(doc_logits).sum(-1, keepdims=True))
  assert result["loss"] == pytest.approx(-np.mean(log_probs[np.arange(len(texts)), labels]), rel=1e-5)
  np.testing.assert_allclose(result["logits"], doc_logits, rtol=1e-5)


def test_planned_eval_batches_keep_rows_divisible_over_the_mesh_batch_axes():
  import types

  from flash_layers import data as data_lib
  from flash_layers.training import task as task_lib

  mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 2, "tensor": 1, "sequence": 1})  # 4 batch shards
  config = config_lib.default_config()
  config.data.max_docs_per_row = 2
  tok = data_lib.TextTokenizer("listops", max_len=1024)
  lengths = [1000, 1000, 1000, 1000, 600, 550, 500] + [40] * 12
  texts = [" ".join(["5"] * (n - 2)) for n in lengths]  # the tokenizer adds two tokens
  config.data.eval_batch_size = 8
  batches = task_lib.planned_eval_batches(config, texts, [0] * len(texts), tok, mesh)
  # 1,024-token rows come 8 * 512 // 1024 = 4 to a batch, 640-token rows 6 -> 4: multiples of 4.
  shapes = [b["input_ids"].shape for b in batches]
  assert shapes[:2] == [(4, 1024), (4, 640)] and all(rows in (4, 8) for rows, _ in shapes)
  assert sorted(int(d) for b in batches for d in b["doc_ids"].ravel() if d >= 0) == list(range(len(texts)))
  config.data.eval_batch_size = 6
  with pytest.raises(config_lib.ConfigError, match="must divide over the data\\*fsdp=4 shards"):
    task_lib.planned_eval_batches(config, texts, [0] * len(texts), tok, mesh)
