"""Benchmarks and profiling for flash_layers.

* `python -m benchmarks` — every impl x length x mask x dtype, forward and
  forward+backward: time, compiled memory, FLOPs of the visible pairs, blocks visited
  (`cases.py` says what a cell computes, `harness.py` how it is measured,
  `report.py` how it is shown). `--tpu-aot v5e` compiles for a TPU instead.
* `python -m benchmarks.e2e` — training throughput of the document encoder
  under each impl against the same model on Flax's stock attention.
* `python -m benchmarks.profile --out DIR` — a jax.profiler trace of
  attention alone and of a training step.
* `python -m benchmarks.memory --steps 600` — a long training run's resident
  memory and live device arrays, which must plateau after warm-up.
* `python -m benchmarks.tpu_aot`, `cp_aot`, `tpu_grid` — TPU memory, FLOPs and grid
  steps compiled or traced on a CPU host (libtpu, no TPU).
* `python -m benchmarks.docs_numbers --check | --write` — the numbers in README.md
  and docs/ against the files in benchmarks/results/ that they come from.
"""
