"""Evaluation: `evaluate` (metrics over batches, used by the loop's dev evals) and
`evaluate_checkpoint(config, workdir, ...)` (score a saved checkpoint, optionally predict a file).

Writes workdir/eval_metrics.json (the task's metrics: "accuracy", "macro_f1", "loss" and the
"confusion_matrix" for classification, "micro_f1", ... for the other tasks (training/objectives.py);
"labels", "split", "checkpoint_step", ...) and, with `predict`, one JSON line per input document:
{"index", ...the task's prediction fields..., ...the input's other fields}: "prediction" and
"probabilities" (classification), "labels" and "scores" (multi-label), "value" or "values"
(regression).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable

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
from flash_layers.training.objectives import MaskedLM, Objective

log = logging.getLogger("flash_layers.training")
# Batch entries that stay on the host: which document (data.eval_plan) or word a slot or token is.
HOST_KEYS = ("doc_ids", "word_ids")


def _global(x) -> np.ndarray:
  """This process's rows of a host or device array -> the rows of all processes, in order."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def evaluate(eval_step, params, batches: Iterable[dict], num_batches: int, mesh: Mesh, *,
             objective: Objective, aggregation: str = "mean", keep_logits: bool = False,
             tune: bool = False) -> dict:
  """The objective's loss and metrics over the documents of `num_batches` batches.

  Slots (a document or one of its windows) are combined per document by their `doc_ids`
  (data.eval_plan): one prediction per document, from the "mean" or "max" of its window logits.
  A batch without doc_ids counts each labelled slot as its own document. Every process runs the
  same number of steps (collectives): a process whose batches are used up feeds copies of its
  last batch with no documents in it. With `tune` the objective's head is first tuned on these
  documents (`Objective.tune`); the result's "objective" is the one that scored them.
  """
  plan = batches if isinstance(batches, eval_plan.TokenBatches) else None
  batches = iter(batches)
  slot_logits, slot_docs, slot_labels, sums = [], [], [], []
  shardings: dict = {}
  last, next_doc = None, 0
  for _ in range(num_batches):
    batch = next(batches, None)
    if batch is None:
      batch = dict(last)
      batch["labels"] = objective.label_spec.empty(*np.shape(last["labels"])[:2])
      batch["doc_ids"] = np.full(np.shape(last["doc_ids"]), -1, np.int32)
      if "word_ids" in last:
        batch["word_ids"] = np.full(np.shape(last["word_ids"]), -1, np.int32)
    last = batch
    device_batch = {k: v for k, v in batch.items() if k not in HOST_KEYS}
    shape = tuple(np.shape(device_batch["input_ids"]))
    if shape not in shardings:  # one per bucket length; the length axis goes over `sequence`
      shardings[shape] = sharding_lib.batch_shardings(device_batch, mesh, shape[1])
    out = eval_step(params, sharding_lib.to_global(device_batch, shardings[shape]))
    if "stats" in out:  # masked LM: sums over the global batch, computed on device
      sums.append(jax.device_get(out["stats"]))
      continue
    if objective.per_token:  # a word's logits from the one token it is scored at
      word_ids = _global(np.asarray(batch["word_ids"])).reshape(-1)
      slot_logits.append(_global(out["logits"]).reshape(-1, objective.num_outputs)[word_ids >= 0])
      slot_docs.append(word_ids[word_ids >= 0])
      continue
    label_shape = objective.label_spec.shape
    labels = _global(np.asarray(batch["labels"])).reshape(-1, *label_shape)
    if "doc_ids" in batch:
      docs = _global(np.asarray(batch["doc_ids"])).reshape(-1)
    else:
      present = objective.present(labels)
      docs = np.full(len(labels), -1, np.int64)
      docs[present] = next_doc + np.arange(int(np.sum(present)))
      next_doc += int(np.sum(present))
    slot_logits.append(_global(out["logits"]).reshape(-1, objective.num_outputs))
    slot_docs.append(docs)
    slot_labels.append(labels)
  num_outputs = objective.num_outputs
  if isinstance(objective, MaskedLM):
    total = jax.tree.map(lambda *xs: np.sum(xs, axis=0), *sums) if sums else None
    scores = objective.summarize(total) if total else {}
    return {**scores, "loss": scores.get("mlm_loss", float("nan")), "count": scores.get("masked_tokens", 0),
            "num_windows": 0, "objective": objective}
  if objective.per_token:
    return _score_words(objective, plan, slot_logits, slot_docs, keep_logits)
  logits = np.concatenate(slot_logits) if slot_logits else np.zeros((0, num_outputs))
  docs = np.concatenate(slot_docs) if slot_docs else np.zeros((0,), np.int64)
  labels = (np.concatenate(slot_labels) if slot_labels
            else objective.label_spec.empty(0))
  num_docs = int(docs.max()) + 1 if docs.size else 0
  doc_logits, seen = eval_plan.aggregate_logits(logits, docs, num_docs, aggregation)
  doc_labels = objective.label_spec.empty(num_docs)
  doc_labels[docs[docs >= 0]] = labels[docs >= 0]
  scored = seen & objective.present(doc_labels)
  if tune:
    objective = objective.tune(doc_logits[scored], doc_labels[scored])
  result = {**objective.score(doc_logits[scored], doc_labels[scored]), "count": int(scored.sum()),
            "num_windows": int(np.sum(docs >= 0)), "objective": objective}
  if keep_logits:
    result["doc_ids"] = np.flatnonzero(seen)
    result["logits"] = doc_logits[seen]
  return result


