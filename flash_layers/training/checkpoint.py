"""Checkpoints with orbax: the latest few for resuming, the best by a dev metric kept apart.

One checkpoint holds everything a resumed run needs to continue as if it had
never stopped: the train state (params, optimizer state, step), every
process's data-iterator state, the config (for eval.py and for humans), and the
task objective's head (training/objectives.py: multi-label thresholds tuned on
dev, regression target statistics), which eval.py, prediction and export use.

    workdir/checkpoints/<step>/{state,data,config,head}   latest `max_to_keep`, for resuming
    workdir/best/<step>/{state,data,config,head}          the best dev checkpoint only

Saves are asynchronous (training continues while the arrays are written).
Orbax writes each step into a temporary directory and renames it when
complete, so a save cut short by a kill is never listed as a step. A listed
step whose files are damaged fails to restore; `restore()` then warns, moves
it aside (`<step>.corrupt-<n>`) and takes the one before it.

`restore_params()` (for eval.py) reads the params subtree of the state and the
config only: orbax's partial restore skips the optimizer state's arrays on disk.
"""

from __future__ import annotations

import base64
import json
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from flash_layers.errors import UserError

log = logging.getLogger("flash_layers.training")

class NoCheckpointError(UserError, FileNotFoundError):
  """The workdir, or the checkpoint asked for, is not there."""


def saved_steps(workdir: str) -> dict[str, list[int]]:
  """{"latest": steps in workdir/checkpoints, "best": steps in workdir/best}, read from the directory
  names alone (no orbax, nothing created): a step directory exists only once its save completed."""
  found = {}
  for which, folder in (("latest", "checkpoints"), ("best", "best")):
    path = os.path.join(workdir, folder)
    names = os.listdir(path) if os.path.isdir(path) else []
    found[which] = sorted(int(n) for n in names if n.isdigit())
  return found


def check_restorable(workdir: str, which: str | int = "latest") -> None:
  """NoCheckpointError naming the workdir unless it holds the checkpoint `which` asks for.

  Cheap and side-effect free, so eval.py runs it before building anything."""
  if not os.path.isdir(workdir):
    raise NoCheckpointError(f"--workdir {workdir}: no such directory (train into it first: "
                            f"python train.py --config ... --workdir {workdir})")
  steps = saved_steps(workdir)
  if which in ("latest", "best"):
    if not steps[which]:
      folder = "checkpoints" if which == "latest" else "best"
      raise NoCheckpointError(f"--workdir {workdir}: no {which} checkpoint ({folder}/ is empty or missing); "
                              "run train.py with this --workdir first")
  elif int(which) not in steps["latest"] + steps["best"]:
    raise NoCheckpointError(f"--checkpoint {which}: no such step in {workdir}; it has {steps['latest']} "
                            f"in checkpoints/ and {steps['best']} in best/")


def _manager(directory: str, **options) -> ocp.CheckpointManager:
  # The state is saved and restored through the PyTree handler (StandardSave/Restore wrap it, but
  # cannot restore a subtree). Registering it up front means one manager serves full and partial
  # restores alike, whichever comes first.
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  state_handler = ocp.PyTreeCheckpointHandler()
  registry.add("state", ocp.args.PyTreeSave, state_handler)
  registry.add("state", ocp.args.PyTreeRestore, state_handler)
  for name in ("data", "config", "head"):
    handler = ocp.JsonCheckpointHandler()
    registry.add(name, ocp.args.JsonSave, handler)
    registry.add(name, ocp.args.JsonRestore, handler)
  return ocp.CheckpointManager(
    directory, options=ocp.CheckpointManagerOptions(create=True, **options), handler_registry=registry)


def _lower_is_better(metric: str) -> bool:
  return metric in ("loss", "mse", "mae")


