"""Meshes and batches for the training job: process-local numpy rows -> global sharded arrays."""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding

from flash_layers import lowering
from flash_layers.parallel.mesh import LOGICAL_RULES, make_mesh, slice_count
from flash_layers.training import config as config_lib


def batch_shardings(batch: dict, mesh: Mesh, seq_len: int) -> dict:
  """Rows over (data, fsdp); the token axis over sequence for [batch, seq_len] arrays."""
  def spec(x):
    names = ("batch", "length") if x.ndim >= 2 and x.shape[1] == seq_len else ("batch",)
    names = names + (None,) * (x.ndim - len(names))
    return NamedSharding(mesh, nn.logical_to_mesh_axes(names, LOGICAL_RULES))
  return {k: spec(np.asarray(v)) for k, v in batch.items()}


def to_global(batch: dict, shardings: dict) -> dict:
  """Each process contributes its rows; the result is one array over all processes."""
  out = {}
  for key, value in batch.items():
    value = np.asarray(value)
    global_shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
    out[key] = jax.make_array_from_process_local_data(shardings[key], value, global_shape)
  return out


@contextlib.contextmanager
def sharding_context(mesh: Mesh):
  """The mesh (for attention's shard_map and the activation constraints) and the logical
  rules the model's annotations resolve against. Entered outside jit: jax.set_mesh
  cannot be entered while tracing. What is traced inside is lowered for the mesh's platform
  only (lowering.lowered_only_for: attention traces no other platform's kernels)."""
  platforms = {lowering.platform_of(d) for d in mesh.devices.flat}
  with contextlib.ExitStack() as stack:
    stack.enter_context(jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else mesh)
    stack.enter_context(nn.logical_axis_rules(LOGICAL_RULES))
    stack.enter_context(lowering.lowered_only_for(platforms.pop() if len(platforms) == 1 else None))
    yield


def mesh_from_config(config: ml_collections.ConfigDict, devices=None) -> Mesh:
  """The job's mesh; on several slices (devices' slice_index) a hybrid ICI x DCN mesh."""
  devices = jax.devices() if devices is None else devices
  sizes = config_lib.mesh_shape(config, len(devices), slice_count(devices))
  return make_mesh(**sizes, devices=devices)
