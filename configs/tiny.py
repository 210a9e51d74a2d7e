"""A seconds-long run for tests and smoke checks: a 2-layer, 32-wide BERT from scratch on a JSONL file.

    python train.py --config configs/tiny.py --workdir /tmp/tiny --config.data.dataset=data.jsonl
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.model.pretrained = None
  c.model.impl = "xla_native"
  c.model.max_len = 32
  c.model.num_layers = 2
  c.model.hidden_size = 32
  c.model.num_heads = 2
  c.model.mlp_dim = 64
  c.model.pooling = "mean"
  c.model.dropout_rate = 0.1
  c.model.attention_dropout = 0.0  # xla_native has no attention dropout
  c.data.dataset = "REQUIRED: --config.data.dataset=path.jsonl"
  c.data.tokenizer = "minilm"
  c.data.eval_split = "dev"
  c.train.num_steps = 20
  c.train.batch_size = 8
  c.train.learning_rate = 3e-3
  c.train.warmup_steps = 2
  c.train.log_every = 2
  c.train.eval_every = 10
  c.checkpoint.every_steps = 5
  c.checkpoint.max_to_keep = 2
  return c
