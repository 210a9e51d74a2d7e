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
from flash_layers.data import eval_plan
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


def _global(x) -> np.ndarray:
  """This process's rows of a host or device array -> the rows of all processes, in order."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def evaluate(eval_step, params, batches: Iterator[dict], num_batches: int, mesh: Mesh, *, num_labels: int,
             aggregation: str = "mean", keep_probabilities: bool = False) -> dict:
  """Loss, accuracy, macro-F1 and the confusion matrix over the documents of `num_batches` batches.

  Slots (a document or one of its windows) are combined per document by their `doc_ids`
  (data.eval_plan): one prediction per document, from the "mean" or "max" of its window logits.
  A batch without doc_ids counts each labelled slot as its own document. Every process runs the
  same number of steps (collectives): a process whose batches are used up feeds copies of its
  last batch with no documents in it.
  """
  slot_logits, slot_docs, slot_labels = [], [], []
  shardings: dict = {}
  last, next_doc = None, 0
  for _ in range(num_batches):
    batch = next(batches, None)
    if batch is None:
      batch = dict(last)
      batch["labels"] = np.full_like(np.asarray(last["labels"]), -1)
      batch["doc_ids"] = np.full_like(np.asarray(last["labels"]), -1)
    last = batch
    device_batch = {k: v for k, v in batch.items() if k != "doc_ids"}
    shape = tuple(np.shape(device_batch["input_ids"]))
    if shape not in shardings:  # one per bucket length; the length axis goes over `sequence`
      shardings[shape] = sharding_lib.batch_shardings(device_batch, mesh, shape[1])
    out = eval_step(params, sharding_lib.to_global(device_batch, shardings[shape]))
    labels = _global(np.asarray(batch["labels"]))
    if "doc_ids" in batch:
      docs = _global(np.asarray(batch["doc_ids"]))
    else:
      docs = np.full(labels.shape, -1, np.int64)
      docs[labels >= 0] = next_doc + np.arange(int(np.sum(labels >= 0)))
      next_doc += int(np.sum(labels >= 0))
    slot_logits.append(_global(out["logits"]).reshape(-1, num_labels))
    slot_docs.append(docs.reshape(-1))
    slot_labels.append(labels.reshape(-1))
  logits = np.concatenate(slot_logits) if slot_logits else np.zeros((0, num_labels))
  docs = np.concatenate(slot_docs) if slot_docs else np.zeros((0,), np.int64)
  labels = np.concatenate(slot_labels) if slot_labels else np.zeros((0,), np.int64)
  num_docs = int(docs.max()) + 1 if docs.size else 0
  doc_logits, seen = eval_plan.aggregate_logits(logits, docs, num_docs, aggregation)
  doc_labels = np.full(num_docs, -1, np.int64)
  doc_labels[docs[docs >= 0]] = labels[docs >= 0]
  scored = seen & (doc_labels >= 0)
  log_probs = _log_softmax(doc_logits[scored])
  truth = doc_labels[scored]
  predicted = np.argmax(log_probs, axis=-1)
  confusion = np.zeros((num_labels, num_labels), np.int64)
  np.add.at(confusion, (truth, predicted), 1)
  count = int(scored.sum())
  loss = float(-log_probs[np.arange(count), truth].sum() / max(count, 1))
  result = {"loss": loss, "count": count, "num_windows": int(np.sum(docs >= 0)),
            **metrics_lib.summarize(confusion), "confusion_matrix": confusion}
  if keep_probabilities:
    result["doc_ids"] = np.flatnonzero(seen)
    result["probabilities"] = np.exp(_log_softmax(doc_logits[seen]))
    result["labels"] = doc_labels[seen]
  return result


def _log_softmax(logits: np.ndarray) -> np.ndarray:
  shifted = logits - logits.max(axis=-1, keepdims=True) if logits.size else logits
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


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
  eval_step = jax.jit(steps_lib.make_eval_step(task.logits_fn))
  batches, count = task.eval_batches(config.data.eval_split)
  result = evaluate(eval_step, params, batches, count, mesh, num_labels=task.num_labels,
                    aggregation=config.data.window_aggregation)
  report = {
    "split": config.data.eval_split, "checkpoint": checkpoint, "checkpoint_step": step,
    "accuracy": result["accuracy"], "macro_f1": result["macro_f1"], "loss": result["loss"],
    "num_examples": result["count"], "num_windows": result["num_windows"], "labels": task.label_names,
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
  """One prediction per document (`data.read_documents` rows), as JSONL, batched as evaluation is
  (data.eval_plan); with data.long_documents="windows" a long document's window logits are combined."""
  batches = task.predict_batches([r[config.data.text_field] for r in rows])
  result = evaluate(eval_step, params, iter(batches), len(batches), mesh, num_labels=task.num_labels,
                    aggregation=config.data.window_aggregation, keep_probabilities=True)
  if sorted(result["doc_ids"].tolist()) != list(range(len(rows))):
    raise AssertionError(f"predicted {len(result['doc_ids'])} of {len(rows)} documents")
  probabilities = result["probabilities"][np.argsort(result["doc_ids"])]
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
