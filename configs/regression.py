"""Regression: fine-tune all-MiniLM-L6-v2 to predict how much of a BBC News article is quotation.

    python train.py --config configs/regression.py --workdir runs/regression
    python eval.py  --config configs/regression.py --workdir runs/regression --predict docs.jsonl

`bbc_news_quotes` (flash_layers.data.bbc): the share of an article's sentences holding a quotation
mark, in [0, 1]. The head is linear; the loss is the mean squared error on targets standardized by
the training split's mean and std (data.standardize_targets), mapped back for metrics, predictions
and export. Your own data: --config.data.dataset=path.jsonl whose label field is a number, or a
list of numbers (several outputs). Every field: flash_layers/training/config.py.
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.task = "regression"
  c.model.pretrained = "minilm"
  c.model.impl = "auto"
  c.model.max_len = 256
  c.model.pooling = "cls"
  c.data.dataset = "bbc_news_quotes"
  c.data.standardize_targets = True
  c.data.eval_split = "test"
  c.data.eval_batch_size = 16
  c.train.num_steps = 128
  c.train.batch_size = 8
  c.train.learning_rate = 2e-4
  c.train.warmup_steps = 12
  c.train.log_every = 4
  c.train.eval_every = 64
  c.train.eval_max_batches = 4
  c.checkpoint.every_steps = 32
  c.checkpoint.best_metric = "mse"
  return c
