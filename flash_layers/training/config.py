"""Every training setting, documented where it is defined, and its validation.

The files in configs/ start from `default_config()` and change what their task
needs; `validate()` checks a finished config before anything is compiled, so a
bad value is a `ConfigError` naming the field, not a traceback from inside JAX.
"""

from __future__ import annotations

import os

import ml_collections
from ml_collections.config_dict import placeholder

from flash_layers import data as data_lib
from flash_layers import models
from flash_layers.errors import UserError
from flash_layers.impls import IMPLS, registry
from flash_layers.parallel.context import AUTO_STRATEGY, STRATEGIES
from flash_layers.parallel.mesh import AXES, resolve_mesh_sizes, slice_count
from flash_layers.training import compile_cache, objectives


def default_config() -> ml_collections.ConfigDict:
  """Every field with its default. Optional fields are typed placeholders (None until set),
  so `--config.a.b=value` can still set them on the command line."""
  c = ml_collections.ConfigDict()

  # Seed for parameter init (of anything not loaded from a checkpoint), dropout
  # and data shuffling. Same seed + data + mesh -> bitwise-identical losses on CPU.
  c.seed = 0

  # What the model learns (training/objectives.py): "classification" (one class per document),
  # "multi_label_classification" (a set of classes per document, possibly empty), "regression"
  # (one number per document, or several: model.num_labels outputs) or "token_classification"
  # (a tag per word: data.tokens_field, data.tags_field) or "masked_lm" (continued pretraining on
  # the dataset's text, labels ignored: data.mlm_probability, data.whole_word_masking).
  c.task = "classification"

  c.model = m = ml_collections.ConfigDict()
  # Attention implementation for every layer: "auto" or one of flash_layers.IMPLS
  # ("flash_pallas", "xla_native", "xla_chunked", "xla_dense", "reference", "jax_splash").
  m.impl = "auto"
  # How attention splits a mesh's sequence axis (mesh.sequence > 1): "auto" (a cost model chooses,
  # per layer shape: flash_layers.parallel.cost), "ring", "ulysses", "all_gather" or "ulysses_ring".
  m.context_parallel = "auto"
  # Tokens per row. Beyond the checkpoint's position table (512 for BERT) the
  # learned positions are extended (see position_extension), up to
  # max_position_extension times the table.
  m.max_len = 512
  # Hugging Face BERT-format directory (config.json + model.safetensors), or a
  # name the model package knows (e.g. "all-MiniLM-L6-v2"); None = from scratch
  # with the sizes below and data.tokenizer.
  m.pretrained = placeholder(str)
  # A training run's workdir to start from (any task): its latest checkpoint's encoder (with its
  # position table, extended here if max_len is longer), prediction and masked-LM heads; the
  # classifier is this run's own. model.pretrained still says the architecture and tokenizer.
  m.init_from = placeholder(str)
  # "repeat" the learned position rows (as Longformer) or "interpolate" them.
  m.position_extension = "repeat"
  # How many times the pretrained position table may be extended.
  m.max_position_extension = 16
  # Longformer-style sparse attention for BERT/RoBERTa models: None = full
  # attention; w = each token sees w // 2 tokens on either side. With it,
  # global_tokens = g: each document's first g tokens (its [CLS] for 1) attend,
  # and are attended by, the whole document.
  m.attention_window = placeholder(int)
  m.global_tokens = 0
  # Document representation fed to the classifier: "cls" or "mean" (mean over
  # the document's tokens, masked by segment ids).
  m.pooling = "cls"
  # data.long_documents="hierarchical": how a document's chunk vectors become one: "mean", "max"
  # (elementwise), or "attention" (a softmax over a learned score of each chunk).
  m.chunk_pooling = "mean"
  # Compute dtype: "float32" or "bfloat16" (params stay float32).
  m.dtype = "float32"
  # Rematerialize each block in the backward pass (saves activation memory).
  m.remat = False
  # Hidden dropout as BERT's hidden_dropout_prob.
  m.dropout_rate = 0.1
  # Attention-probability dropout in training (BERT's attention_probs_dropout_prob):
  # None = the checkpoint's value (0.1 for BERT and MiniLM), or model.dropout_rate
  # when training from scratch; 0.0 turns it off. Its mask is fl.dropout_mask, the
  # same under every impl and mesh; xla_native has none (set 0.0 to train with it).
  m.attention_dropout = placeholder(float)
  # Sizes used only when training from scratch (pretrained=None).
  m.num_layers = 2
  m.hidden_size = 128
  m.num_heads = 4
  m.mlp_dim = 512
  m.vocab_size = placeholder(int)  # None: the tokenizer's vocabulary size.
  # Outputs of the head (classes, labels, or regression targets); None = from the training
  # data (the TPU dry run, which reads no data, needs it set).
  m.num_labels = placeholder(int)

  c.data = d = ml_collections.ConfigDict()
  # "bbc_news", "listops" (classification), "bbc_news_regions" (multi-label), "bbc_news_quotes"
  # (regression), "bbc_news_places" (token classification: data.bbc), or a path: a JSONL/CSV/TSV
  # file, a folder with one sub-folder of .txt files per class, or a directory holding
  # train/dev/test as such files or folders (flash_layers.data.load).
  d.dataset = "bbc_news"
  # Without a dev split on disk, this fraction of train (seeded) becomes dev.
  d.dev_fraction = 0.1
  # The split eval.py scores ("test", or "dev" when there is no test split).
  d.eval_split = "test"
  d.text_field = "text"
  # Token classification: the fields holding a document's words (a list of strings) and their tags
  # (one per word: "O", "B-TYPE", "I-TYPE").
  d.tokens_field = "tokens"
  d.tags_field = "tags"
  # The label: a class (classification); a JSONL list of classes, or ";"-separated classes in
  # CSV/TSV, possibly empty (multi-label); a number or a list of numbers (regression).
  d.label_field = "label"
  # A class in dev/test never seen in training: "error" (naming the file and line), or "ignore":
  # dropped from a multi-label set (a single-label document with one is dropped), and reported.
  d.unseen_labels = "error"
  # Regression: train on targets standardized by the training split's mean and std (outputs are
  # mapped back for metrics and predictions; export folds the map into the head).
  d.standardize_targets = False
  # Masked LM: the share of maskable tokens (not special, not padding) chosen each step; with
  # whole_word_masking the share of words, all of a chosen word's pieces masked together.
  d.mlm_probability = 0.15
  d.whole_word_masking = False
  # Tokenizer: "minilm", "listops", a tokenizer.json or a directory holding one;
  # "" = the pretrained model's directory.
  d.tokenizer = ""
  # Long documents: "truncate" to max_len, or split into "windows" (each window
  # is then a training example with the document's label; evaluation and
  # prediction combine a document's windows into one prediction), or
  # "hierarchical": a row holds one document's first max_chunks windows of max_len
  # tokens as its segments, each pooled, the chunk vectors combined by
  # model.chunk_pooling and classified end to end (not for token classification
  # or masked LM; packing off).
  d.long_documents = "truncate"
  d.max_chunks = 8
  d.window_stride = 0  # tokens shared by consecutive windows
  # How a document's window logits are combined: "mean" or elementwise "max".
  d.window_aggregation = "mean"
  # Pack several short documents into one training row (segment ids keep them apart).
  d.packing = False
  # The most documents (or windows) in one packed row, in training and evaluation.
  d.max_docs_per_row = 8
  # Evaluation and prediction pack documents into rows bucketed by length
  # (flash_layers.data.eval_plan), so their cost follows the real tokens;
  # False pads every document to max_len in a row of its own.
  d.eval_packing = True
  # Shuffle the training data (seeded by config.seed, reshuffled each epoch);
  # False keeps file order.
  d.shuffle = True
  # Worker processes for tokenization (0 = in the main process).
  d.num_workers = 0
  # Number of examples per split for generated datasets (listops); None = the default.
  d.num_examples = placeholder(int)
  # Rows per evaluation batch over all processes; None = train.batch_size / grad_accum_steps.
  # With eval_packing, batches of rows longer than 512 tokens hold proportionally fewer rows
  # (flash_layers.data.eval_plan.rows_per_batch).
  d.eval_batch_size = placeholder(int)

  c.train = t = ml_collections.ConfigDict()
  # Optimizer updates to run; one step consumes one global batch.
  t.num_steps = 1000
  # Global batch (documents or packed rows per step, over all processes).
  t.batch_size = 32
  # Split each global batch into this many micro-batches, scanned in one step.
  t.grad_accum_steps = 1
  # Peak AdamW learning rate, reached after warmup_steps.
  t.learning_rate = 5e-5
  t.end_learning_rate = 0.0
  t.warmup_steps = 100
  t.schedule = "linear"  # "linear", "cosine" or "constant" after warmup
  t.weight_decay = 0.01  # not on LayerNorm, biases or embeddings
  t.adam_b1 = 0.9
  t.adam_b2 = 0.999
  t.adam_eps = 1e-8
  t.grad_clip_norm = 1.0  # 0 = no clipping
  t.label_smoothing = 0.0  # classification only
  # Console progress and metrics.jsonl/TensorBoard record every log_every steps.
  t.log_every = 10
  # Dev evaluation every eval_every steps and at the end (0 = only at the end).
  t.eval_every = 200
  # Cap on dev batches per evaluation (None = the whole dev split; else >= 1).
  t.eval_max_batches = placeholder(int)
  # Per-device peak FLOP/s for the MFU estimate; None = look it up by device kind.
  t.peak_flops_per_device = placeholder(float)

  c.checkpoint = k = ml_collections.ConfigDict()
  # Save (asynchronously) every every_steps steps and at the end.
  k.every_steps = 200
  k.max_to_keep = 2
  # Dev metric that selects the best checkpoint, kept apart in workdir/best.
  # Dev metric that selects it: None = the task's first (objectives.BEST_METRICS): classification
  # "accuracy" (or "macro_f1", "loss"), multi-label "micro_f1" (or "macro_f1", "samples_f1",
  # "mean_average_precision", "loss"), regression "mse" (or "mae", "pearson", "spearman", "loss").
  # loss, mse and mae: lower is better.
  k.best_metric = placeholder(str)

  c.eval = e = ml_collections.ConfigDict()
  # Multi-label decision threshold on each label's probability: a number (0.5), "tune" (one
  # threshold for all labels, the one maximizing dev micro-F1 at each dev evaluation) or
  # "tune_per_label" (each label's own, maximizing its dev F1). A tuned threshold is saved with
  # the checkpoint and used by eval.py, prediction and export.
  e.threshold = ml_collections.FieldReference(0.5, field_type=object)

  # Device mesh axis sizes within one slice (all devices when there is one);
  # -1 = all remaining devices of the slice.
  c.mesh = ms = ml_collections.ConfigDict()
  ms.data = -1
  ms.fsdp = 1
  ms.tensor = 1
  ms.sequence = 1
  # Several TPU slices joined by the data-center network (DCN): how the slices
  # split between data and fsdp (the mesh's data axis is dcn_data x data, fsdp
  # likewise); dcn_data x dcn_fsdp = number of slices, -1 = the rest of them.
  # Tensor and sequence never span slices.
  ms.dcn_data = 1
  ms.dcn_fsdp = 1

  # Trace this many steps with jax.profiler into workdir/profile (0 = off),
  # starting at step profile_start (after compilation).
  c.profile_steps = 0
  c.profile_start = 3

  # JAX's persistent compilation cache: compiled programs are kept here and a later run
  # (train.py, eval.py) loads them instead of compiling again. Default: under the user's cache
  # ($FLASH_LAYERS_CACHE, else $XDG_CACHE_HOME/flash_layers, else ~/.cache/flash_layers, then
  # jax_compilation_cache; training.compile_cache). "" = no cache.
  c.compilation_cache_dir = compile_cache.default_dir()
  return c


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------

