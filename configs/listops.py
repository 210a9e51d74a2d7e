"""LRA ListOps (Tay et al. 2020): 10-way classification of nested MIN/MAX/MED/SM expressions,
sequences of up to 2,000 tokens, a small BERT trained from scratch.

    python train.py --config configs/listops.py --workdir runs/listops

LRA's ListOps baseline is a 4-layer, 512-wide transformer; it needs a GPU/TPU to finish in hours.
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.model.pretrained = None  # from scratch
  c.model.impl = "auto"  # xla_chunked on CPU at this length, flash_pallas on TPU/GPU
  c.model.max_len = 2048  # ListOps keeps 500 < tokens < 2000; + [CLS] and [SEP]
  c.model.num_layers = 4
  c.model.hidden_size = 512
  c.model.num_heads = 8
  c.model.mlp_dim = 1024
  c.model.pooling = "mean"
  c.model.dropout_rate = 0.1
  c.data.dataset = "listops"  # generated from the published spec, cached after the first run
  c.data.tokenizer = "listops"  # word level: digits, operators, "]"
  c.data.eval_split = "test"
  c.train.num_steps = 5000
  c.train.batch_size = 32
  c.train.learning_rate = 5e-4
  c.train.warmup_steps = 500
  c.train.schedule = "cosine"
  c.train.weight_decay = 0.1
  c.train.eval_every = 500
  c.checkpoint.every_steps = 500
  return c
