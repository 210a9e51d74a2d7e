"""Train a document classifier: `python train.py --config configs/quickstart.py --workdir runs/quickstart`.

Override any config field on the command line: `--config.train.num_steps=500`.
Run it again with the same --workdir to resume from the latest checkpoint.
`--aot_topology v5p:4x4x4` compiles the train step for that TPU slice and reports
memory and FLOPs without running anything (`--aot_num_slices 2`: for two such slices,
with the bytes each step moves over DCN and ICI).

A mistake in the config, a flag or a data file prints one line naming it and exits with status 2.
"""

from absl import flags
from ml_collections import config_flags

from flash_layers.errors import UserError
from flash_layers.training import cli, distributed

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl, TensorBoard events and profiles go here.")
flags.DEFINE_string("aot_topology", None, "Dry run: compile for this TPU slice (v5p:4x4x4); no training.")
flags.DEFINE_integer("aot_num_slices", 1, "Dry run: this many such slices joined by DCN (a multi-slice job).")
distributed.define_flags()
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {argv[1:]} (flags are --name=value)")
  if FLAGS.aot_topology:
    from flash_layers.training import aot
    aot.dry_run(FLAGS.config, FLAGS.aot_topology, FLAGS.aot_num_slices)
    return
  if not FLAGS.workdir:
    raise UserError("--workdir is required (unless --aot_topology)")
  distributed.initialize_from_flags()
  from flash_layers.training import loop
  loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  cli.run(main)