# The built-in datasets and the task each one's labels are for.
BUILTIN_TASKS = {"bbc_news": "classification", "listops": "classification",
                 "bbc_news_regions": "multi_label_classification", "bbc_news_quotes": "regression",
                 "bbc_news_places": "token_classification"}
BUILTIN_DATASETS = tuple(BUILTIN_TASKS)


class ConfigError(UserError, ValueError):
  """A config value that cannot work; the message starts with the field (`config.train.num_steps: ...`)."""


def _fail(field: str, message: str):
  raise ConfigError(f"config.{field}: {message}")


def _positive_int(config, field: str, *, allow_zero: bool = False):
  value = config
  for part in field.split("."):
    value = value[part]
  ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
  if not ok:
    _fail(field, f"must be an integer {'>= 0' if allow_zero else '> 0'}; got {value!r}")


def _optional_positive_int(config, field: str):
  section, name = field.split(".")
  if config[section][name] is not None:
    _positive_int(config, field)


def _choice(value, field: str, allowed):
  if value not in allowed:
    _fail(field, f"must be one of {tuple(allowed)}; got {value!r}")


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None,
             num_slices: int | None = None, check_data: bool = True) -> None:
  """Raise ConfigError (a ValueError) naming the first bad field. Runs before any compilation.

  num_devices: devices the mesh must tile (default: jax.device_count()).
  num_slices: how many slices they form (default: from jax.devices()' slice_index).
  check_data: False for the TPU dry run, which never reads data.
  """
  m = config.model
  _validate_task(config)
  _validate_model(config)
  _validate_train(config)
  _validate_checkpoint(config)
  if check_data and m.pretrained:
    _check_position_table(m)
  if check_data or not m.pretrained:  # (a pretrained rate is read from the checkpoint)
    check_attention_dropout(m, attention_dropout(config))

  _validate_data(config, check_data)
  _validate_mesh(config, num_devices, num_slices)


