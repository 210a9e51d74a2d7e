"""Fine-tune a ModernBERT checkpoint on long documents at 8,192 tokens (its full context).

    python train.py --config configs/modernbert_long.py --workdir runs/modernbert \\
        --config.model.pretrained=/path/to/ModernBERT-base \\
        --config.data.dataset=/path/to/data   # train/dev/test .jsonl, a CSV, or class folders

The checkpoint directory is Hugging Face's layout (config.json, model.safetensors,
tokenizer.json); its config decides the attention: global layers every
`global_attn_every_n_layers`, the others local over `local_attention` tokens, our `window`, so
flash_pallas visits only the tiles in the band. Documents are packed into the 8,192-token rows
and evaluation is packed and bucketed by length, so no compute goes to padding.

Sized for a TPU v5e-8 or v4-8 (16-32 GiB per chip) or 8 GPUs: ModernBERT-base (149M
parameters) in bfloat16 with remat, one 8,192-token row per device (batch_size 8 over
mesh.data=-1). On one 80 GB GPU set --config.train.grad_accum_steps=2 or more; on a larger slice
raise train.batch_size, or shard each row with --config.mesh.sequence.
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.model.pretrained = "REQUIRED: --config.model.pretrained=/path/to/a/ModernBERT/checkpoint"
  c.model.impl = "auto"  # flash_pallas on TPU/GPU
  c.model.max_len = 8192  # ModernBERT's max_position_embeddings: rotary, nothing to extend
  c.model.pooling = "mean"
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.dropout_rate = 0.0  # ModernBERT's configs set no hidden dropout
  c.data.dataset = "REQUIRED: --config.data.dataset=/path/to/your/data"
  c.data.tokenizer = ""  # the checkpoint's tokenizer.json
  c.data.long_documents = "windows"  # documents beyond 8,192 tokens: several windows, one prediction
  c.data.window_stride = 256
  c.data.window_aggregation = "mean"
  c.data.packing = True
  c.data.max_docs_per_row = 16
  c.data.num_workers = 4
  c.train.num_steps = 3000
  c.train.batch_size = 8
  c.train.learning_rate = 3e-5
  c.train.warmup_steps = 300
  c.train.weight_decay = 1e-5
  c.train.eval_every = 500
  c.checkpoint.every_steps = 500
  c.mesh.data = -1
  return c
