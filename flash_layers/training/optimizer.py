"""AdamW as BERT fine-tuning uses it: warmup, then linear or cosine decay;
no weight decay on LayerNorm, biases and embeddings; global-norm clipping.

Gradient accumulation is not an optimizer wrapper here: the train step scans
over micro-batches (loop.py), so one optimizer update is one train step and the
schedule, the checkpoints and the logs all count the same steps.
"""

from __future__ import annotations

import jax
import ml_collections
import optax

SCHEDULES = ("linear", "cosine", "constant")


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate`, then decay to `end_learning_rate`."""
  peak = train.learning_rate
  warmup = int(train.warmup_steps)
  decay_steps = max(int(train.num_steps) - warmup, 1)
  end = train.get("end_learning_rate", 0.0)
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if train.schedule == "linear":
    decay = optax.linear_schedule(peak, end, decay_steps)
  elif train.schedule == "cosine":
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=end / peak if peak else 0.0)
  elif train.schedule == "constant":
    decay = optax.constant_schedule(peak)
  else:
    raise ValueError(f"config.train.schedule must be one of {SCHEDULES}; got {train.schedule!r}")
  if warmup == 0:
    return decay
  return optax.join_schedules([warm, decay], [warmup])


def _path_names(path) -> list[str]:
  """Dict keys of a param's path; attribute steps (a logical-partitioning box's
  `.value`) are skipped, so boxed and unboxed params get the same mask."""
  return [str(entry.key) for entry in path if isinstance(entry, jax.tree_util.DictKey)]


def decay_mask(params):
  """True where weight decay applies: weight matrices, not embedding tables.

  Following BERT, LayerNorm scales, biases (whatever their rank: attention biases
  are [heads, head_dim]) and embedding tables (any parameter whose path names an
  embedding) are not decayed.
  """
  def decays(path, leaf) -> bool:
    names = [name.lower() for name in _path_names(path)]
    if any("embed" in name for name in names) or "bias" in names[-1] or names[-1] == "scale":
      return False
    return getattr(leaf, "ndim", 0) >= 2
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The full optimizer: clip by global norm, then AdamW on the schedule."""
  schedule = learning_rate_schedule(train)
  parts = []
  if train.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(train.grad_clip_norm))
  parts.append(optax.adamw(schedule, b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps,
                           weight_decay=train.weight_decay, mask=decay_mask))
  return optax.chain(*parts)