def best_metric(config: ml_collections.ConfigDict) -> str:
  """checkpoint.best_metric resolved: the field, else the task's default."""
  return config.checkpoint.best_metric or objectives.BEST_METRICS[config.task][0]


def _validate_task(config: ml_collections.ConfigDict) -> None:
  _choice(config.task, "task", objectives.TASKS)
  builtin_task = BUILTIN_TASKS.get(config.data.dataset)
  if builtin_task not in (None, config.task) and config.task != "masked_lm":  # MLM reads any text
    builtins = [repr(n) for n, t in BUILTIN_TASKS.items() if t == config.task]
    _fail("data.dataset", f"the built-in {config.data.dataset!r} is a {builtin_task!r} dataset; config.task="
          f"{config.task!r} takes " + "".join(f"{name} or " for name in builtins)
          + "a JSONL/CSV/TSV file or a directory of them")
  if config.task != "classification" and config.train.label_smoothing:
    _fail("train.label_smoothing", f"is for task 'classification' only; got {config.train.label_smoothing} "
          f"with task {config.task!r}")
  threshold = config.eval.threshold
  if isinstance(threshold, str):
    _choice(threshold, "eval.threshold", objectives.THRESHOLD_MODES)
  elif isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold < 1.0:
    _fail("eval.threshold", f"must be a number in (0, 1), 'tune' or 'tune_per_label'; got {threshold!r}")
  _choice(config.data.unseen_labels, "data.unseen_labels", data_lib.UNSEEN_LABELS)
  if config.task == "masked_lm":
    if not 0.0 < config.data.mlm_probability < 1.0:
      _fail("data.mlm_probability", f"must be in (0, 1); got {config.data.mlm_probability!r}")
    if config.model.num_labels is not None:
      _fail("model.num_labels", f"is {config.model.num_labels} but task 'masked_lm' has no classification "
            "head (its outputs are the vocabulary); leave it None")
  if not isinstance(config.data.whole_word_masking, bool):
    _fail("data.whole_word_masking", f"must be True or False; got {config.data.whole_word_masking!r}")
  if not isinstance(config.data.standardize_targets, bool):
    _fail("data.standardize_targets", f"must be True or False; got {config.data.standardize_targets!r}")


