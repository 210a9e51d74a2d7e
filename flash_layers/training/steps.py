"""The jitted train and eval steps: loss, gradient accumulation, metrics on device.

A batch holds int32 "input_ids", "segment_ids" (0 = padding), "positions" and
"labels", one slot per document of a row ([batch, docs, ...]: the task's
objectives.Objective says what a slot holds and which slots are empty; empty
slots are skipped by the loss and the metrics). The loss is the mean over real
documents of the whole global batch, so every document counts once however the
batch is split into micro-batches or shards.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from flash_layers.training.objectives import MaskedLM, Objective
from flash_layers.training.state import TrainState

# logits_fn(params, batch, *, train, rng) -> float logits [batch, docs, num_outputs]
LogitsFn = Callable[..., jax.Array]
MASKING_STREAM = 0x4D4C4D  # folded into a micro-batch's key for the objective's masks ("MLM")
EVAL_MASK_SEED = 1234


def _loss_sums(objective: Objective, logits, batch):
  """Sums over the batch (not means), so micro-batches and shards add up exactly."""
  sums = objective.loss_sums(logits, batch["labels"])
  return {**sums, "tokens": jnp.sum(batch["segment_ids"] > 0)}  # real (non-padding) tokens, for throughput


def _split_micro(batch: dict, accum: int) -> dict:
  """[B, ...] -> [accum, B/accum, ...] taking rows i, i+accum, ... into micro-batch i,
  so each device's rows are split evenly between the micro-batches (no resharding)."""
  def split(x):
    x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def make_train_step(logits_fn: LogitsFn, tx: optax.GradientTransformation, schedule: optax.Schedule, *,
                    objective: Objective, seed: int, grad_accum_steps: int = 1):
  base_key = jax.random.key(seed)

  def micro_loss(params, batch, rng):
    # The objective's view of the batch (masked-LM masks it) from its own key; dropout keeps `rng`.
    batch = objective.prepare(batch, jax.random.fold_in(rng, MASKING_STREAM))
    logits = logits_fn(params, batch, train=True, rng=rng)
    sums = _loss_sums(objective, logits, batch)
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
           "stats": sums["stats"], "grad_norm": optax.global_norm(grads),
           "learning_rate": schedule(state.step)}
    return new_state, out

  return train_step


def make_eval_step(logits_fn: LogitsFn, objective: Objective | None = None):
  """(params, batch) -> {"logits": [batch, docs, num_outputs] float32}. Metrics are computed on
  the host (training.evaluate), after a document's windows are combined. Masked LM: {"stats": ...},
  its sums on device (its logits, [batch, length, vocab], are not brought to the host), with masks
  drawn from EVAL_MASK_SEED and the batch's tokens, so every evaluation masks a batch alike."""
  if isinstance(objective, MaskedLM):
    def mlm_eval_step(params, batch: dict):
      key = jax.random.fold_in(jax.random.key(EVAL_MASK_SEED), jnp.sum(batch["input_ids"] % 65521))
      batch = objective.prepare(batch, key)
      logits = logits_fn(params, batch, train=False, rng=None)
      return {"stats": objective.loss_sums(logits, batch["labels"])["stats"]}
    return mlm_eval_step

  def eval_step(params, batch: dict):
    return {"logits": logits_fn(params, batch, train=False, rng=None).astype(jnp.float32)}
  return eval_step
