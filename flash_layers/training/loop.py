"""`train_and_evaluate(config, workdir)`: the training job from start to summary.

    validate config -> mesh -> task (model + data) -> state (restored or created sharded)
    -> steps: log window / checkpoint / dev eval / preemption check -> final save, eval, summary

Resuming is automatic: if workdir holds a checkpoint, training continues from
it with the data iterator where it was, and metrics.jsonl is cut back to the
restored step, so an interrupted run writes exactly what an uninterrupted one does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from flash_layers.parallel.mesh import LOGICAL_RULES
from flash_layers.training import checkpoint as checkpoint_lib
from flash_layers.training import config as config_lib
from flash_layers.training import evaluate as evaluate_lib
from flash_layers.training import metrics as metrics_lib
from flash_layers.training import optimizer as optimizer_lib
from flash_layers.training import sharding as sharding_lib
from flash_layers.training import state as state_lib
from flash_layers.training import steps as steps_lib
from flash_layers.training import task as task_lib
from flash_layers.training.distributed import log_job_info, setup_logging

log = logging.getLogger("flash_layers.training")


class NonFiniteLossError(FloatingPointError):
  pass


# ----------------------------------------------------------------------------
# Preemption
# ----------------------------------------------------------------------------

class PreemptionWatch:
  """SIGTERM sets a flag; the loop checks it between steps, saves and exits cleanly."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    def handler(signum, frame):
      log.warning("SIGTERM received: saving a checkpoint after this step, then exiting")
      self.requested = True
    with contextlib.suppress(ValueError):  # not the main thread: no handler, no preemption saves
      self._previous = signal.signal(signal.SIGTERM, handler)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def should_stop(self, at_boundary: bool) -> bool:
    if jax.process_count() == 1:
      return self.requested
    # Every process must stop at the same step: stop if any of them was signalled. Asking the
    # others is a collective that waits for the queued steps, so it is done at log/save boundaries.
    if not at_boundary:
      return False
    flags = multihost_utils.process_allgather(np.array([self.requested], np.int32))
    return bool(np.max(flags))


# ----------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------

StepHook = Callable[[int, state_lib.TrainState], None]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       task: task_lib.Task | None = None, on_step: StepHook | None = None) -> dict:
  """Train (resuming from workdir if it holds a checkpoint), evaluate, return the final metrics.

  `task` overrides the model and data built from the config (for tests and notebooks).
  `on_step(step, state)` is called on the host after every step, once that step's logging,
  dev evaluation and checkpoint save have been started -- for monitoring (benchmarks/memory.py
  samples memory with it). It runs in the loop's thread, so it should be quick; `state` is
  donated to the next step, so it must not be kept.
  """
  return Trainer.from_config(config, workdir, task=task, on_step=on_step).run()