class Checkpointer:
  def __init__(self, workdir: str, *, max_to_keep: int, best_metric: str, asynchronous: bool = True):
    self.workdir = os.path.abspath(workdir)
    self.best_metric = best_metric
    self._best_value = None
    self.latest = _manager(os.path.join(self.workdir, "checkpoints"), max_to_keep=max_to_keep,
                           enable_async_checkpointing=asynchronous)
    self.best = _manager(
      os.path.join(self.workdir, "best"), max_to_keep=1, enable_async_checkpointing=asynchronous,
      best_fn=lambda metrics: metrics[best_metric],
      best_mode="min" if _lower_is_better(best_metric) else "max",
      keep_checkpoints_without_metrics=False)

  # -- saving -----------------------------------------------------------------

  def save(self, step: int, state, data_state, config_json: str, *, head: dict | None = None) -> None:
    """Start an asynchronous save of `step` (a no-op if that step is already saved)."""
    if step in self.latest.all_steps():
      return
    self.latest.save(step, args=_composite(state, data_state, config_json, head), force=True)

  def best_value(self) -> float | None:
    """The best dev metric saved so far (remembered across saves still in flight)."""
    if self._best_value is None:
      step = self.best.best_step()
      metrics = self.best.metrics(step) if step is not None else None
      self._best_value = metrics.get(self.best_metric) if metrics else None
    return self._best_value

  def is_better(self, value: float) -> bool:
    best = self.best_value()
    if best is None:
      return True
    return value < best if _lower_is_better(self.best_metric) else value > best

  def save_best(self, step: int, state, data_state, config_json: str, metrics: dict, *,
                head: dict | None = None) -> bool:
    """Save `step` to workdir/best if its dev metric beats the best so far."""
    if not self.is_better(metrics[self.best_metric]) or step in self.best.all_steps():
      return False
    self.best.save(step, args=_composite(state, data_state, config_json, head),
                   metrics={k: float(v) for k, v in metrics.items() if np.isscalar(v)}, force=True)
    self._best_value = float(metrics[self.best_metric])
    return True

  def wait(self):
    self.latest.wait_until_finished()
    self.best.wait_until_finished()

  def close(self):
    self.latest.close()
    self.best.close()

  # -- restoring --------------------------------------------------------------

  def steps(self, which: str = "latest") -> list[int]:
    manager = self.best if which == "best" else self.latest
    return sorted(manager.all_steps())

  def restore(self, abstract_state, *, which: str | int = "latest", fallback: bool = True):
    """Restore onto the shardings in `abstract_state` (a pytree of ShapeDtypeStructs).

    which: "latest", "best" or a step number (looked up in checkpoints/, then best/).
    Returns (step, state, data_state, config_json) or None when there is nothing to restore.
    With fallback, a step that fails to restore is moved aside with a warning and
    the previous one tried.
    """
    args = ocp.args.Composite(state=_pytree_restore(abstract_state), data=ocp.args.JsonRestore(),
                              config=ocp.args.JsonRestore())
    restored = self._restore(args, which, fallback)
    if restored is None:
      return None
    step, items = restored
    return step, items["state"], _data_state_for_this_process(items["data"]), json.dumps(items["config"])

  def restore_params(self, abstract_params, *, which: str | int = "latest", fallback: bool = True):
    """Only the state's params, onto the shardings in `abstract_params`: (step, params, config_json).

    The optimizer state, the step counter and the data-iterator state are not read.
    `which` and `fallback` are as for `restore`, except that a step that fails to restore is left
    where it is: a reader (eval.py, possibly beside a running training job) never renames a
    checkpoint. None when there is nothing to restore.
    """
    args = ocp.args.Composite(state=_pytree_restore({"params": abstract_params}, partial=True),
                              config=ocp.args.JsonRestore())
    restored = self._restore(args, which, fallback, move_aside=False)
    if restored is None:
      return None
    step, items = restored
    params = items["state"].get("params", abstract_params)
    # orbax's partial restore hands back the abstract leaf for a path the checkpoint lacks.
    missing = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if isinstance(leaf, jax.ShapeDtypeStruct)]
    if missing:
      raise ValueError(f"checkpoint step {step} in {self.workdir} has no params at {', '.join(missing[:5])}"
                       f"{' ...' if len(missing) > 5 else ''}: it is not a checkpoint of this model")
    return step, params, json.dumps(items["config"])

  def restore_config(self, *, which: str | int = "latest") -> tuple[int, str] | None:
    """(step, config_json) of a checkpoint: the config it was trained with, and no arrays read
    (flash_layers.export rebuilds the model from it). None when there is nothing to restore."""
    restored = self._restore(ocp.args.Composite(config=ocp.args.JsonRestore()), which, fallback=True,
                             move_aside=False)
    if restored is None:
      return None
    step, items = restored
    return step, json.dumps(items["config"])

  def restore_head(self, which: str | int = "latest") -> dict | None:
    """The objective's head saved with a checkpoint (None for a checkpoint written before heads were)."""
    if which == "latest" and not self.latest.all_steps():
      return None
    try:
      restored = self._restore(ocp.args.Composite(head=ocp.args.JsonRestore()), which, fallback=False,
                               move_aside=False)
    except Exception:  # no head item in this checkpoint
      return None
    return None if restored is None else restored[1]["head"]

  def _restore(self, args: ocp.args.Composite, which: str | int, fallback: bool, move_aside: bool = True):
    if which == "best":
      manager, candidates = self.best, [s for s in [self.best.best_step()] if s is not None]
    elif which == "latest":
      manager, candidates = self.latest, sorted(self.latest.all_steps(), reverse=True)
    else:
      step = int(which)
      manager = self.latest if step in self.latest.all_steps() else self.best
      if step not in manager.all_steps():
        raise NoCheckpointError(f"checkpoint step {step} not found in {self.workdir}/checkpoints or /best; "
                                f"have {self.steps('latest')} and best {self.steps('best')}")
      candidates = [step]
    for step in candidates:
      try:
        return step, manager.restore(step, args=args)
      except Exception as e:  # orbax raises many kinds for damaged files
        if not fallback or which not in ("latest",):
          raise
        log.warning("checkpoint step %d in %s cannot be restored (%s: %s); %s the previous one",
                    step, manager.directory, type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "",
                    "moving it aside and using" if move_aside else "using")
        if move_aside:
          self._move_aside(manager, step)
    return None

  def _move_aside(self, manager: ocp.CheckpointManager, step: int):
    if jax.process_index() == 0:
      path = os.path.join(str(manager.directory), str(step))
      n = 0
      while os.path.exists(f"{path}.corrupt-{n}"):
        n += 1
      os.rename(path, f"{path}.corrupt-{n}")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint_move_aside_{step}")
    manager.reload()