def _validate_model(config: ml_collections.ConfigDict) -> None:
  m = config.model
  _choice(m.impl, "model.impl", ("auto", *IMPLS))
  _choice(m.context_parallel, "model.context_parallel", (AUTO_STRATEGY, *STRATEGIES))
  _positive_int(config, "model.max_len")
  _choice(m.pooling, "model.pooling", models.POOLINGS)
  _choice(m.dtype, "model.dtype", tuple(models.DTYPES))
  _choice(m.position_extension, "model.position_extension", models.POSITION_EXTENSIONS)
  if m.attention_window is not None and (not isinstance(m.attention_window, int) or m.attention_window < 2):
    _fail("model.attention_window", f"must be None or an int >= 2; got {m.attention_window!r}")
  _positive_int(config, "model.global_tokens", allow_zero=True)
  if m.global_tokens and m.attention_window is None:
    _fail("model.global_tokens", f"{m.global_tokens} needs model.attention_window (global tokens waive "
          "the window)")
  if not 0.0 <= m.dropout_rate < 1.0:
    _fail("model.dropout_rate", f"must be in [0, 1); got {m.dropout_rate!r}")
  if m.attention_dropout is not None and not 0.0 <= m.attention_dropout < 1.0:
    _fail("model.attention_dropout", f"must be None or in [0, 1); got {m.attention_dropout!r}")
  if m.pretrained is None:
    for size in ("num_layers", "hidden_size", "num_heads", "mlp_dim"):
      _positive_int(config, f"model.{size}")
  _optional_positive_int(config, "model.vocab_size")
  _optional_positive_int(config, "model.num_labels")
  if m.init_from is not None and not os.path.isdir(os.path.join(m.init_from, "checkpoints")):
    _fail("model.init_from", f"{m.init_from!r} is not a training run's workdir (no checkpoints/ in it)")


