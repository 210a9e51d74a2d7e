"""Evaluation: `evaluate` (metrics over batches, used by the loop's dev evals) and
`evaluate_checkpoint(config, workdir, ...)` (score a saved checkpoint, optionally predict a file).

Writes workdir/eval_metrics.json ({"accuracy", "macro_f1", "loss", "confusion_matrix",
"labels", "split", "checkpoint_step", ...}) and, with `predict`, one JSON line per
input document: {"index", "prediction", "probabilities", ...the input's other fields}.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from flash_layers import data as data_lib
from flash_layers.errors import UserError
from flash_layers.parallel.mesh import LOGICAL_RULES
from flash_layers.training import checkpoint as checkpoint_lib
from flash_layers.training import config as config_lib
from flash_layers.training import metrics as metrics_lib
from flash_layers.training import sharding as sharding_lib
from flash_layers.training import state as state_lib
from flash_layers.training import steps as steps_lib
from flash_layers.training import task as task_lib
from flash_layers.training.distributed import log_job_info, setup_logging

log = logging.getLogger("flash_layers.training")


def evaluate(eval_step, params, batches: Iterator[dict], num_batches: int, shardings: dict | None,
             mesh: Mesh, seq_len: int, *, num_labels: int, keep_probabilities: bool = False) -> dict:
  """Loss, accuracy, macro-F1 and the confusion matrix over `num_batches` batches.

  Every process runs the same number of steps (collectives): a process whose
  shard is used up feeds copies of its last batch with all labels -1.
  """
  loss_sum, count = 0.0, 0.0
  confusion = np.zeros((num_labels, num_labels), np.int64)
  probabilities, labels = [], []
  last = None
  for _ in range(num_batches):
    batch = next(batches, None)
    if batch is None:
      batch = dict(last)
      batch["labels"] = np.full_like(np.asarray(last["labels"]), -1)
    last = batch
    if shardings is None:
      shardings = sharding_lib.batch_shardings(batch, mesh, seq_len)
    out = eval_step(params, sharding_lib.to_global(batch, shardings))
    loss_sum += float(out["loss_sum"])
    count += float(out["count"])
    confusion += np.asarray(out["confusion"], np.int64)
    if keep_probabilities:
      probabilities.append(np.asarray(multihost_utils.process_allgather(out["probabilities"], tiled=True)))
      labels.append(np.asarray(multihost_utils.process_allgather(batch["labels"], tiled=True)))
  result = {"loss": loss_sum / max(count, 1.0), "count": int(count), **metrics_lib.summarize(confusion),
            "confusion_matrix": confusion}
  if keep_probabilities:
    result["probabilities"] = np.concatenate(probabilities) if probabilities else np.zeros((0, num_labels))
    result["labels"] = np.concatenate(labels) if labels else np.zeros((0,), np.int32)
  return result


def restore_params(config, workdir: str, task: task_lib.Task, mesh, which: str | int):
  """(step, params) of a checkpoint, sharded on `mesh`; the optimizer state is not read."""
  abstract, _ = state_lib.params_shardings(task.init_params, mesh, LOGICAL_RULES)
  checkpoints = checkpoint_lib.Checkpointer(workdir, max_to_keep=config.checkpoint.max_to_keep,
                                            best_metric=config.checkpoint.best_metric)
  try:
    restored = checkpoints.restore_params(abstract, which=which)
  finally:
    checkpoints.close()
  if restored is None:
    raise checkpoint_lib.NoCheckpointError(f"no {which} checkpoint in {workdir} could be restored; "
                                           "run train.py with this --workdir first")
  step, params, saved_config = restored
  _warn_on_config_drift(config, json.loads(saved_config))
  return step, params


def _warn_on_config_drift(config, saved: dict):
  for field in ("impl", "max_len", "pooling", "pretrained"):
    if saved.get("model", {}).get(field) != config.model.get(field):
      log.warning("config.model.%s is %r here but %r in the checkpoint's config", field,
                  config.model.get(field), saved.get("model", {}).get(field))


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str, *, checkpoint: str = "latest",
                        predict: str | None = None, predictions_path: str | None = None,
                        task: task_lib.Task | None = None) -> dict:
  setup_logging()
  config_lib.validate(config, check_data=task is None)
  # Everything the user named is checked before anything is built or compiled.
  if checkpoint not in ("latest", "best") and not str(checkpoint).isdigit():
    raise UserError(f"--checkpoint must be 'latest', 'best' or a step number; got {checkpoint!r}")
  which = checkpoint if checkpoint in ("latest", "best") else int(checkpoint)
  documents = data_lib.read_documents(predict, text_column=config.data.text_field) if predict else None
  checkpoint_lib.check_restorable(workdir, which)
  log_job_info()
  mesh = sharding_lib.mesh_from_config(config)
  if task is None:
    task = task_lib.build_task(config, mesh, with_train_data=False)
  step, params = restore_params(config, workdir, task, mesh, which)
  with sharding_lib.sharding_context(mesh):
    return _evaluate(config, workdir, mesh, task, checkpoint, step, params, documents, predictions_path)


def _evaluate(config, workdir, mesh, task, checkpoint, step, params, documents, predictions_path) -> dict:
  log.info("evaluating checkpoint step %d (%s) on %s", step, checkpoint, config.data.eval_split)
  eval_step = jax.jit(steps_lib.make_eval_step(task.logits_fn, num_labels=task.num_labels))
  batches, count = task.eval_batches(config.data.eval_split)
  result = evaluate(eval_step, params, batches, count, None, mesh, task.seq_len,
                         num_labels=task.num_labels)
  report = {
    "split": config.data.eval_split, "checkpoint": checkpoint, "checkpoint_step": step,
    "accuracy": result["accuracy"], "macro_f1": result["macro_f1"], "loss": result["loss"],
    "num_examples": result["count"], "labels": task.label_names,
    "confusion_matrix": np.asarray(result["confusion_matrix"]).tolist(),
    "confusion_matrix_axes": "[true label, predicted label]",
  }
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "eval_metrics.json"), "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
    log.info("%s @ step %d\n%s", config.data.eval_split, step, metrics_lib.summary_table(
      {config.data.eval_split: {k: report[k] for k in ("loss", "accuracy", "macro_f1", "num_examples")}}))
  if documents is not None:
    predictions_path = predictions_path or os.path.join(workdir, "predictions.jsonl")
    predict_documents(config, task, params, eval_step, mesh, documents, predictions_path)
    report["predictions"] = predictions_path
  return report


def predict_documents(config, task: task_lib.Task, params, eval_step, mesh, rows: list[dict],
                      out_path: str) -> None:
  """One prediction per document (`data.read_documents` rows; first max_len tokens of each), as JSONL."""
  tokenizer = data_lib.TextTokenizer(task_lib.make_tokenizer(config).tokenizer, max_len=config.model.max_len)
  global_batch = task_lib.eval_batch_size(config)
  local = global_batch // jax.process_count()
  first = jax.process_index() * local
  probabilities = []
  shardings = None
  for start in range(0, len(rows), global_batch):
    chunk = rows[start:start + global_batch]
    mine = chunk[first:first + local]  # this process's slice of the global batch, in order
    windows = tokenizer.encode([r[config.data.text_field] for r in mine]) if mine else []
    batch = data_lib.pack_rows([[(w[0], -1)] for w in windows], batch_size=local,
                               max_len=config.model.max_len, max_docs=1, pad_id=tokenizer.pad_id)
    if shardings is None:
      shardings = sharding_lib.batch_shardings(batch, mesh, task.seq_len)
    out = eval_step(params, sharding_lib.to_global(batch, shardings))
    gathered = np.asarray(multihost_utils.process_allgather(out["probabilities"], tiled=True))
    probabilities.append(gathered.reshape(global_batch, -1)[:len(chunk)])
  probabilities = np.concatenate(probabilities)
  if jax.process_index() != 0:
    return
  with open(out_path, "w", encoding="utf-8") as f:
    for index, (row, probs) in enumerate(zip(rows, probabilities, strict=True)):
      record = {k: v for k, v in row.items() if k != config.data.text_field}
      record.update(index=index, prediction=task.label_names[int(np.argmax(probs))],
                    probabilities={str(name): round(float(p), 6)
                                   for name, p in zip(task.label_names, probs, strict=True)})
      f.write(json.dumps(record) + "\n")
  log.info("wrote %d predictions to %s", len(rows), out_path)
