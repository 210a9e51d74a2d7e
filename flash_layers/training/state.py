"""The train state, created directly sharded on the mesh.

Parameter shardings come from the logical axis names the model attaches to its
params (`nn.with_logical_partitioning`), mapped to mesh axes by the logical
rules; the optimizer state inherits them leaf by leaf. The state is created by a
jitted function whose `out_shardings` are those shardings, so every device only
ever holds its own shards -- there is never a full copy on one device.
Pretrained weights are read on the host and placed shard by shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates done
  params: Any
  opt_state: Any


def _new_state(params, tx: optax.GradientTransformation) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def state_shardings(init_params: Callable[[], Any], tx: optax.GradientTransformation, mesh: Mesh,
                    rules) -> tuple[TrainState, TrainState]:
  """(abstract state, shardings) for a state whose params `init_params()` returns boxed.

  `init_params` is traced only (jax.eval_shape): nothing is allocated.
  """
  return _abstract(jax.eval_shape(lambda: _new_state(init_params(), tx)), mesh, rules)


def params_shardings(init_params: Callable[[], Any], mesh: Mesh, rules) -> tuple[Any, Any]:
  """(abstract params, shardings): what restoring params alone (for evaluation) needs."""
  return _abstract(jax.eval_shape(init_params), mesh, rules)


def _abstract(boxed, mesh: Mesh, rules):
  specs = nn.get_partition_spec(boxed)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  # Leaves without logical names (step, Adam's count) come back as bare PartitionSpecs.
  shardings = jax.tree.map(
    lambda s: s if isinstance(s, NamedSharding) else NamedSharding(mesh, PartitionSpec()),
    shardings, is_leaf=lambda s: isinstance(s, (NamedSharding, PartitionSpec)))
  abstract = nn.meta.unbox(boxed)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return abstract, shardings


def create_state(init_params: Callable[[], Any], tx: optax.GradientTransformation, shardings: TrainState,
                 pretrained_params: Any | None = None) -> TrainState:
  """The initial state, sharded. With `pretrained_params` (host arrays of the same tree as
  the model's params), those replace the freshly initialised values."""
  if pretrained_params is None:
    make = jax.jit(lambda: _new_state(nn.meta.unbox(init_params()), tx), out_shardings=shardings)
    return make()
  params = jax.device_put(pretrained_params, shardings.params)
  make = jax.jit(lambda p: _new_state(p, tx), in_shardings=(shardings.params,), out_shardings=shardings)
  return make(params)


def check_params_match(pretrained_params, abstract_params):
  """ValueError naming the first parameter whose shape differs from the model's."""
  flat_expected = dict(jax.tree_util.tree_flatten_with_path(abstract_params)[0])
  flat_given = dict(jax.tree_util.tree_flatten_with_path(pretrained_params)[0])
  missing = set(flat_expected) - set(flat_given)
  extra = set(flat_given) - set(flat_expected)
  if missing or extra:
    name = lambda p: jax.tree_util.keystr(p)
    raise ValueError(f"pretrained params differ from the model's: missing {sorted(map(name, missing))[:5]}, "
                     f"unexpected {sorted(map(name, extra))[:5]}")
  for path, expected in flat_expected.items():
    given = flat_given[path]
    if tuple(given.shape) != tuple(expected.shape):
      raise ValueError(f"pretrained param {jax.tree_util.keystr(path)} has shape {tuple(given.shape)}; "
                       f"the model expects {tuple(expected.shape)}")
