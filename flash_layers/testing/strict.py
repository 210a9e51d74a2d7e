"""The strict TPU interpreter: run Pallas TPU kernels closer to how a chip runs them.

The plain TPU interpreter walks the grid in order on one core and copies blocks when a
DMA is waited on, so a kernel may pass it and still be wrong on a chip. `params(seed)`
asks the interpreter for what a chip may do:

* two TensorCores per device (`num_cores_or_threads=2`, as on v4/v5p megacore): the
  "parallel" grid dimensions are split between two simulated cores that run as threads;
* the "parallel" dimensions walked in a random order (`random_seed`);
* DMAs executed the moment they are issued (`dma_execution_mode="eager"`), so a read of a
  buffer a DMA is still filling sees the new data at an unexpected time;
* a happens-before race detector (`detect_races=True`) over every buffer access.

The interpreter itself raises on an output block revisited after the kernel moved on.
Races it only prints and flags in a module global that the next kernel replaces;
`watch_races()` keeps every one of them. `interpreting(seed)` does both at once:

    with strict.interpreting(seed=1) as races:
      out = jax.jit(f)(x)
    assert not races, races

With two cores the interpreter compiles each kernel's per-core program once per core and
per call (jax 0.10.2); `interpreting` compiles it once per distinct program instead, which
halves a test's time and more across seeds (the order is an argument, not part of the
program). Both hooks reach into private modules of jax (run on jax 0.10.2, written against
0.11.1's source as well): when a jax lacks the race hook, `watch_races` raises rather than
report no races; without the compile hook kernels only run slower.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import jax
from jax.experimental.pallas import tpu as pltpu

from flash_layers import lowering

# Where jax keeps the TPU interpreter's race detector (its class and its per-kernel instance),
# and the function that runs one simulated core's program on its thread.
_INTERPRETER_MODULE = "jax._src.pallas.mosaic.interpret.interpret_pallas_call"
_THREAD_MAP_MODULE = "jax._src.pallas.mosaic.interpret.thread_map"

CORES = 2  # TensorCores per device, as on a v4 or v5p megacore chip


def params(seed: int, *, cores: int = CORES) -> Any:
  """The strict `pltpu.InterpretParams`: `cores` cores, "parallel" axes in an order drawn from
  `seed`, eager DMAs, the race detector on."""
  return pltpu.InterpretParams(detect_races=True, num_cores_or_threads=cores, random_seed=seed,
                               dma_execution_mode="eager")


@dataclasses.dataclass(frozen=True)
class Race:
  """One access the detector found unordered with an earlier conflicting one."""

  access: str  # "read" or "write"
  buffer: str  # the interpreter's key: (memory space, buffer id, device, core)
  where: str  # the index range accessed


class RaceLog(list):
  """The races seen inside `watch_races()`, in the order found (empty: none)."""

  def __str__(self) -> str:
    return "; ".join(f"{r.access} of {r.buffer}[{r.where}]" for r in self) or "no races"


@contextlib.contextmanager
def watch_races() -> Iterator[RaceLog]:
  """Collect every race the TPU interpreter's detector reports in this block, over all kernels.

  The interpreter's state is reset on the way out, so a kernel that raised (a revisited output
  block, an out-of-bounds read) does not leave it broken for the next one.
  """
  module = importlib.import_module(_INTERPRETER_MODULE)
  base = getattr(module, "RaceDetectionState", None)
  if base is None or not all(hasattr(base, m) for m in ("check_read", "check_write")):
    raise RuntimeError(f"this jax ({_INTERPRETER_MODULE}) has no RaceDetectionState with "
                       "check_read/check_write: the race hook needs updating")
  log = RaceLog()
  current = threading.local()  # the access being checked, per simulated core's thread

  class Recording(base):  # type: ignore[misc, valid-type]
    def __setattr__(self, name, value):
      # The detector sets races_found = True once per race it reports.
      if name == "races_found" and value:
        access = getattr(current, "access", ("access", "?", "?"))
        log.append(Race(*(str(x) for x in access)))
      super().__setattr__(name, value)

    # The accessor's arguments differ between jax versions ((device, core, clock, buffer_key, rnge)
    # in 0.10.2, (thread, clock, buffer_key, rnge) in 0.11.1): bound by name.
    def check_read(self, *args, **kwargs):
      current.access = ("read", *_buffer_and_range(base.check_read, self, args, kwargs))
      return super().check_read(*args, **kwargs)

    def check_write(self, *args, **kwargs):
      current.access = ("write", *_buffer_and_range(base.check_write, self, args, kwargs))
      return super().check_write(*args, **kwargs)

  module.RaceDetectionState = Recording
  try:
    yield log
  finally:
    module.RaceDetectionState = base
    pltpu.reset_tpu_interpret_mode_state()


def _buffer_and_range(method, instance, args, kwargs) -> tuple[Any, Any]:
  bound = inspect.signature(method).bind(instance, *args, **kwargs).arguments
  return bound.get("buffer_key", "?"), bound.get("rnge", "?")


@contextlib.contextmanager
def interpreting(seed: int, *, cores: int = CORES) -> Iterator[RaceLog]:
  """flash_pallas's TPU kernels (and any pallas_call given `params`) under the strict
  interpreter with `seed`; yields the races found, and compiles each core program once."""
  with lowering.interpret_as("tpu", params=params(seed, cores=cores)), _compile_once(), \
      watch_races() as races:
    yield races


# Compiled core programs by (program text, argument shapes): a few per kernel, kept for the
# process so that later seeds and repeated configurations reuse them.
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_MAX = 64
_COMPILE_LOCK = threading.Lock()


def _eval_program(jaxpr, consts, *args):
  jax.core.eval_jaxpr(jaxpr, consts, *args)


def _run_compiled_once(jaxpr, consts, *args):
  """thread_map's per-core runner, compiling each distinct program once.

  The key is the jaxpr's text (jax prints every primitive, parameter and shape; the objects it
  elides are callbacks' source locations, used only in messages) and the argument shapes. The
  grid order drawn from the seed arrives in `consts`, an argument: every seed shares a program.
  """
  leaves = jax.tree.leaves((consts, args))
  key = (hashlib.sha256(str(jaxpr).encode()).hexdigest(),
         tuple((jax.numpy.shape(x), str(jax.numpy.result_type(x))) for x in leaves))
  with _COMPILE_LOCK:  # the cores of one kernel ask for the same program at the same moment
    compiled = _COMPILED.get(key)
    if compiled is None:
      compiled = jax.jit(_eval_program, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
      _COMPILED[key] = compiled
      if len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    else:
      _COMPILED.move_to_end(key)
  compiled(consts, *args)


@contextlib.contextmanager
def _compile_once() -> Iterator[None]:
  module = importlib.import_module(_THREAD_MAP_MODULE)
  original = getattr(module, "_run_jaxpr", None)
  if original is None:  # a jax that runs cores differently: no reuse, only slower
    yield
    return
  module._run_jaxpr = _run_compiled_once
  try:
    yield
  finally:
    module._run_jaxpr = original
