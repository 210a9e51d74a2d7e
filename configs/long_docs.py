"""Your own long documents at 4,096 tokens: MiniLM with its 512 positions extended 8x,
flash_pallas attention, the token axis sharded over the mesh (ring attention).

    python train.py --config configs/long_docs.py --workdir runs/long \\
        --config.data.dataset=/path/to/data   # train/dev/test .jsonl, a CSV, or class folders

Meant for a TPU/GPU slice with >= 4 devices (sequence=4 shards of 1,024 tokens per document).
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.model.pretrained = "minilm"
  c.model.impl = "flash_pallas"
  c.model.max_len = 4096
  c.model.position_extension = "repeat"  # rows 512.. copy rows 0..511, as Longformer
  c.model.pooling = "mean"
  c.model.remat = True
  c.model.dtype = "bfloat16"
  c.data.dataset = "REQUIRED: --config.data.dataset=/path/to/your/data"
  c.data.text_field = "text"
  c.data.label_field = "label"
  c.data.long_documents = "truncate"  # or "windows": documents beyond 4,096 tokens in several rows
  c.data.num_workers = 2
  c.train.num_steps = 2000
  c.train.batch_size = 8
  c.train.learning_rate = 3e-5
  c.train.warmup_steps = 200
  c.train.eval_every = 200
  c.checkpoint.every_steps = 200
  c.mesh.data = -1
  c.mesh.sequence = 4  # each document's 4,096 tokens over 4 devices
  return c
