"""Long documents at 4,096 tokens: MiniLM with its 512 positions extended 8x, documents packed
into rows (segment ids keep them apart), evaluation packed and bucketed by length.

    python train.py --config configs/long_docs.py --workdir runs/long \\
        --config.data.dataset=/path/to/data   # train/dev/test .jsonl, a CSV, or class folders

Sized for one TPU v5e/v4 host or one GPU: 8 rows of 4,096 tokens per step (~0.3 TFLOP per row
forward + backward), bfloat16 with remat. As written it also runs on a one-device CPU host
(impl "auto" picks the CPU's impl; a smoke run: --config.train.num_steps=2
--config.train.eval_max_batches=1, minutes per step). On a slice only the mesh changes, e.g.
--config.mesh.sequence=4 shards each row's tokens over 4 devices (ring attention) and the data
axis takes the rest. With --config.data.long_documents=windows a document longer than 4,096
tokens is read as several windows and scored once from their combined logits.
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.model.pretrained = "minilm"
  c.model.impl = "auto"  # flash_pallas on TPU/GPU, an XLA impl on CPU
  c.model.max_len = 4096
  c.model.position_extension = "repeat"  # rows 512.. copy rows 0..511, as Longformer
  c.model.pooling = "mean"
  c.model.remat = True
  c.model.dtype = "bfloat16"
  c.data.dataset = "bbc_news"  # built in, so the config runs as written; set your own data
  c.data.text_field = "text"
  c.data.label_field = "label"
  c.data.long_documents = "truncate"  # or "windows": documents beyond 4,096 tokens in several rows
  c.data.packing = True  # several documents per 4,096-token row: no compute on padding
  c.data.max_docs_per_row = 16
  c.data.num_workers = 2
  c.train.num_steps = 2000
  c.train.batch_size = 8
  c.train.learning_rate = 3e-5
  c.train.warmup_steps = 200
  c.train.eval_every = 200
  c.checkpoint.every_steps = 200
  c.mesh.data = -1
  c.mesh.sequence = 1  # e.g. 4 on a slice: each row's 4,096 tokens over 4 devices
  return c
