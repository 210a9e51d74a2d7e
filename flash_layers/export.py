"""A fine-tuned run out to Hugging Face transformers: `AutoModelForSequenceClassification` loads it
(`AutoModelForTokenClassification` a token-classification run's).

    python -m flash_layers.export --workdir runs/quickstart --out exported/quickstart
    python -m flash_layers.export --workdir runs/X --out DIR --checkpoint latest --config configs/X.py

or `export_to_transformers(workdir, out_dir)`. The run's config travels with it: every checkpoint
stores the config it was trained with, so `--workdir` alone rebuilds the model; `--config` (with its
`--config.a.b=...` overrides) replaces it. What is written, and what is refused, is
`flash_layers.models.export` (`export_model` for a model and params in hand).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from flash_layers.errors import UserError
from flash_layers.models import pretrained
from flash_layers.models.export import ExportError, check_exportable, export_model, head_kind, model_type_of
from flash_layers.training import checkpoint as checkpoint_lib
from flash_layers.training import cli, evaluate, objectives, sharding
from flash_layers.training import config as config_lib
from flash_layers.training import task as task_lib

__all__ = ["export_model", "export_to_transformers", "restore_run", "saved_config"]


def saved_config(workdir: str, checkpoint: str | int = "best"):
  """The config a checkpoint of the run was trained with, as a ConfigDict (default_config() with the
  saved values: a field added since the run keeps its default)."""
  checkpoint_lib.check_restorable(workdir, checkpoint)
  checkpoints = checkpoint_lib.Checkpointer(workdir, max_to_keep=1, best_metric="loss")
  try:
    restored = checkpoints.restore_config(which=checkpoint)
  finally:
    checkpoints.close()
  if restored is None:
    raise checkpoint_lib.NoCheckpointError(f"no {checkpoint} checkpoint in {workdir} could be read")
  config = config_lib.default_config()
  config.update(json.loads(restored[1]))
  return config


def restore_run(workdir: str, *, config=None, checkpoint: str | int = "best") -> dict[str, Any]:
  """A run's {"model", "params" (host arrays), "label_names", "tokenizer", "config", "step",
  "model_type", "objective"}: what `export_model` takes, restored from the checkpoint `checkpoint`
  (the objective with the head saved with it: thresholds, target statistics)."""
  if checkpoint not in ("latest", "best") and not str(checkpoint).isdigit():
    raise UserError(f"--checkpoint must be 'latest', 'best' or a step number; got {checkpoint!r}")
  which = checkpoint if checkpoint in ("latest", "best") else int(checkpoint)
  checkpoint_lib.check_restorable(workdir, which)  # before anything is built (or created in workdir)
  if config is None:
    config = saved_config(workdir, which)
  config_lib.validate(config)
  if config.data.long_documents == "hierarchical":
    raise ExportError("data.long_documents='hierarchical' cannot be exported: no transformers class reads a "
                      "document as chunks and combines their vectors")
  mesh = sharding.mesh_from_config(config)
  task = task_lib.build_task(config, mesh, with_train_data=False)
  source_type = None
  if config.model.pretrained:
    source = pretrained.read_config(pretrained.resolve_path(config.model.pretrained))
    source_type = source.get("model_type", "bert")
  model_type = model_type_of(task.model, source_type)
  kind = head_kind(task.objective.problem_type or task.objective.task)
  check_exportable(task.model, model_type, kind=kind)  # before the params are read
  step, params, objective = evaluate.restore_params(config, workdir, task, mesh, which)
  return {"model": task.model, "params": jax.tree.map(np.asarray, params), "label_names": task.label_names,
          "tokenizer": task_lib.tokenizer_path(config), "config": config, "step": step,
          "model_type": model_type, "objective": objective}


def task_fields(objective: objectives.Objective) -> dict[str, Any]:
  """`export_model`'s task arguments for a run's objective."""
  fields: dict[str, Any] = {"problem_type": objective.problem_type or objective.task}
  if isinstance(objective, objectives.MultiLabel):
    fields["thresholds"] = list(objective.thresholds)
  standardized = any(objective.mean) or any(s != 1 for s in objective.std) \
      if isinstance(objective, objectives.Regression) else False
  if standardized:
    fields["standardization"] = (objective.mean, objective.std)
  return fields


def export_to_transformers(workdir: str, out_dir: str | pathlib.Path, *, config=None,
                           checkpoint: str | int = "best") -> pathlib.Path:
  """Export checkpoint `checkpoint` ("best", "latest" or a step) of the run in `workdir`.

  config: None = the config stored with that checkpoint; else the ConfigDict to rebuild the model with.
  """
  run = restore_run(workdir, config=config, checkpoint=checkpoint)
  out = pathlib.Path(out_dir)
  if (out / "config.json").exists():
    raise UserError(f"--out {out}: already holds an export (config.json); choose another directory")
  return export_model(run["model"], run["params"], out, label_names=run["label_names"],
                      tokenizer=run["tokenizer"], model_type=run["model_type"],
                      max_tokens=run["config"].model.max_len, **task_fields(run["objective"]))


def _define_flags():
  config_flags.DEFINE_config_file("config", None, "Overrides the config stored with the run (configs/*.py).",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "The training run's workdir.", required=True)
  flags.DEFINE_string("out", None, "The directory to write (must not hold an export).", required=True)
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number.")
  return flags.FLAGS


def main(argv: list[str]) -> None:
  FLAGS = flags.FLAGS
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {argv[1:]} (flags are --name=value)")
  out = export_to_transformers(FLAGS.workdir, FLAGS.out, config=FLAGS.config, checkpoint=FLAGS.checkpoint)
  architecture = json.loads((out / "config.json").read_text())["architectures"][0]
  auto = "AutoModelFor" + next(k for k in ("TokenClassification", "MaskedLM", "SequenceClassification")
                               if architecture.endswith(k))
  print(f"exported {FLAGS.workdir} ({FLAGS.checkpoint}) to {out}: {auto}.from_pretrained({str(out)!r})")


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
