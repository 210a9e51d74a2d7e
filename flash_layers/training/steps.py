"""The jitted train and eval steps: loss, gradient accumulation, metrics on device.

A batch holds int32 "input_ids", "segment_ids" (0 = padding), "positions" and
"labels". Labels are per row ([batch]) or, when several documents are packed
into a row, per document slot ([batch, docs]); a label < 0 marks a padding row
or an empty slot, which the loss and the metrics skip. The loss is the mean
over real documents of the whole global batch, so every document counts once
however the batch is split into micro-batches or shards.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from flash_layers.training import metrics as metrics_lib
from flash_layers.training.state import TrainState

# logits_fn(params, batch, *, train, rng) -> float logits [*labels.shape, num_labels]
LogitsFn = Callable[..., jax.Array]


def _loss_sums(logits, labels, segment_ids, num_labels: int, label_smoothing: float):
  """Sums over the batch (not means), so micro-batches and shards add up exactly."""
  weights = (labels >= 0).astype(jnp.float32)
  safe = jnp.maximum(labels, 0)
  targets = optax.smooth_labels(jax.nn.one_hot(safe, num_labels), label_smoothing) if label_smoothing \
      else jax.nn.one_hot(safe, num_labels)
  losses = optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)
  predictions = jnp.argmax(logits, axis=-1)
  return {
    "loss_sum": jnp.sum(losses * weights),
    "count": jnp.sum(weights),
    "tokens": jnp.sum(segment_ids > 0),  # real (non-padding) tokens, for throughput
    "confusion": metrics_lib.confusion_matrix(predictions, labels, weights, num_labels),
  }


def _split_micro(batch: dict, accum: int) -> dict:
  """[B, ...] -> [accum, B/accum, ...] taking rows i, i+accum, ... into micro-batch i,
  so each device's rows are split evenly between the micro-batches (no resharding)."""
  def split(x):
    x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def make_train_step(logits_fn: LogitsFn, tx: optax.GradientTransformation, schedule: optax.Schedule, *,
                    num_labels: int, seed: int, grad_accum_steps: int = 1, label_smoothing: float = 0.0):
  base_key = jax.random.key(seed)

  def micro_loss(params, batch, rng):
    logits = logits_fn(params, batch, train=True, rng=rng)
    sums = _loss_sums(logits, batch["labels"], batch["segment_ids"], num_labels, label_smoothing)
    return sums["loss_sum"], sums

  grad_fn = jax.grad(micro_loss, has_aux=True)

  def train_step(state: TrainState, batch: dict):
    # Dropout keys depend only on (seed, step, micro-batch): a resumed run draws the same ones.
    step_key = jax.random.fold_in(base_key, state.step)
    if grad_accum_steps == 1:
      grads, sums = grad_fn(state.params, batch, jax.random.fold_in(step_key, 0))
    else:
      micro = _split_micro(batch, grad_accum_steps)

      def body(carry, xs):
        index, micro_batch = xs
        grads, sums = grad_fn(state.params, micro_batch, jax.random.fold_in(step_key, index))
        return jax.tree.map(jnp.add, carry, (grads, sums)), None

      zero_grads = jax.tree.map(jnp.zeros_like, state.params)
      zero_sums = jax.eval_shape(lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micro),
                                                 step_key)[1])
      zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_sums)
      (grads, sums), _ = jax.lax.scan(body, (zero_grads, zero_sums),
                                      (jnp.arange(grad_accum_steps), micro))
    count = jnp.maximum(sums["count"], 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    out = {"loss": sums["loss_sum"] / count, "count": sums["count"], "tokens": sums["tokens"],
           "confusion": sums["confusion"], "grad_norm": optax.global_norm(grads),
           "learning_rate": schedule(state.step)}
    return new_state, out

  return train_step


def make_eval_step(logits_fn: LogitsFn):
  """(params, batch) -> {"logits": [*labels.shape, num_labels] float32}. Metrics are computed on
  the host (training.evaluate), after a document's windows are combined."""
  def eval_step(params, batch: dict):
    return {"logits": logits_fn(params, batch, train=False, rng=None).astype(jnp.float32)}
  return eval_step