def _score_words(objective, plan, word_logits: list, word_ids: list, keep_logits: bool) -> dict:
  """Token classification: every word of the plan's documents, scored or predicted once."""
  if plan is None:
    raise ValueError("token classification evaluates data.eval_plan.TokenBatches (they know the documents)")
  total = int(sum(plan.doc_words))
  logits = np.zeros((total, objective.num_outputs))
  seen = np.zeros(total, bool)
  if word_ids:
    ids = np.concatenate(word_ids)
    logits[ids] = np.concatenate(word_logits)
    seen[ids] = True
  result = {"count": len(plan.doc_words), "num_windows": plan.num_windows, "objective": objective}
  if plan.doc_tags is not None:
    result.update(objective.score_words(logits, seen, plan.doc_words, plan.doc_tags))
  if keep_logits:
    result["predictions"] = objective.predict_words(logits, seen, plan.doc_words)
  return result


def restore_params(config, workdir: str, task: task_lib.Task, mesh, which: str | int):
  """(step, params, objective) of a checkpoint: params sharded on `mesh` (the optimizer state is not
  read), and the task's objective with the head saved with them (thresholds, target statistics)."""
  abstract, _ = state_lib.params_shardings(task.init_params, mesh, LOGICAL_RULES)
  checkpoints = checkpoint_lib.Checkpointer(workdir, max_to_keep=config.checkpoint.max_to_keep,
                                            best_metric=config_lib.best_metric(config))
  try:
    restored = checkpoints.restore_params(abstract, which=which)
    head = checkpoints.restore_head(restored[0]) if restored is not None else None
  finally:
    checkpoints.close()
  if restored is None:
    raise checkpoint_lib.NoCheckpointError(f"no {which} checkpoint in {workdir} could be restored; "
                                           "run train.py with this --workdir first")
  step, params, saved_config = restored
  _warn_on_config_drift(config, json.loads(saved_config))
  return step, params, task.objective.with_head(head)


