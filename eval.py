"""Evaluate a trained checkpoint: `python eval.py --config configs/quickstart.py --workdir runs/quickstart`.

Writes workdir/eval_metrics.json (accuracy, macro-F1, confusion matrix); with
`--predict docs.jsonl` also workdir/predictions.jsonl, one line per document.

A mistake in the config, a flag, the workdir or a data file prints one line naming it and exits
with status 2, before anything is compiled.
"""

from absl import flags
from ml_collections import config_flags

from flash_layers.errors import UserError
from flash_layers.training import cli, distributed

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "The config the model was trained with.", lock_config=True)
flags.DEFINE_string("workdir", None, "The training run's workdir.", required=True)
flags.DEFINE_string("checkpoint", "latest", "'latest', 'best' or a step number.")
flags.DEFINE_string("predict", None, "A JSONL file of {\"text\": ...} documents to predict.")
flags.DEFINE_string("predictions_out", None, "Where predictions go (default workdir/predictions.jsonl).")
distributed.define_flags()
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {argv[1:]} (flags are --name=value)")
  distributed.initialize_from_flags()
  from flash_layers.training import evaluate
  evaluate.evaluate_checkpoint(FLAGS.config, FLAGS.workdir, checkpoint=FLAGS.checkpoint,
                               predict=FLAGS.predict, predictions_path=FLAGS.predictions_out)


if __name__ == "__main__":
  cli.run(main)