def read_params(workdir: str, which: str = "latest") -> tuple[int, dict]:
  """(step, params as host NumPy arrays) of another run's checkpoint ("latest" or "best"), read
  without its model: shapes from the checkpoint's metadata, the optimizer state not read
  (config.model.init_from)."""
  check_restorable(workdir, which)
  steps = saved_steps(workdir)[which]
  step = steps[-1]
  folder = "checkpoints" if which == "latest" else "best"
  path = os.path.join(os.path.abspath(workdir), folder, str(step), "state")
  checkpointer = ocp.PyTreeCheckpointer()
  meta = checkpointer.metadata(path)
  tree = (meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree)["params"]
  item = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
  args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
      item={"params": item}, restore_args={"params": args}, partial_restore=True))
  return step, restored["params"]


# ----------------------------------------------------------------------------
# Data-iterator state: one per process, saved together in one JSON item
# ----------------------------------------------------------------------------

def _encode(state) -> dict:
  if isinstance(state, bytes):
    return {"bytes": base64.b64encode(state).decode("ascii")}
  return {"json": state}


def _decode(entry: dict):
  return base64.b64decode(entry["bytes"]) if "bytes" in entry else entry["json"]


def _gather_strings(text: str) -> list[str]:
  """Every process's `text`, in process order (a collective: all processes call it)."""
  if jax.process_count() == 1:
    return [text]
  raw = np.frombuffer(text.encode("utf-8"), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([raw.size], np.int32))
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:raw.size] = raw
  gathered = multihost_utils.process_allgather(padded)
  return [bytes(row[:n]).decode("utf-8") for row, n in zip(gathered, lengths.reshape(-1), strict=True)]


def _composite(state, data_state, config_json: str, head: dict | None = None) -> ocp.args.Composite:
  per_process = _gather_strings(json.dumps(_encode(data_state)))
  data = {"process_count": len(per_process), "processes": [json.loads(s) for s in per_process]}
  return ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data),
                            config=ocp.args.JsonSave(json.loads(config_json)),
                            head=ocp.args.JsonSave(head or {}))


def _pytree_restore(abstract, *, partial: bool = False) -> ocp.args.PyTreeRestore:
  """Arrays restored onto the shardings of `abstract`; with `partial`, only the leaves it names."""
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  return ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=partial)


def _data_state_for_this_process(data: dict):
  if data["process_count"] != jax.process_count():
    log.warning("the checkpoint's data-iterator state is from %d processes, this run has %d: "
                "the data order restarts from the beginning", data["process_count"], jax.process_count())
    return None
  return _decode(data["processes"][jax.process_index()])