def _warn_on_config_drift(config, saved: dict):
  for field in ("impl", "max_len", "pooling", "pretrained"):
    if saved.get("model", {}).get(field) != config.model.get(field):
      log.warning("config.model.%s is %r here but %r in the checkpoint's config", field,
                  config.model.get(field), saved.get("model", {}).get(field))
  if saved.get("task", "classification") != config.get("task", "classification"):
    raise UserError(f"config.task is {config.task!r} but the checkpoint was trained for "
                    f"{saved.get('task', 'classification')!r}; evaluate it with --config.task="
                    f"{saved.get('task', 'classification')}")


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str, *, checkpoint: str = "latest",
                        predict: str | None = None, predictions_path: str | None = None,
                        task: task_lib.Task | None = None) -> dict:
  setup_logging()
  config_lib.validate(config, check_data=task is None)
  # Everything the user named is checked before anything is built or compiled.
  if checkpoint not in ("latest", "best") and not str(checkpoint).isdigit():
    raise UserError(f"--checkpoint must be 'latest', 'best' or a step number; got {checkpoint!r}")
  which = checkpoint if checkpoint in ("latest", "best") else int(checkpoint)
  if predict and config.task == "masked_lm":
    raise UserError("--predict: task 'masked_lm' predicts no labels; eval.py reports its masked-LM loss, "
                    "and a later run starts from its encoder with --config.model.init_from")
  documents = data_lib.read_documents(predict, text_column=task_lib.text_field(config),
                                      words=config.task == "token_classification") if predict else None
  checkpoint_lib.check_restorable(workdir, which)
  log_job_info()
  mesh = sharding_lib.mesh_from_config(config)
  if task is None:
    task = task_lib.build_task(config, mesh, with_train_data=False)
  step, params, objective = restore_params(config, workdir, task, mesh, which)
  with sharding_lib.sharding_context(mesh):
    return _evaluate(config, workdir, mesh, task, objective, checkpoint, step, params, documents,
                     predictions_path)


def _evaluate(config, workdir, mesh, task, objective, checkpoint, step, params, documents,
              predictions_path) -> dict:
  log.info("evaluating checkpoint step %d (%s) on %s", step, checkpoint, config.data.eval_split)
  eval_step = jax.jit(steps_lib.make_eval_step(task.logits_fn, objective))
  batches, count = task.eval_batches(config.data.eval_split)
  result = evaluate(eval_step, params, batches, count, mesh, objective=objective,
                    aggregation=config.data.window_aggregation)
  metrics = {k: v for k, v in result.items() if np.isscalar(v) and k not in ("count", "num_windows")}
  report = {
    "split": config.data.eval_split, "checkpoint": checkpoint, "checkpoint_step": step,
    "task": objective.task, **metrics, "num_examples": result["count"], "num_windows": result["num_windows"],
    "labels": task.label_names, **{k: v for k, v in objective.head().items()},
  }
  if "confusion_matrix" in result:
    report["confusion_matrix"] = np.asarray(result["confusion_matrix"]).tolist()
    report["confusion_matrix_axes"] = "[true label, predicted label]"
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "eval_metrics.json"), "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
    shown = ("loss", *metrics, "num_examples")
    log.info("%s @ step %d\n%s", config.data.eval_split, step, metrics_lib.summary_table(
      {config.data.eval_split: {k: report[k] for k in shown if k in report}}))
  if documents is not None:
    predictions_path = predictions_path or os.path.join(workdir, "predictions.jsonl")
    predict_documents(config, task, objective, params, eval_step, mesh, documents, predictions_path)
    report["predictions"] = predictions_path
  return report


def predict_documents(config, task: task_lib.Task, objective: Objective, params, eval_step, mesh,
                      rows: list[dict], out_path: str) -> None:
  """One prediction per document (`data.read_documents` rows), as JSONL, batched as evaluation is
  (data.eval_plan); with data.long_documents="windows" a long document's window logits are combined.
  The fields are the objective's (`Objective.predict`), at the checkpoint's thresholds."""
  text_field = task_lib.text_field(config)
  batches = task.predict_batches([r[text_field] for r in rows])
  result = evaluate(eval_step, params, batches, len(batches), mesh, objective=objective,
                    aggregation=config.data.window_aggregation, keep_logits=True)
  if objective.per_token:
    predictions = result["predictions"]
  else:
    if sorted(result["doc_ids"].tolist()) != list(range(len(rows))):
      raise AssertionError(f"predicted {len(result['doc_ids'])} of {len(rows)} documents")
    predictions = objective.predict(result["logits"][np.argsort(result["doc_ids"])])
  if jax.process_index() != 0:
    return
  with open(out_path, "w", encoding="utf-8") as f:
    for index, (row, predicted) in enumerate(zip(rows, predictions, strict=True)):
      # The input's other fields come back with the prediction (a token task's words too).
      record = {k: v for k, v in row.items() if k != config.data.text_field or objective.per_token}
      record.update(index=index, **predicted)
      f.write(json.dumps(record) + "\n")
  log.info("wrote %d predictions to %s", len(rows), out_path)
