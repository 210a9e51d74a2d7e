"""Longformer's recipe for reading longer documents: copy the 512 learned positions to 4,096, then
continue masked-LM pretraining on the task's own text, sized for a TPU slice (v5e-8 or v4-8).

    python train.py --config configs/continued_pretraining.py --workdir runs/mlm4k \\
        --config.data.dataset=/path/to/texts      # any data the readers take; labels are ignored
    # then any task from that encoder, positions and all:
    python train.py --config configs/long_docs.py --workdir runs/long --config.model.init_from=runs/mlm4k

Beltagy et al. 2020 (Longformer, sec. 5 and Table 5): RoBERTa's positions copied ("repeat"), masked-LM
at 4,096 tokens, batch 64, lr 3e-5 with 500 warmup steps and polynomial decay; BPC 1.957 at the copy,
1.753 after 2k steps, 1.705 after 65k. Here: num_steps 2000 (their first reported point), linear
decay, 15% dynamic masking (80/10/10), documents packed into rows, bfloat16 with remat, the data axis
over the slice's 8 chips (8 rows each). eval.py reports mlm_loss below and from position 512: the
check that the copied positions reach the original ones. With model.pretrained a RoBERTa or BERT
directory its masked-LM head is loaded; MiniLM (the default, bundled) has none, so a fresh one is
trained (a run at 512 first trains it cheaply: docs/training.md). On a CPU it runs as a smoke test:
--config.model.max_len=1024 --config.train.batch_size=2 --config.train.num_steps=2.
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.task = "masked_lm"
  c.model.pretrained = "minilm"
  c.model.impl = "auto"  # flash_pallas on a TPU
  c.model.max_len = 4096
  c.model.position_extension = "repeat"  # rows 512.. copy rows 0..511, as Longformer
  c.model.remat = True
  c.model.dtype = "bfloat16"
  c.data.dataset = "bbc_news"  # built in, so the config runs as written: its articles' text
  c.data.packing = True
  c.data.max_docs_per_row = 16
  c.data.mlm_probability = 0.15
  c.data.whole_word_masking = False
  c.data.eval_split = "dev"
  c.train.num_steps = 2000
  c.train.batch_size = 64
  c.train.learning_rate = 3e-5
  c.train.warmup_steps = 500
  c.train.schedule = "linear"
  c.train.eval_every = 500
  c.train.eval_max_batches = 8
  c.checkpoint.every_steps = 250
  c.checkpoint.best_metric = "mlm_loss"
  c.mesh.data = -1
  return c
