"""Token classification: fine-tune all-MiniLM-L6-v2 to tag the place names in BBC News articles.

    python train.py --config configs/token_classification.py --workdir runs/tokens
    python eval.py  --config configs/token_classification.py --workdir runs/tokens --predict docs.jsonl

`bbc_news_places` (flash_layers.data.bbc): each article's words, place names tagged B-/I- with their
region (B-BRITAIN, B-AMERICA, I-AMERICA, ...), the rest O. A word's first word-piece carries its tag.
Articles longer than a row are cut into windows that share `data.window_stride` tokens; evaluation
and --predict score each word once, from the window where it is most central. Your own data:
--config.data.dataset=path.jsonl with {"tokens": [...], "tags": [...]} per line (the field names are
data.tokens_field and data.tags_field). Every field: flash_layers/training/config.py.
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.task = "token_classification"
  c.model.pretrained = "minilm"
  c.model.impl = "auto"
  c.model.max_len = 256
  c.data.dataset = "bbc_news_places"
  c.data.long_documents = "windows"
  c.data.window_stride = 64
  c.data.packing = True  # an article's last, short window shares its row with others
  c.data.max_docs_per_row = 4
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
  c.checkpoint.best_metric = "entity_f1"
  return c