class Trainer:
  def __init__(self, config, workdir: str, mesh: Mesh, task: task_lib.Task, *,
               on_step: StepHook | None = None):
    self.config, self.workdir, self.mesh, self.task = config, workdir, mesh, task
    self.on_step = on_step
    train = config.train
    self.tx = optimizer_lib.make_optimizer(train)
    self.schedule = optimizer_lib.learning_rate_schedule(train)
    self.abstract, self.shardings = state_lib.state_shardings(task.init_params, self.tx, mesh, LOGICAL_RULES)
    self.best_metric = config_lib.best_metric(config)
    self.checkpoints = checkpoint_lib.Checkpointer(workdir, max_to_keep=config.checkpoint.max_to_keep,
                                                   best_metric=self.best_metric)
    self.config_json = config.to_json_best_effort()
    # The task's objective; its head (multi-label thresholds tuned on dev) changes at dev evaluations
    # and is saved with every checkpoint.
    self.objective = task.objective
    train_step = steps_lib.make_train_step(
      task.logits_fn, self.tx, self.schedule, objective=task.objective, seed=config.seed,
      grad_accum_steps=train.grad_accum_steps)
    self.train_step = jax.jit(train_step, out_shardings=(self.shardings, None), donate_argnums=0)
    self.eval_step = jax.jit(steps_lib.make_eval_step(task.logits_fn, task.objective))
    self.peak_flops = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind,
                                                        train.peak_flops_per_device)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, workdir: str, *,
                  task: task_lib.Task | None = None, on_step: StepHook | None = None) -> Trainer:
    """Validate the config, set up logging, the mesh and the task: a Trainer ready to `run()`."""
    setup_logging()
    config_lib.validate(config, check_data=task is None)
    log_job_info()
    mesh = sharding_lib.mesh_from_config(config)
    log.info("mesh %s", dict(mesh.shape))
    if task is None:
      task = task_lib.build_task(config, mesh)
    os.makedirs(workdir, exist_ok=True)
    return cls(config, workdir, mesh, task, on_step=on_step)

  # -- state ------------------------------------------------------------------

  def _initial_state(self):
    restored = self.checkpoints.restore(self.abstract)
    if restored is not None:
      step, state, data_state, _ = restored
      if data_state is not None:
        self.task.train_batches.set_state(data_state)
      self.objective = self.objective.with_head(self.checkpoints.restore_head(step))
      log.info("resumed from checkpoint step %d in %s", step, self.workdir)
      return state
    if self.task.pretrained_params is not None:
      state_lib.check_params_match(self.task.pretrained_params, self.abstract.params)
    origin = "pretrained" if self.task.pretrained_params is not None else "random"
    log.info("starting from %s weights", origin)
    return state_lib.create_state(self.task.init_params, self.tx, self.shardings, self.task.pretrained_params)

  def _save(self, state, step: int):
    self.checkpoints.save(step, state, self.task.train_batches.get_state(), self.config_json,
                          head=self.objective.head())

  # -- the loop ---------------------------------------------------------------

  def run(self) -> dict:
    if jax.process_index() == 0:  # label id -> name, for reading predictions and confusion matrices
      with open(os.path.join(self.workdir, "labels.json"), "w", encoding="utf-8") as f:
        json.dump({"task": self.objective.task, "labels": list(self.task.label_names)}, f, indent=1)
    state = self._initial_state()
    with sharding_lib.sharding_context(self.mesh):
      return self._train(state)

  def _train(self, state) -> dict:
    config, train = self.config, self.config.train
    start = int(state.step)
    writer = metrics_lib.MetricWriter(self.workdir, resume_step=start)
    progress = metrics_lib.Progress(train.num_steps, start)
    shardings = None
    window: list[dict] = []
    window_start = time.perf_counter()
    compiled, flops_per_step = None, None
    last_dev: dict = {}
    stopped_early = False
    profiling = False
    try:
      with PreemptionWatch() as preemption:
        for step in range(start, train.num_steps):
          batch = next(self.task.train_batches)
          if shardings is None:
            shardings = sharding_lib.batch_shardings(batch, self.mesh, self.task.seq_len)
          if config.profile_steps and step == start + config.profile_start:
            jax.profiler.start_trace(os.path.join(self.workdir, "profile"))
            profiling = True
          global_batch = sharding_lib.to_global(batch, shardings)
          if compiled is None:
            compiled = self.train_step.lower(state, global_batch).compile()
            flops_per_step = metrics_lib.compiled_flops(compiled)
            window_start = time.perf_counter()
          state, step_metrics = compiled(state, global_batch)
          window.append(step_metrics)
          if profiling and step + 1 == start + config.profile_start + config.profile_steps:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            profiling = False
            log.info("profile written to %s", os.path.join(self.workdir, "profile"))
          done = step + 1
          last_step = done == train.num_steps
          save_now = done % config.checkpoint.every_steps == 0 or last_step
          eval_now = train.eval_every and done % train.eval_every == 0 and not last_step
          stop = preemption.should_stop(at_boundary=done % train.log_every == 0 or save_now or eval_now)
          # A window is checked for NaN/Inf before anything is saved from it.
          if done % train.log_every == 0 or save_now or eval_now or stop or last_step:
            self._flush(window, done, window_start, flops_per_step, writer, progress)
            window, window_start = [], time.perf_counter()
          if eval_now:
            last_dev = self._dev_eval(state, done, writer)
            window_start = time.perf_counter()  # throughput counts training time only
          if save_now or stop:
            self._save(state, done)
          if stop:
            log.warning("stopped by SIGTERM at step %d; checkpoint saved, run again to resume", done)
            stopped_early = True
            break
          if self.on_step is not None:
            self.on_step(done, state)
      if not stopped_early:
        last_dev = self._dev_eval(state, train.num_steps, writer)
    finally:
      if profiling:
        jax.profiler.stop_trace()
      self.checkpoints.wait()
      self.checkpoints.close()
      writer.close()
    result = {"step": int(state.step), "stopped_early": stopped_early, "dev": last_dev}
    if not stopped_early:
      self._summary(result)
    return result

  def _flush(self, window, done, window_start, flops_per_step, writer, progress):
    """Fetch a window of step metrics (the only host sync), check them, log them."""
    if not window:
      return
    fetched = jax.device_get(window)  # waits for the window's steps to finish
    seconds = time.perf_counter() - window_start
    first = done - len(fetched) + 1
    for offset, values in enumerate(fetched):
      if not math.isfinite(float(values["loss"])):
        raise NonFiniteLossError(
          f"loss is {float(values['loss'])} at step {first + offset} (learning_rate "
          f"{float(values['learning_rate']):.3g}, grad_norm {float(values['grad_norm']):.3g}); stopping. "
          f"The last good checkpoint is kept in {self.workdir}/checkpoints; try a lower "
          f"config.train.learning_rate or config.train.grad_clip_norm")
    for offset, values in enumerate(fetched):
      writer.write(first + offset, "train", {"loss": float(values["loss"])})
    stats = jax.tree.map(lambda *xs: np.sum([np.asarray(x, np.float64) for x in xs], axis=0),
                         *[v["stats"] for v in fetched])
    tokens = sum(int(v["tokens"]) for v in fetched)
    last = fetched[-1]
    summary = {
      "loss": float(np.mean([float(v["loss"]) for v in fetched])),
      **self.objective.window_summary(stats),
      "learning_rate": float(last["learning_rate"]),
      "grad_norm": float(last["grad_norm"]),
      "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
      "steps_per_s": len(fetched) / seconds if seconds > 0 else float("nan"),
    }
    if flops_per_step:
      # XLA's cost analysis of the partitioned program counts one device's FLOPs.
      summary["mfu_estimate"] = flops_per_step * len(fetched) / seconds / self.peak_flops if seconds else 0.0
    writer.write(done, "train_window", summary)
    shown = ("loss", self.objective.headline[0], "learning_rate", "tokens_per_s")
    progress.update(done, {k: summary[k] for k in shown if k in summary})

  def _dev_eval(self, state, step, writer) -> dict:
    batches, count = self.task.eval_batches("dev", self.config.train.eval_max_batches)
    result = evaluate_lib.evaluate(self.eval_step, state.params, batches, count, self.mesh,
                                   objective=self.objective, aggregation=self.config.data.window_aggregation,
                                   tune=True)
    self.objective = result.pop("objective")  # with its head tuned on this dev evaluation, if asked
    values = {k: v for k, v in result.items() if np.isscalar(v)}
    writer.write(step, "dev", values)
    shown = ("loss", *self.objective.headline)
    log.info("dev @ %d: %s", step, "  ".join(f"{k} {values[k]:.4f}" for k in shown))
    if math.isfinite(values[self.best_metric]):
      saved = self.checkpoints.save_best(step, state, self.task.train_batches.get_state(), self.config_json,
                                         values, head=self.objective.head())
      if saved:
        log.info("new best dev %s %.4f at step %d", self.best_metric, values[self.best_metric], step)
    return values

  def _summary(self, result):
    if jax.process_index() != 0:
      return
    shown = ("loss", *self.objective.headline)
    rows = {"dev (final)": {k: result["dev"].get(k) for k in (*shown, "count")}}
    try:
      last_train = [r for r in metrics_lib.read_metrics(self.workdir, "train_window")][-1]
      rows = {"train (last window)": {k: last_train.get(k) for k in shown if k in last_train}, **rows}
    except (OSError, IndexError):
      pass
    best = self.checkpoints.steps("best")
    log.info("finished %d steps; best dev checkpoint: step %s\n%s", result["step"],
             best[-1] if best else None, metrics_lib.summary_table(rows))
    with open(os.path.join(self.workdir, "train_summary.json"), "w", encoding="utf-8") as f:
      json.dump({"step": result["step"], "dev": {k: v for k, v in result["dev"].items()},
                 "best_step": best[-1] if best else None}, f, indent=1)
