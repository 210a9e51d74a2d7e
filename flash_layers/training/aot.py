"""Pod dry run: compile the full sharded train step for TPU slices from any host with libtpu.

    python train.py --config configs/tpu_pod.py --aot_topology v5p:4x4x4 [--aot_num_slices 2]

Nothing runs and no data is read: the state and the batch are abstract (shapes,
dtypes, shardings on the slice's devices from `jax.experimental.topologies`),
and XLA's compiled-memory and cost analyses give per-chip HBM and FLOPs. Over several
slices, the compiled program's collectives give the bytes per step over DCN vs ICI.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import tempfile

import jax
import jax.numpy as jnp
import ml_collections

from flash_layers import host, models
from flash_layers.errors import UserError
from flash_layers.parallel import cost as cost_lib
from flash_layers.parallel import sharded as sharded_lib
from flash_layers.parallel.mesh import LOGICAL_RULES, make_mesh
from flash_layers.training import collectives as collectives_lib
from flash_layers.training import config as config_lib
from flash_layers.training import metrics as metrics_lib
from flash_layers.training import objectives
from flash_layers.training import optimizer as optimizer_lib
from flash_layers.training import sharding as sharding_lib
from flash_layers.training import state as state_lib
from flash_layers.training import steps as steps_lib
from flash_layers.training.distributed import setup_logging
from flash_layers.training.task import build_model, make_logits_fn

log = logging.getLogger("flash_layers.training")

GiB = 2**30


class AotTopologyError(UserError, ValueError):
  """--aot_topology names no TPU slice that libtpu can describe (or libtpu is missing)."""


def topology_devices(topology: str, num_slices: int = 1):
  """The devices of `num_slices` slices of `topology`, each with its `slice_index`."""
  from jax.experimental import topologies
  if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
    raise AotTopologyError(f"--aot_num_slices must be a positive integer; got {num_slices!r}")
  try:
    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    with host.quiet_libtpu():
      return topologies.get_topology_desc(topology, "tpu", **kwargs).devices
  except Exception as e:  # libtpu missing or an unknown name
    raise AotTopologyError(f"--aot_topology {topology!r}: cannot describe this TPU slice (needs libtpu; "
                           f"names like v5p:2x2x2, v5e:4x4, v4:2x2x2): {type(e).__name__}: {e}") from None


def hbm_per_chip(topology: str) -> int | None:
  chip = topology.split(":")[0].lower()
  return metrics_lib.HBM_BYTES.get(chip)


def _abstract_batch(config, mesh, objective, num_labels_slots: int = 1) -> dict:
  shape = (config.train.batch_size, config.model.max_len)
  example = {"input_ids": jnp.zeros(shape, jnp.int32), "segment_ids": jnp.zeros(shape, jnp.int32),
             "positions": jnp.zeros(shape, jnp.int32),
             "labels": jnp.asarray(objective.label_spec.empty(shape[0], num_labels_slots))}
  shardings = sharding_lib.batch_shardings(example, mesh, config.model.max_len)
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in example.items()}


def compile_train_step(config: ml_collections.ConfigDict, topology: str, num_slices: int = 1,
                       dump_hlo_to: str | None = None):
  """The train step compiled for `num_slices` slices of `topology`: (compiled, mesh, abstract state).

  `dump_hlo_to`: a directory where XLA also writes the optimized HLO text (`compiled_hlo` reads it
  when the compiled program cannot be printed directly)."""
  devices = topology_devices(topology, num_slices)
  config_lib.validate(config, num_devices=len(devices), num_slices=num_slices, check_data=False)
  mesh = make_mesh(**config_lib.mesh_shape(config, len(devices), num_slices), devices=devices)
  num_labels = config.model.num_labels or 2
  model, _ = build_model(config, num_labels, config.model.vocab_size or 30522)
  init = lambda: models.init_params(model, jax.random.key(config.seed), boxed=True)
  tx = optimizer_lib.make_optimizer(config.train)
  abstract, shardings = state_lib.state_shardings(init, tx, mesh, LOGICAL_RULES)
  max_docs = config.data.max_docs_per_row if config.data.packing else 1
  # The dry run reads no data: the head's outputs are named by number.
  objective = objectives.build(config.task, [str(i) for i in range(num_labels)],
                               label_smoothing=config.train.label_smoothing)
  batch = _abstract_batch(config, mesh, objective, max_docs)

  schedule = optimizer_lib.learning_rate_schedule(config.train)
  step = steps_lib.make_train_step(make_logits_fn(model), tx, schedule, objective=objective,
                                   seed=config.seed, grad_accum_steps=config.train.grad_accum_steps)
  batch_shardings = {k: v.sharding for k, v in batch.items()}
  jitted = jax.jit(step, in_shardings=(shardings, batch_shardings), out_shardings=(shardings, None),
                   donate_argnums=0)
  log.info("compiling the train step for %s x %d slice(s) (%d chips, mesh %s)...", topology, num_slices,
           len(devices), dict(mesh.shape))
  with sharding_lib.sharding_context(mesh):
    options = None if dump_hlo_to is None else {
        "xla_dump_to": dump_hlo_to, "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "train_step"}
    compiled = jitted.lower(abstract, batch).compile(compiler_options=options)
  return compiled, mesh, abstract


def compiled_hlo(compiled, dump_hlo_to: str | None = None) -> str:
  """The optimized HLO text of a compiled program. `compiled.as_text()` reads it back from the
  executable; for some TPU programs (libtpu's async collectives, seen on v5p) that read-back fails an
  XLA check ("async-update instruction should have 1 operands"), and the text XLA dumped while
  compiling (`compile_train_step(..., dump_hlo_to=)`) is the same program."""
  try:
    return compiled.as_text()
  except Exception as e:  # noqa: BLE001 -- jax's JaxRuntimeError, or XlaRuntimeError on older jax
    dumped = sorted(glob.glob(os.path.join(dump_hlo_to or "", "*train_step*.after_optimizations.txt")))
    if dump_hlo_to is None or not dumped:
      raise RuntimeError(f"cannot read the compiled program's HLO ({type(e).__name__}: {str(e)[:200]}); "
                         "compile with dump_hlo_to= a directory to read XLA's dump instead") from e
    log.info("compiled.as_text() failed (%s); reading XLA's dump %s", str(e)[:120], dumped[-1])
    with open(dumped[-1]) as f:
      return f.read()


def dry_run(config: ml_collections.ConfigDict, topology: str, num_slices: int = 1) -> dict:
  """Compile the train step for `num_slices` slices of `topology`; log and return the per-chip report."""
  setup_logging()
  with tempfile.TemporaryDirectory(prefix="flash_layers_aot_") as dump:
    compiled, mesh, abstract = compile_train_step(config, topology, num_slices, dump_hlo_to=dump)
    hlo = compiled_hlo(compiled, dump)
  report = compiled_report(config, topology, num_slices, compiled, mesh, abstract, hlo)
  print(json.dumps(report, indent=1))
  return report


def compiled_report(config: ml_collections.ConfigDict, topology: str, num_slices: int, compiled, mesh,
                    abstract, hlo: str | None = None) -> dict:
  """Per-chip memory, FLOPs and collective bytes of a compiled train step (logged on the way);
  `hlo`: its optimized HLO text (default `compiled.as_text()`)."""
  devices = mesh.devices.flatten()

  memory = compiled.memory_analysis()
  arguments = int(memory.argument_size_in_bytes)
  outputs = int(memory.output_size_in_bytes)
  aliased = int(memory.alias_size_in_bytes)
  temp = int(memory.temp_size_in_bytes)
  code = int(getattr(memory, "generated_code_size_in_bytes", 0))
  peak = arguments + outputs - aliased + temp + code
  capacity = hbm_per_chip(topology)
  flops = metrics_lib.compiled_flops(compiled)
  params = sum(x.size for x in jax.tree.leaves(abstract.params))
  traffic = collectives_lib.summary(collectives_lib.collectives(
      compiled_hlo(compiled) if hlo is None else hlo, mesh))
  report = {
    "topology": topology, "slices": num_slices, "chips": len(devices), "mesh": dict(mesh.shape),
    "dcn_mesh": {k: v for k, v in config_lib.mesh_shape(config, len(devices), num_slices).items()
                 if k.startswith("dcn_")},
    "params": int(params), "global_batch": config.train.batch_size, "max_len": config.model.max_len,
    "tokens_per_step": config.train.batch_size * config.model.max_len,
    "per_chip_bytes": {"arguments": arguments, "outputs": outputs, "aliased": aliased, "temp": temp,
                       "code": code, "peak_estimate": peak},
    "hbm_per_chip_bytes": capacity,
    "fits": None if capacity is None else bool(peak <= capacity),
    "flops_per_step_per_chip": flops,
    "flops_per_step": None if flops is None else flops * len(devices),
    # Payload bytes each chip hands to collectives per step, by network (collectives.py).
    "collective_bytes_per_step_per_chip": traffic,
    "attention": attention_report(config, mesh),
  }
  fits = "unknown (no HBM size for this chip)" if capacity is None else (
    f"{'FITS' if report['fits'] else 'DOES NOT FIT'} in {capacity / GiB:.0f} GiB")
  log.info("dry run %s: %s params, per chip: state+batch %.2f GiB, temporaries %.2f GiB, peak ~%.2f GiB "
           "-> %s; %.3g FLOPs per step per chip (%.3g in all)", topology, f"{params:,}", arguments / GiB,
           temp / GiB, peak / GiB, fits, flops or float("nan"), (flops or float("nan")) * len(devices))
  attention = report["attention"]
  log.info("attention: %s", attention["sharding"])
  if attention["strategy"] is not None:
    log.info("context parallel: %s, modelled %.1f MiB/chip/layer (%.1f MiB/chip/step over %d layers), "
             "%.1f MiB/chip of activations it holds", attention["strategy"],
             attention["modelled_bytes_per_chip_per_layer"] / 2**20,
             attention["modelled_bytes_per_chip_per_step"] / 2**20, config.model.num_layers,
             attention["modelled_memory_bytes_per_chip"] / 2**20)
  log.info("collectives per step per chip: %.3g MB over ICI, %.3g MB over DCN (%s)",
           traffic["ici_bytes_per_step_per_chip"] / 1e6, traffic["dcn_bytes_per_step_per_chip"] / 1e6,
           ", ".join(f"{k} {v / 1e6:.3g} MB" for k, v in traffic["by_axes"].items()) or "none")
  return report


def attention_report(config: ml_collections.ConfigDict, mesh) -> dict:
  """How each layer's attention splits over the mesh: the plan (strategy, group, why) that
  `fl.attention` makes for the model's call, and the cost model's bytes and memory for it
  (parallel/cost.py: communication per chip, forward + backward; per step: x layers x micro-steps)."""
  m = config.model
  micro_batch = config.train.batch_size // max(config.train.grad_accum_steps, 1)
  heads = m.num_heads
  request = cost_lib.make_request(micro_batch, m.max_len, heads, heads, m.hidden_size // heads,
                                  causal=False, dtype=m.dtype)
  plan = sharded_lib.make_plan(request, mesh, strategy=m.context_parallel)
  out = {"impl": m.impl, "context_parallel": m.context_parallel, "sharding": plan.describe(request),
         "strategy": plan.strategy, "group": plan.group if plan.strategy == "ulysses_ring" else None,
         "reason": plan.reason}
  if plan.strategy is None:
    return out
  generation = cost_lib.generation_of(mesh.devices.flat[0].device_kind)
  c = cost_lib.strategy_cost(plan.strategy, plan.block, plan.sequence, plan.group, generation)
  steps = m.num_layers * max(config.train.grad_accum_steps, 1)
  return {**out, "generation": generation, "modelled_bytes_per_chip_per_layer": c.bytes,
          "modelled_bytes_per_chip_per_step": c.bytes * steps, "modelled_seconds_per_layer": c.seconds,
          "modelled_memory_bytes_per_chip": c.memory_bytes}