def _validate_train(config: ml_collections.ConfigDict) -> None:
  t = config.train
  _positive_int(config, "train.num_steps")
  _positive_int(config, "train.batch_size")
  _positive_int(config, "train.grad_accum_steps")
  _positive_int(config, "train.log_every")
  _positive_int(config, "train.eval_every", allow_zero=True)
  _positive_int(config, "train.warmup_steps", allow_zero=True)
  _optional_positive_int(config, "train.eval_max_batches")
  if not (isinstance(t.learning_rate, (int, float)) and t.learning_rate > 0):
    _fail("train.learning_rate", f"must be a number > 0; got {t.learning_rate!r}")
  if t.end_learning_rate < 0 or t.end_learning_rate > t.learning_rate:
    _fail("train.end_learning_rate", f"must be in [0, learning_rate={t.learning_rate}]; "
          f"got {t.end_learning_rate!r}")
  if t.weight_decay < 0:
    _fail("train.weight_decay", f"must be >= 0; got {t.weight_decay!r}")
  if t.grad_clip_norm < 0:
    _fail("train.grad_clip_norm", f"must be >= 0 (0 = off); got {t.grad_clip_norm!r}")
  _choice(t.schedule, "train.schedule", ("linear", "cosine", "constant"))
  if t.batch_size % t.grad_accum_steps:
    _fail("train.grad_accum_steps", f"must divide train.batch_size={t.batch_size}; "
          f"got {t.grad_accum_steps}")


def _validate_checkpoint(config: ml_collections.ConfigDict) -> None:
  k = config.checkpoint
  _positive_int(config, "checkpoint.every_steps")
  _positive_int(config, "checkpoint.max_to_keep")
  if k.best_metric is not None:
    _choice(k.best_metric, "checkpoint.best_metric", objectives.BEST_METRICS[config.task])
  _positive_int(config, "profile_steps", allow_zero=True)
  if not isinstance(config.get("compilation_cache_dir", ""), str):
    _fail("compilation_cache_dir", f"must be a directory or '' (no cache); "
          f"got {config.compilation_cache_dir!r}")


def _validate_data(config: ml_collections.ConfigDict, check_data: bool) -> None:
  d = config.data
  _choice(d.long_documents, "data.long_documents", (*data_lib.LONG_DOCS, "hierarchical"))
  if d.long_documents == "hierarchical":
    _positive_int(config, "data.max_chunks")
    _choice(config.model.chunk_pooling, "model.chunk_pooling", models.CHUNK_POOLINGS)
    if config.task in ("token_classification", "masked_lm"):
      _fail("data.long_documents", f"'hierarchical' is for the document tasks; task {config.task!r} reads "
            "'truncate' or 'windows'")
    if d.packing:
      _fail("data.packing", "must be False with data.long_documents='hierarchical' (a row holds one "
            "document's chunks)")
  _choice(d.window_aggregation, "data.window_aggregation", data_lib.AGGREGATIONS)
  _positive_int(config, "data.max_docs_per_row")
  if not isinstance(d.eval_packing, bool):
    _fail("data.eval_packing", f"must be True or False; got {d.eval_packing!r}")
  _choice(d.eval_split, "data.eval_split", ("dev", "test"))
  _positive_int(config, "data.window_stride", allow_zero=True)
  _positive_int(config, "data.num_workers", allow_zero=True)
  _optional_positive_int(config, "data.eval_batch_size")
  if not 0.0 < d.dev_fraction < 1.0:
    _fail("data.dev_fraction", f"must be in (0, 1); got {d.dev_fraction!r}")
  if check_data and d.dataset not in BUILTIN_DATASETS and not os.path.exists(d.dataset):
    _fail("data.dataset", f"{d.dataset!r} does not exist (a built-in dataset is one of "
          f"{BUILTIN_DATASETS}, anything else a JSONL/CSV/TSV file, a folder, or a directory of splits)")
  named_tokenizer = d.tokenizer in ("", "minilm", "listops")
  if check_data and not named_tokenizer and not os.path.exists(d.tokenizer):
    _fail("data.tokenizer", f"{d.tokenizer!r} does not exist (use 'minilm', 'listops', a tokenizer.json "
          "or a directory holding one)")


