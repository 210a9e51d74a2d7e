"""Hierarchical documents: each article read as up to 4 chunks of 256 tokens, each chunk pooled, the
chunk vectors combined by an attention pool, and the whole trained end to end (multi-label regions).

    python train.py --config configs/hierarchical.py --workdir runs/hierarchical
    python eval.py  --config configs/hierarchical.py --workdir runs/hierarchical

The strong long-document baseline of Chalkidis et al. (LexGLUE, 2022: hierarchical BERT on ECtHR,
71.4 micro-F1 vs Longformer's 69.6), here on `bbc_news_regions`, whose labels can come from anywhere
in an article. A row holds one article's chunks as its segments: attention stays inside a chunk,
positions restart in each, so the checkpoint's 512-row position table is never extended. Any of the
document tasks (classification, multi_label_classification, regression) reads documents this way.
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.task = "multi_label_classification"
  c.model.pretrained = "minilm"
  c.model.impl = "auto"
  c.model.max_len = 256  # tokens per chunk
  c.model.pooling = "cls"  # each chunk's [CLS] through the pooler
  c.model.chunk_pooling = "attention"  # or "mean", "max"
  c.data.dataset = "bbc_news_regions"
  c.data.long_documents = "hierarchical"
  c.data.max_chunks = 4  # rows of up to 1,024 tokens
  c.data.eval_split = "test"
  c.data.eval_batch_size = 8
  c.eval.threshold = "tune"
  c.train.num_steps = 64
  c.train.batch_size = 8
  c.train.learning_rate = 2e-4
  c.train.warmup_steps = 6
  c.train.log_every = 4
  c.train.eval_every = 32
  c.train.eval_max_batches = 8
  c.checkpoint.every_steps = 32
  c.checkpoint.best_metric = "micro_f1"
  return c
