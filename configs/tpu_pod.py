"""A v5p pod slice: fully sharded BERT-large-sized encoder, bfloat16, remat, flash_pallas, 8,192 tokens.

Dry run on any machine with libtpu (compiles for the slice, reports per-chip HBM and FLOPs):
    python train.py --config configs/tpu_pod.py --aot_topology v5p:4x4x4
On the slice itself (every host runs the same command; jax.distributed finds its peers):
    python train.py --config configs/tpu_pod.py --workdir gs://bucket/run --config.data.dataset=...
"""

from flash_layers.training.config import default_config


def get_config():
  c = default_config()
  c.seed = 0
  c.model.pretrained = None  # BERT-large sizes from scratch (set a directory to fine-tune one)
  c.model.num_layers = 24
  c.model.hidden_size = 1024
  c.model.num_heads = 16
  c.model.mlp_dim = 4096
  c.model.vocab_size = 30522
  c.model.impl = "flash_pallas"
  c.model.max_len = 8192
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.pooling = "mean"
  c.model.num_labels = 16  # used by the dry run, which reads no data
  c.data.dataset = "REQUIRED: --config.data.dataset=/path/to/your/data"
  c.data.tokenizer = "minilm"  # BERT uncased WordPiece vocabulary (30,522)
  c.data.num_workers = 8
  c.train.num_steps = 20000
  c.train.batch_size = 256  # global: 2M tokens per step
  c.train.grad_accum_steps = 1
  c.train.learning_rate = 1e-4
  c.train.warmup_steps = 1000
  c.train.schedule = "cosine"
  c.checkpoint.every_steps = 1000
  c.checkpoint.max_to_keep = 3
  # 64 chips of v5p:4x4x4 per slice (the dry run maps these onto whatever topology it is given).
  c.mesh.data = 1
  c.mesh.fsdp = -1  # params, grads and Adam state sharded over all the rest (ZeRO-3)
  c.mesh.tensor = 1
  c.mesh.sequence = 4  # context parallelism over 4 chips, 2,048 tokens each (the dry run names the strategy)
  c.mesh.dcn_data = -1  # several slices (--aot_num_slices): data-parallel across them, over DCN
  return c