def attention_dropout(config: ml_collections.ConfigDict) -> float:
  """model.attention_dropout resolved: the value, else the checkpoint's, else model.dropout_rate."""
  m = config.model
  if m.attention_dropout is not None:
    return float(m.attention_dropout)
  if m.pretrained:
    return models.pretrained.attention_dropout_of(m.pretrained)
  return float(m.dropout_rate)


def check_attention_dropout(m, rate: float):
  """Refuse a resolved attention-dropout `rate` the model or impl of config.model `m` cannot apply."""
  if m.attention_dropout and m.pretrained and not models.pretrained.has_attention_dropout(m.pretrained):
    _fail("model.attention_dropout", f"is {m.attention_dropout} but {m.pretrained!r} is a ModernBERT "
          "checkpoint, which has no attention-probability dropout; use None or 0.0")
  # An impl without the dropout capability (xla_native, jax_splash) would refuse every call: say so now.
  if rate and m.impl in IMPLS and not registry.impl_has(m.impl, "dropout"):
    _fail("model.attention_dropout", f"is {rate} (None = the checkpoint's value) but model.impl="
          f"{m.impl!r} has no attention dropout; set model.attention_dropout=0.0 or another impl")


def _check_position_table(m):
  try:
    path = models.pretrained.resolve_path(m.pretrained)
    table = int(models.pretrained.read_config(path).get("max_position_embeddings", 512))
  except (FileNotFoundError, ImportError, ValueError) as e:
    _fail("model.pretrained", str(e))
  limit = table * m.max_position_extension
  if m.max_len > limit:
    _fail("model.max_len", f"{m.max_len} is above what the checkpoint's {table}-row position table can be "
          f"extended to ({table} x model.max_position_extension={m.max_position_extension} = {limit})")


def mesh_shape(config: ml_collections.ConfigDict, num_devices: int, num_slices: int = 1) -> dict[str, int]:
  """config.mesh resolved for `make_mesh`: the per-slice sizes and the DCN sizes, -1s replaced.

  ConfigError naming the field when the sizes do not tile `num_slices` slices of
  num_devices / num_slices devices each, or when tensor or sequence would span slices.
  """
  ms = config.mesh
  try:
    return resolve_mesh_sizes({axis: ms[axis] for axis in AXES},
                              {"dcn_data": ms.dcn_data, "dcn_fsdp": ms.dcn_fsdp},
                              num_devices, num_slices, field="config.mesh.{}")
  except ValueError as e:  # the shared resolver names the field; here it is the user's config
    raise ConfigError(str(e)) from None


def _validate_mesh(config, num_devices, num_slices):
  if num_devices is None:
    import jax
    devices = jax.devices()
    num_devices, num_slices = len(devices), num_slices or slice_count(devices)
  num_slices = num_slices or 1
  sizes = mesh_shape(config, num_devices, num_slices)
  t, m = config.train, config.model
  batch_shards = sizes["data"] * sizes["fsdp"] * sizes["dcn_data"] * sizes["dcn_fsdp"]
  micro = t.batch_size // t.grad_accum_steps
  if micro % batch_shards:
    _fail("train.batch_size", f"each micro-batch (batch_size {t.batch_size} / grad_accum_steps "
          f"{t.grad_accum_steps} = {micro}) must divide over the data*fsdp={batch_shards} shards")
  if m.max_len % sizes["sequence"]:
    _fail("model.max_len", f"{m.max_len} must divide over mesh.sequence={sizes['sequence']}")
  if m.pretrained is None and m.hidden_size % m.num_heads:
    _fail("model.num_heads", f"must divide model.hidden_size={m.hidden_size}; got {m.num_heads}")
