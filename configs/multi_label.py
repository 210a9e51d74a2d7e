"""Multi-label: fine-tune all-MiniLM-L6-v2 to tag BBC News articles with the regions they name.

    python train.py --config configs/multi_label.py --workdir runs/multi_label
    python eval.py  --config configs/multi_label.py --workdir runs/multi_label --predict docs.jsonl

`bbc_news_regions` (flash_layers.data.bbc): five regions, any number per article, none included.
Each label is a sigmoid output; the decision threshold is tuned on dev at each dev evaluation
("tune": one for all labels), kept with the checkpoint, and used by eval.py, --predict and export.
Your own data: --config.data.dataset=path.jsonl whose label field is a list ([] for none), or a
CSV/TSV whose label cell separates labels with ";". Every field: flash_layers/training/config.py.
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.task = "multi_label_classification"
  c.model.pretrained = "minilm"
  c.model.impl = "auto"
  c.model.max_len = 256
  c.model.pooling = "cls"  # transformers' BertForSequenceClassification pools so (export)
  c.data.dataset = "bbc_news_regions"
  c.data.eval_split = "test"
  c.data.eval_batch_size = 16
  c.eval.threshold = "tune"  # or a number (0.5), or "tune_per_label"
  c.train.num_steps = 128
  c.train.batch_size = 8
  c.train.learning_rate = 2e-4
  c.train.warmup_steps = 12
  c.train.log_every = 4
  c.train.eval_every = 64
  c.train.eval_max_batches = 4  # 64 dev articles per evaluation
  c.checkpoint.every_steps = 32
  c.checkpoint.best_metric = "micro_f1"
  return c
