"""`python -m benchmarks.docs_numbers [--check | --write]`: the docs' numbers, read from results files.

README.md and docs/*.md wrap every number that a results file holds in a marker:

    xla_chunked needs <!--n:chunked.mem_32k-->224.5<!--/n--> MiB at 32k tokens

`REGISTRY` says where each key's number lives: a file under benchmarks/results/, a path into its JSON
and a format. `--write` rewrites every marked value from its file; `--check` (the default) lists each
marker whose text differs from the file, each unknown key and each registry key no page uses, and exits
1 if there is any. `tests/test_docs_numbers.py` runs the check, and also fails when a headline number of
the README is written without a marker (`unmarked_headline_numbers` says which numbers those are).

A path is dot-separated steps into the JSON: a dict key (`memory_bytes.total`), a list index (`[0]`),
or a row selector `[field=value,...]`, the one element of a list whose fields equal those values (a
list-valued field is written joined by "x": `shape=8x512x12x64`; `a/b=value` reads a nested field).
A value is a path, or `(op, path, path, ...)` with op "/" (the first over the second), "min" or "max".
The format is a `format()` spec applied to the value times `scale`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB, GIB = 2.0**-20, 2.0**-30
_PAGED_TPU = "paged-tpu-aot-2026-12-06.json"

MARKER = re.compile(r"<!--n:([\w.@+:-]+)-->(.*?)<!--/n-->")
OPS = ("/", "min", "max")


@dataclasses.dataclass(frozen=True)
class Number:
  """One documented number: `format(value(file, path) * scale, fmt)`."""
  file: str                       # under benchmarks/results/
  value: str | tuple              # a path, or (op, path, ...) with op in OPS
  fmt: str = ".2f"
  scale: float = 1.0


def _rows(name: str, paths: Iterable[str], op: str = "max", fmt: str = ".2f") -> Number:
  return Number(name, (op, *paths), fmt)


# ---------------------------------------------------------------------------------------------
# The registry: every marked number in README.md and docs/*.md.

_CPU = "cpu-2026-11-30.json"
_CPU_CELL = "[impl={impl},seq_len={n},mask=full,dtype=float32,pass=fwd+bwd,target=cpu].temp_bytes"
_AOT = "tpu-aot-32k-causal-2026-12-03.json"
_RING = "ring-aot-v5p-32k-causal-2026-12-03.json"
_GRID = "tpu-grid-v5e-32k-2026-12-03.json"
_GQA = "tpu-aot-gqa-8k-2026-12-03.json"
_SPLASH = "tpu-aot-splash-v5e-2026-12-01.json"
_SPLASH_BEFORE_LAYOUT = "tpu-aot-splash-v5e-2026-12-01-before-layout.json"
_SPLASH_BEFORE_ALIAS = "tpu-aot-splash-v5e-2026-12-01-before-dq-alias.json"
_SPLASH_CELL = "[impl={impl},shape/mask=causal,shape/seq_len={n}].memory_bytes.temp"
_DENSE = "cpu-dense-2026-12-01.json"
_LOOP = "cpu-attention-loop-2026-12-01.json"
_E2E = "e2e-cpu-2026-11-30.json"
_E2E_512 = "e2e-cpu-512-2026-12-01.json"
_EVAL_1, _EVAL_6 = "eval-cost-cpu-2026-12-01-looped.json", "eval-cost-cpu-2026-12-01-looped-6layers.json"
_EVAL_E2E = "eval-cost-e2e-cpu-2026-12-04.json"
_EVAL_PROFILE = "eval-profile-cpu-2026-12-03.json"
_MEMORY = "memory-cpu-2026-12-01.json"
_DECODE_AOT = "decode-aot-2026-12-04.json"
_QUICK = "quickstart-cpu-2026-12-04.json"
_HF_EXPORT = "hf-export-check-2026-12-04.json"
_V5P_262K = "tpu-aot-v5p-262k-causal-packed-2026-12-03.json"
_RING_1M = "ring-aot-v5p-2x2x2-1m-causal-2026-12-03.json"
_GENERATIONS = ("v4", "v5e", "v5p", "v6e")

REGISTRY: dict[str, Number] = {
    # README: the quickstart (README command 1, run as written).
    "quickstart.accuracy": Number(_QUICK, "accuracy", ".1f", 100),
    "quickstart.correct": Number(_QUICK, "n_correct", "d"),
    "quickstart.total": Number(_QUICK, "n_total", "d"),
    "quickstart.macro_f1": Number(_QUICK, "macro_f1", ".3f"),
    "quickstart.wall_min": Number(_QUICK, "wall_s", ".1f", 1 / 60),
    "quickstart.cpu_min": Number(_QUICK, "cpu_s", ".1f", 1 / 60),
    "quickstart.date": Number(_QUICK, "date", "s"),
    "quickstart.load_before": Number(_QUICK, "load_average_before.[0]", ".1f"),
    **{f"quickstart.{stage}.{what}": Number(_QUICK, f"stages.{stage}.{what}", ".0f")
       for stage in ("install", "train", "eval") for what in ("wall_s", "cpu_s")},
    # docs/models_and_data.md: the quickstart's export loaded by transformers (benchmarks/hf_export_check.py).
    "quickstart_mean.accuracy": Number("quickstart-cpu-2026-12-02.json", "accuracy", ".1f", 100),
    "hf_export.max_diff": Number(_HF_EXPORT, "max_abs_logit_diff", ".1e"),
    "hf_export.documents": Number(_HF_EXPORT, "documents", "d"),
    "hf_export.agree": Number(_HF_EXPORT, "predictions_agree", "d"),
    "hf_export.accuracy": Number(_HF_EXPORT, "accuracy_transformers", ".1f", 100),
    "hf_export.transformers": Number(_HF_EXPORT, "versions.transformers", "s"),
    "hf_export.torch": Number(_HF_EXPORT, "versions.torch", "s"),
    "hf_export.date": Number(_HF_EXPORT, "date", "s"),
    # xla_chunked's compiled memory on the CPU, forward+backward, float32.
    "chunked.mem_32k": Number(_CPU, _CPU_CELL.format(impl="xla_chunked", n=32768), ".1f", MIB),
    "chunked.ref_mem_32k_gib": Number(_CPU, _CPU_CELL.format(impl="reference", n=32768), ".0f", GIB),
    "chunked.below_ref_32k": Number(_CPU, ("/", _CPU_CELL.format(impl="reference", n=32768),
                                           _CPU_CELL.format(impl="xla_chunked", n=32768)), ".0f"),
    "chunked.per_doubling": Number(_CPU, ("/", _CPU_CELL.format(impl="xla_chunked", n=32768),
                                          _CPU_CELL.format(impl="xla_chunked", n=16384)), ".2f"),
    # flash_pallas forward+backward, 32k tokens causal, 12 heads x 64, bf16: one chip per generation.
    **{f"aot32k.{g}.{part}_mib": Number(_AOT, f"rows.[generation={g}].memory_bytes.{part}", ",.1f", MIB)
       for g in _GENERATIONS for part in ("total", "argument", "output", "temp", "generated_code")},
    **{f"aot32k.{g}.{flops}": Number(_AOT, f"rows.[generation={g}].{flops}", ".4g")
       for g in _GENERATIONS for flops in ("flops_compiled", "flops_analytic")},
    "aot32k.date": Number(_AOT, "date", "s"),
    "aot32k.jax": Number(_AOT, "jax", "s"),
    "aot32k.libtpu": Number(_AOT, "libtpu", "s"),
    # Grid steps over the tiles that hold a visible pair, v5e's tiles, 32k tokens.
    **{f"grid.{mask}.{kernel}_over_visible": Number(
        _GRID, ("/", f"rows.[mask={mask}].{kernel}.steps", f"rows.[mask={mask}].{kernel}.visible"), ".2f")
       for mask in ("causal", "window", "packed", "padded") for kernel in ("fwd",)},
    **{f"grid.{mask}.{kernel}_{what}": Number(_GRID, f"rows.[mask={mask}].{kernel}.{what}", ",d")
       for mask in ("causal", "window", "packed", "padded") for kernel in ("fwd", "dkv", "dq")
       for what in ("steps", "visible")},
    **{f"grid.{mask}.full_grid_over_visible": Number(
        _GRID, ("/", f"rows.[mask={mask}].fwd.full_grid", f"rows.[mask={mask}].fwd.visible"), ".0f")
       for mask in ("window", "packed", "padded")},
    "grid.causal.full_grid_over_visible": Number(
        _GRID, ("/", "rows.[mask=causal].fwd.full_grid", "rows.[mask=causal].fwd.visible"), ".2f"),
    "grid.full_grid": Number(_GRID, "rows.[mask=causal].fwd.full_grid", ",d"),
    "grid.tiles": Number(_GRID, "block_sizes", "s"),
    "grid.date": Number(_GRID, "date", "s"),
    # GQA, 8 query heads on 2 kv heads x 128, 8k tokens: the kernels' CostEstimate of HBM bytes.
    "gqa.fwd_mib": Number(_GQA, "rows.[generation=v5e].kernel_bytes_accessed.flash_layers_fwd", ".1f", MIB),
    "gqa.dq_mib": Number(_GQA, "rows.[generation=v5e].kernel_bytes_accessed.flash_layers_bwd_dq", ".1f", MIB),
    "gqa.date": Number(_GQA, "date", "s"),
    **{f"gqa.{g}.{kernel}_mb": Number(
        _GQA, f"rows.[generation={g}].kernel_bytes_accessed.flash_layers_{kernel}", ".1f", 1e-6)
       for g in ("v5e", "v6e") for kernel in ("fwd", "bwd_dq")},
    **{f"gqa.v5e.{part}_mib": Number(_GQA, f"rows.[generation=v5e].memory_bytes.{part}", ".0f", MIB)
       for part in ("argument", "output", "temp")},
    # flash_pallas vs jax_splash compiled temporaries, v5e, [1, T, 8, 128] bf16, causal.
    **{f"splash.{impl}.{n}_mib": Number(_SPLASH, _SPLASH_CELL.format(impl=impl, n=n), fmt, MIB)
       for impl in ("flash_pallas", "jax_splash") for n, fmt in ((8192, ".1f"), (32768, ".0f"))},
    # The longest sequences compiled.
    "long.v5p_tokens": Number(_V5P_262K, "shape.seq_len", ",d"),
    "long.ring_tokens": Number(_RING_1M, "shape.seq_len", ",d"),
    "long.date": Number(_RING_1M, "date", "s"),
    "long.v5p_args_mib": Number(_V5P_262K, "memory_bytes.argument", ".0f", MIB),
    "long.v5p_outs_mib": Number(_V5P_262K, "memory_bytes.output", ".0f", MIB),
    "long.v5p_temp_mib": Number(_V5P_262K, "memory_bytes.temp", ".0f", MIB),
    "long.ring_args_mib": Number(_RING_1M, "per_chip_bytes.arguments", ".0f", MIB),
    "long.ring_outs_mib": Number(_RING_1M, "per_chip_bytes.outputs", ".0f", MIB),
    "long.ring_temp_mib": Number(_RING_1M, "per_chip_bytes.temporaries", ",.0f", MIB),
    "long.ring_permutes": Number(_RING_1M, "collectives.collective-permute", "d"),
    "long.ring_kernels": Number(_RING_1M, "mosaic_kernels", "d"),
    # Attention fwd+bwd at 512 tokens on the CPU: flax's CPU time over xla_dense's.
    "dense512.min": _rows(_DENSE, [f"rows.[variant=xla_dense,shape={s},mask={m}].flax_cpu_over_ours"
                                   for s in ("4x512x12x32", "8x512x12x64") for m in ("none", "segments")],
                          "min"),
    "dense512.max": _rows(_DENSE, [f"rows.[variant=xla_dense,shape={s},mask={m}].flax_cpu_over_ours"
                                   for s in ("4x512x12x32", "8x512x12x64") for m in ("none", "segments")]),
    # Encoder training, CPU time per step, flax over auto.
    "e2e512.min": _rows(_E2E_512, [f"[run={r},variant=auto].cpu_speedup_vs_flax" for r in (1, 2, 3)], "min"),
    "e2e512.max": _rows(_E2E_512, [f"[run={r},variant=auto].cpu_speedup_vs_flax" for r in (1, 2, 3)]),
    "e2e2048.speedup": Number(_E2E, "[variant=auto,seq_len=2048].speedup_vs_flax", ".2f"),
    "e2e2048.memory": Number(_E2E, "[variant=auto,seq_len=2048].memory_ratio_flax_over_ours", ".1f"),
    "e2e8192.flax_gib": Number(_E2E, "[variant=flax,seq_len=8192].compiled_peak_bytes", ".1f", GIB),
    "e2e8192.auto_gib": Number(_E2E, "[variant=auto,seq_len=8192].compiled_peak_bytes", ".1f", GIB),
    # Ring attention, v5p, 32k tokens, 8 heads x 128: temporaries per chip.
    **{f"ring32k.{t}.{what}": Number(_RING, f"rows.[topology=v5p:{t}].{path}", fmt, scale)
       for t in ("2x2x1", "2x2x2", "2x4x2")
       for what, path, fmt, scale in (("temp_mib", "per_chip_bytes.temporaries", ".0f", MIB),
                                      ("temp_mib_1", "per_chip_bytes.temporaries", ".1f", MIB),
                                      ("args_mib", "per_chip_bytes.arguments", ".1f", MIB),
                                      ("permutes", "collectives.collective-permute", "d", 1.0),
                                      ("gathers", "collectives.all-gather", "d", 1.0),
                                      ("chips", "chips", "d", 1.0))},
    "ring32k.date": Number(_RING, "date", "s"),
    # Evaluating BBC News's test split at 4,096 vs 512 tokens.
    "evalcost.1layer": Number(_EVAL_1, "summary.ratio_eval_cpu", ".2f"),
    "evalcost.6layers": Number(_EVAL_6, "summary.ratio_eval_cpu", ".2f"),
    "evalcost.1layer.layers": Number(_EVAL_1, "cases.[0].num_layers", "d"),
    "evalcost.6layers.layers": Number(_EVAL_6, "cases.[0].num_layers", "d"),
    "evalcost.before.ratio": Number("eval-cost-cpu-2026-12-01-before.json", "summary.ratio_eval_cpu", ".2f"),
    "evalcost.tokens": Number(_EVAL_1, "summary.ratio_real_tokens", ".2f"),
    # eval.py end to end, cold and warm compilation cache (benchmarks.eval_cost --e2e).
    "evalcost.e2e.cold": Number(_EVAL_E2E, "summary.ratio_cpu_cold", ".2f"),
    "evalcost.e2e.warm": Number(_EVAL_E2E, "summary.ratio_cpu_warm", ".2f"),
    "evalcost.e2e.date": Number(_EVAL_E2E, "date", "s"),
    # One decoding step on the CPU (benchmarks/decode_cpu.py): MHA like flax's, and a GQA layer.
    # `fill` = half (the default) or full cache; "prev" = before xla_dense's chunked decoding forward.
    **{f"decode.{kind}{fill}{n}.{what}":
       Number(f"decode-cpu{suffix}{fsuffix}-2026-12-04.json", f"rows.[cache_len={n}].{path}", fmt)
       for kind, suffix in (("", ""), ("gqa.", "-gqa4"))
       for fill, fsuffix in (("", "-half"), ("full.", "-full"))
       for n in (2048, 8192)
       for what, path, fmt in (("ratio_cpu", "ratio_cpu", ".2f"), ("ours_ms", "flash_layers.cpu_ms", ".1f"),
                               ("flax_ms", "flax.cpu_ms", ".1f"))},
    **{f"decode.prev.{n}.ratio_cpu":
       Number("decode-cpu-2026-12-04.json", f"rows.[cache_len={n}].ratio_cpu", ".2f") for n in (2048, 8192)},
    # The forward kernel's executed grid points for mask_mods at 32k (benchmarks/tpu_grid.py --mods).
    **{f"gridmods.{name}.{what}": Number("tpu-grid-mods-v5e-32k-2026-12-04.json",
                                         f"rows.[mask_mod={name}].{what}", ",d")
       for name in ("prefix_lm", "chunked_causal") for what in ("executed_points", "visible_tiles")},
    # Paged decoding on the CPU (benchmarks/paged_cpu.py) and continuous batching (benchmarks/serving_cpu.py).
    **{f"paged.cpu.{case}.{what}": Number("paged-cpu-2026-12-06.json", f"cases.{case}.{path}", fmt, scale)
       for case in ("contiguous", "paged", "paged_int8")
       for what, path, fmt, scale in (("wall_ms", "wall_ms", ".1f", 1.0),
                                      ("wall_ratio", "wall_vs_contiguous", ".2f", 1.0),
                                      ("bytes_ratio", "bytes_vs_contiguous", ".2f", 1.0),
                                      ("cache_mib", "cache_bytes", ".1f", MIB))},
    "paged.cpu.pages_in_use": Number("paged-cpu-2026-12-06.json", "pages_in_use", "d"),
    "paged.cpu.date": Number("paged-cpu-2026-12-06.json", "date", "s"),
    **{f"serving.{case}.{what}": Number("serving-cpu-2026-12-06.json", f"rows.{case}.{path}", fmt, scale)
       for case in ("static_contiguous", "continuous_paged", "continuous_paged_int8")
       for what, path, fmt, scale in (("tokens_per_s", "tokens_per_s", ".0f", 1.0),
                                      ("tps_ratio", "tokens_per_s_vs_static", ".2f", 1.0),
                                      ("bytes_ratio", "cache_bytes_vs_static", ".2f", 1.0),
                                      ("cache_mib", "cache_bytes", ".2f", MIB))},
    **{f"serving.continuous_paged.{what}":
       Number("serving-cpu-2026-12-06.json", f"rows.continuous_paged.{what}", "d")
       for what in ("peak_pages_in_use", "peak_pages_bound", "peak_tokens_held", "peak_sequences", "steps",
                    "pool_pages")},
    "serving.static_contiguous.computed_tokens": Number("serving-cpu-2026-12-06.json",
                                                        "rows.static_contiguous.computed_tokens", "d"),
    "serving.generated": Number("serving-cpu-2026-12-06.json", "rows.static_contiguous.generated", "d"),
    "serving.date": Number("serving-cpu-2026-12-06.json", "date", "s"),
    # The paged TPU kernel beside jax's ragged_paged_attention, AOT (benchmarks/paged_tpu.py).
    **{f"paged.tpu.{gen}.{kernel}.{case}.{what}":
       Number(_PAGED_TPU, f"rows.[generation={gen},kernel={kernel},config={config},case={case}].{path}", fmt,
              scale)
       for gen in ("v5e", "v6e") for kernel, config in (("ours", "-"), ("jax", "kv4"))
       for case in ("bf16", "int8", "bf16_window4096")
       for what, path, fmt, scale in (("gib", "kv_bytes_streamed", ".2f", GIB),
                                      ("temp_mib", "temp_bytes", ".2f", MIB))},
    **{f"paged.tpu.v5e.ours.{case}.{what}":
       Number(_PAGED_TPU, f"rows.[generation=v5e,kernel=ours,case={case}].{what}", ",d")
       for case in ("bf16", "bf16_window4096") for what in ("grid_points", "static_grid_bound")},
    "paged.tpu.recorder.recorded": Number(_PAGED_TPU, "recorder_scaled_down.ours.recorded_grid_points", "d"),
    "paged.tpu.recorder.counted": Number(_PAGED_TPU, "recorder_scaled_down.ours.counted_grid_points", "d"),
    # One decoding step compiled for TPUs (benchmarks/decode_aot.py): temporaries by cache layout.
    "decode.aot.cache_mib": Number(_DECODE_AOT, "problem.one_cache_tensor_mib", ".1f"),
    **{f"decode.aot.{gen}.{layout}_temp_mib":
       Number(_DECODE_AOT, f"tpu.[generation={gen},layout={layout}].temp_mib", ".1f")
       for gen in ("v4", "v5e", "v5p", "v6e") for layout in ("flax", "heads_first")},
    **{f"decode.layer.{gen}.{layout}_temp_mib":
       Number(_DECODE_AOT, f"layer.[generation={gen},layout={layout}].temp_mib", ".1f")
       for gen in ("v5e",) for layout in ("flax", "heads_first")},
    "evalcost.e2e.prev.warm": Number("eval-cost-e2e-cpu-2026-12-03.json", "summary.ratio_cpu_warm", ".2f"),
    **{f"evalcost.e2e.{kind}.round{i}": Number(_EVAL_E2E, f"summary.ratio_cpu_{kind}_rounds.[{i}]", ".2f")
       for kind in ("cold", "warm") for i in range(5)},
    **{f"evalcost.e2e.{n}.{cache}": Number(_EVAL_E2E, f"cases.[max_len={n},cache={cache}].cpu_s", ".1f")
       for n in (512, 4096) for cache in ("cold", "warm")},
    **{f"evalcost.e2e.{n}.warm.round{i}":
       Number(_EVAL_E2E, f"cases.[max_len={n},cache=warm].runs.[{i}].cpu_s", ".1f")
       for n in (512, 4096) for i in range(5)},
    # cProfile of one warm eval.py run per length (exploratory).
    **{f"evalprof.{n}.{what}": Number(_EVAL_PROFILE, f"cases.[max_len={n}].{what}", ".1f")
       for n in (512, 4096) for what in ("wait_s", "trace_s")},
    # One eval step traced before and after lowering.lowered_only_for (exploratory).
    **{f"evaltrace.{when}.{what}": Number("eval-trace-cpu-2026-12-03.json", f"{when}.{what}_cpu_s", fmt)
       for when, what, fmt in (("before", "trace", ".1f"), ("before", "lower", ".1f"),
                               ("after", "trace", ".1f"), ("after", "lower", ".2f"))},
    # Attention forward on the CPU, looped over rows and kv heads: flax's CPU time over ours.
    "cpuloop.fwd_min": _rows(_LOOP, [f"rows.[variant={v},shape={s},pass=fwd].flax_cpu_over_ours"
                                     for v in ("xla_dense", "xla_chunked")
                                     for s in ("16x128x12x32", "4x512x12x32", "8x512x12x64",
                                               "4x1024x12x32", "1x2048x12x64")], "min", ".1f"),
    "cpuloop.fwd_max": _rows(_LOOP, [f"rows.[variant={v},shape={s},pass=fwd].flax_cpu_over_ours"
                                     for v in ("xla_dense", "xla_chunked")
                                     for s in ("16x128x12x32", "4x512x12x32", "8x512x12x64",
                                               "4x1024x12x32", "1x2048x12x64")], "max", ".1f"),
    "cpuloop.dense_whole_ms": Number(
        _LOOP, "rows.[variant=xla_dense@whole,shape=8x512x12x64,pass=fwd].cpu_ms", ".0f"),
    "cpuloop.dense_ms": Number(_LOOP, "rows.[variant=xla_dense,shape=8x512x12x64,pass=fwd].cpu_ms", ".0f"),
    # Memory over a 600-step training run.
    "memory.rss_growth_pct": Number(_MEMORY, "plateau.rss_growth", ".1f", 100),
    "memory.head_pct": Number(_MEMORY, ("/", "plateau.head_steps.[0]", "steps"), ".0f", 100),
}

# docs/benchmarks.md's tables and the prose around them: the cells each one shows.
_CPU_TIME = {  # mask -> impl -> lengths measured (forward+backward, float32, CPU ms)
    "causal": {"flash_pallas": (512, 1024, 2048), "xla_native": (512, 1024, 2048, 4096),
               "xla_chunked": (512, 1024, 2048, 4096, 8192), "reference": (512, 1024, 2048, 4096)},
    "packed": {"flash_pallas": (512, 1024, 2048), "xla_native": (512, 1024, 2048, 4096),
               "xla_chunked": (512, 1024, 2048, 4096, 8192, 16384), "reference": (512, 1024, 2048, 4096)},
}
_CPU_PROSE = [  # (mask, impl, length, dtype, pass) quoted in the prose around the CPU tables
    *(("window", "xla_chunked", n, "float32", "fwd+bwd")
      for n in (512, 1024, 2048, 4096, 8192, 16384, 32768)),
    *(("window", "xla_native", n, "float32", "fwd+bwd") for n in (512, 1024, 2048, 4096)),
    *(("full", "xla_chunked", n, "float32", "fwd+bwd") for n in (512, 1024, 2048, 4096, 8192)),
    *(("full", "xla_native", n, "float32", "fwd+bwd") for n in (512, 1024, 2048, 4096)),
    *(("full", impl, 2048, "bfloat16", "fwd+bwd") for impl in ("flash_pallas", "xla_chunked", "xla_native",
                                                                "reference")),
    *(("full", impl, 8192, "float32", "fwd") for impl in ("xla_chunked", "xla_native", "reference")),
    ("packed", "xla_chunked", 32768, "float32", "fwd"), ("window", "xla_chunked", 32768, "float32", "fwd"),
]
_CPU_MEM = {"flash_pallas": (512, 1024, 2048), **{impl: (512, 1024, 2048, 4096, 8192, 16384, 32768)
                                                  for impl in ("xla_native", "xla_chunked", "reference")}}
_CPU_ROW = "[impl={impl},seq_len={n},mask={mask},dtype=float32,pass=fwd+bwd,target=cpu]"
_LOOP_SHAPES = ("16x128x12x32", "4x512x12x32", "8x512x12x64", "4x1024x12x32", "1x2048x12x64")
_LOOP_ROW = "rows.[variant={v},shape={s},pass={p}]"
_DENSE_ROW = "rows.[variant={v},shape={s},mask={m}]"
_CROSSOVER = "cpu-dense-crossover-2026-12-01.json"
_CROSSOVER_CELLS = [(s, m, v) for s in ("8x768x12x64", "4x1024x12x32") for m in ("none", "segments")
                    for v in ("flax", "xla_dense", "xla_chunked")] + [
                    (s, m, v) for s in ("1x1024x12x64", "1x2048x12x64")
                    for m in ("none", "segments", "causal") for v in ("xla_dense", "xla_chunked")]
_E2E_CELLS = [("flax", 512), ("auto", 512), ("flax", 2048), ("auto", 2048)]
_TPU = "tpu-aot-v5e-2026-12-03.json"
_TPU_IMPLS = ("flash_pallas", "xla_chunked", "jax_splash", "xla_dense", "xla_native", "reference")
_TPU_ROW = "[impl={impl},seq_len={n},mask={mask},pass={p}].temp_bytes"
_TPU_RATIOS = [("flash_pallas", m, p) for m in ("full", "causal") for p in ("fwd", "fwd+bwd")] + [
    ("xla_chunked", m, "fwd+bwd") for m in ("full", "causal")]
_EVAL_BEFORE = "eval-cost-cpu-2026-12-01-before.json"
_EVAL_NOW = "eval-cost-cpu-2026-12-01.json"
_EVAL_CASES = (("padded512", "[max_len=512,mode=padded]"), ("packed512", "[max_len=512,mode=packed]"),
               ("packed4096", "[max_len=4096,mode=packed]"))

REGISTRY.update({
    **{f"tpuaot.{impl}.{n}": Number(_TPU, _TPU_ROW.format(impl=impl, n=n, mask="full", p="fwd+bwd"),
                                    ",.1f", MIB)
       for impl in _TPU_IMPLS for n in (512, 2048, 8192, 32768)},
    **{f"tpuaot.ratio.{impl}.{mask}.{p}": Number(
        _TPU, ("/", _TPU_ROW.format(impl="reference", n=32768, mask=mask, p=p),
               _TPU_ROW.format(impl=impl, n=32768, mask=mask, p=p)), ".0f")
       for impl, mask, p in _TPU_RATIOS},
    "tpuaot.flash_pallas.fwd_32k": Number(
        _TPU, _TPU_ROW.format(impl="flash_pallas", n=32768, mask="full", p="fwd"), ".1f", MIB),
    **{f"tpuaot.reference.{mask}_gib": Number(_TPU, _TPU_ROW.format(impl="reference", n=32768, mask=mask,
                                                                    p="fwd+bwd"), ".0f", GIB)
       for mask in ("full", "causal")},
    "tpuaot.flash_pallas.32k_mib": Number(_TPU, _TPU_ROW.format(impl="flash_pallas", n=32768, mask="full",
                                                                p="fwd+bwd"), ".0f", MIB),
    **{f"cpu.{mask}.{impl}.{n}.ms": Number(_CPU, _CPU_ROW.format(impl=impl, n=n, mask=mask) + ".cpu_s",
                                           ".1f", 1000)
       for mask, impls in _CPU_TIME.items() for impl, lengths in impls.items() for n in lengths},
    **{f"cpu.{dtype}.{p}.{mask}.{impl}.{n}.ms": Number(
        _CPU, f"[impl={impl},seq_len={n},mask={mask},dtype={dtype},pass={p},target=cpu].cpu_s",
        ",.1f" if (dtype, p) == ("float32", "fwd+bwd") else ",.0f", 1000)
       for mask, impl, n, dtype, p in _CPU_PROSE},
    **{f"cpu.float32.fwd.{mask}.xla_chunked.32768.{what}": Number(
        _CPU, f"[impl=xla_chunked,seq_len=32768,mask={mask},dtype=float32,pass=fwd,target=cpu].{what}", ",d")
       for mask in ("packed",) for what in ("blocks_visited", "blocks_total")},
    **{f"cpumem.{impl}.{n}": Number(_CPU, _CPU_ROW.format(impl=impl, n=n, mask="full") + ".temp_bytes",
                                    ",.1f", MIB)
       for impl, lengths in _CPU_MEM.items() for n in lengths},
    **{f"splash.{impl}.{mask}.{n}": Number(
        _SPLASH, f"[impl={impl},shape/mask={mask},shape/seq_len={n}].memory_bytes.temp", ".2f", MIB)
       for impl in ("flash_pallas", "jax_splash") for mask in ("causal", "full") for n in (8192, 32768)},
    **{f"layout.{when}.{mask}.{n}": Number(f, f"[impl=flash_pallas,shape/mask={mask},shape/seq_len={n}]"
                                                ".memory_bytes.temp", fmt, MIB)
       for when, f in (("now", _SPLASH), ("before", _SPLASH_BEFORE_LAYOUT))
       for mask in ("causal", "full") for n, fmt in ((8192, ".2f" if when == "before" else ".1f"),
                                                      (32768, ".1f"))},
    **{f"layout.delta.causal.{n}": Number(_SPLASH_BEFORE_ALIAS, f"[impl=flash_pallas,shape/mask=causal,"
                                          f"shape/seq_len={n}].memory_bytes.temp", fmt, MIB)
       for n, fmt in ((8192, ".1f"), (32768, ".0f"))},
    **{f"splash.ratio.{mask}": Number(
        _SPLASH, ("/", f"[impl=jax_splash,shape/mask={mask},shape/seq_len=32768].memory_bytes.temp",
                  f"[impl=flash_pallas,shape/mask={mask},shape/seq_len=32768].memory_bytes.temp"), ".2f")
       for mask in ("causal", "full")},
    **{f"loop.{s}.{p}.{v}.ms": Number(_LOOP, _LOOP_ROW.format(v=v, s=s, p=p) + ".cpu_ms", ",.0f")
       for s in _LOOP_SHAPES for p in ("fwd", "fwd+bwd")
       for v in ("flax", "xla_dense@whole", "xla_dense", "xla_chunked@whole", "xla_chunked")},
    **{f"loop.{s}.{p}.{v}.x": Number(_LOOP, _LOOP_ROW.format(v=v, s=s, p=p) + ".flax_cpu_over_ours", ".2f")
       for s in _LOOP_SHAPES for p in ("fwd", "fwd+bwd")
       for v in ("xla_dense@whole", "xla_dense", "xla_chunked@whole", "xla_chunked")},
    **{f"dense.{s}.{m}.{v}.ms": Number(_DENSE, _DENSE_ROW.format(v=v, s=s, m=m) + ".cpu_ms", ",.0f")
       for s in ("4x512x12x32", "8x512x12x64") for m in ("none", "segments")
       for v in ("flax", "xla_dense", "xla_native", "xla_chunked")},
    **{f"dense.{s}.{m}.{v}.x": Number(_DENSE, _DENSE_ROW.format(v=v, s=s, m=m) + ".flax_cpu_over_ours", ".2f")
       for s in ("4x512x12x32", "8x512x12x64") for m in ("none", "segments")
       for v in ("xla_dense", "xla_native", "xla_chunked")},
    **{f"crossover.{s}.{m}.{v}.ms": Number(_CROSSOVER, _DENSE_ROW.format(v=v, s=s, m=m) + ".cpu_ms", ",.0f")
       for s, m, v in _CROSSOVER_CELLS},
    **{f"e2e.{v}.{n}.{what}": Number(_E2E, f"[variant={v},seq_len={n}].{path}", fmt, scale)
       for v, n in _E2E_CELLS
       for what, path, fmt, scale in (("step_s", "step_s", ".2f", 1.0), ("cpu_s", "step_cpu_s", ".2f", 1.0),
                                      ("tokens_per_s", "tokens_per_s", ",.0f", 1.0),
                                      ("peak_mib", "compiled_peak_bytes", ",.0f", MIB),
                                      ("rss_mib", "peak_rss_bytes", ",.0f", MIB))},
    **{f"e2e.auto.{n}.{what}": Number(_E2E, f"[variant=auto,seq_len={n}].{path}", ".2f")
       for n in (512, 2048)
       for what, path in (("wall_x", "speedup_vs_flax"), ("cpu_x", "cpu_speedup_vs_flax"))},
    "e2e.auto.8192.step_s": Number(_E2E, "[variant=auto,seq_len=8192].step_s", ".0f"),
    "e2e.auto.8192.cpu_s": Number(_E2E, "[variant=auto,seq_len=8192].step_cpu_s", ".1f"),
    "e2e.auto.8192.cpu_s_int": Number(_E2E, "[variant=auto,seq_len=8192].step_cpu_s", ".0f"),
    "e2e.auto.8192.tokens_per_s": Number(_E2E, "[variant=auto,seq_len=8192].tokens_per_s", ".0f"),
    "e2e.auto.8192.memory_x": Number(_E2E, "[variant=auto,seq_len=8192].memory_ratio_flax_over_ours", ".0f"),
    "e2e.auto.8192.peak_mib": Number(_E2E, "[variant=auto,seq_len=8192].compiled_peak_bytes", ",.0f", MIB),
    "e2e.auto.8192.rss_mib": Number(_E2E, "[variant=auto,seq_len=8192].peak_rss_bytes", ",.0f", MIB),
    **{f"e2e512.{r}.{v}.{what}": Number(_E2E_512, f"[run={r},variant={v}].{path}", fmt, scale)
       for r in (1, 2, 3) for v in ("flax", "auto")
       for what, path, fmt, scale in (("cpu_s", "step_cpu_s", ".2f", 1.0), ("step_s", "step_s", ".1f", 1.0),
                                      ("peak_mib", "compiled_peak_bytes", ",.0f", MIB),
                                      ("rss_mib", "peak_rss_bytes", ",.0f", MIB))},
    **{f"e2e512.{r}.x": Number(_E2E_512, f"[run={r},variant=auto].cpu_speedup_vs_flax", ".2f")
       for r in (1, 2, 3)},
    **{f"memory.{what}.{i}": Number(_MEMORY, f"plateau.{path}.[{i}]", fmt, scale)
       for i in (0, 1)
       for what, path, fmt, scale in (("rss_mib", "rss_median_bytes", ".1f", MIB),
                                      ("anon_mib", "rss_anon_median_bytes", ".1f", MIB),
                                      ("arrays", "live_arrays_floor", "d", 1.0),
                                      ("array_mib", "live_array_bytes_floor", ".1f", MIB),
                                      ("threads", "threads_max", "d", 1.0))},
    "memory.anon_growth_pct": Number(_MEMORY, "plateau.rss_anon_growth", ".1f", 100),
    **{f"evalcost.{when}.{case}.{what}": Number(f, f"cases.{row}.{path}", fmt, scale)
       for when, f in (("before", _EVAL_BEFORE), ("now", _EVAL_NOW)) for case, row in _EVAL_CASES
       for what, path, fmt, scale in (("batches", "batches", "d", 1.0), ("tokens", "real_tokens", ",d", 1.0),
                                      ("fraction", "real_token_fraction", ".1f", 100),
                                      ("eval_s", "eval_cpu_s", ".1f", 1.0),
                                      ("compile_s", "warmup_cpu_s", ".1f", 1.0))},
    **{f"evalcost.{layers}.{case}.{what}": Number(f, f"cases.{row}.eval_cpu_s", ".2f")
       for layers, f in (("1layer", _EVAL_1), ("6layers", _EVAL_6))
       for case, row in _EVAL_CASES[1:] for what in ("eval_s",)},
    **{f"evalcost.{layers}.rounds.{op}": Number(f, (op, *(f"summary.ratio_eval_cpu_rounds.[{i}]"
                                                          for i in range(n))), ".2f")
       for layers, f, n in (("1layer", _EVAL_1, 5), ("6layers", _EVAL_6, 3)) for op in ("min", "max")},
})

_MASK_MOD = "mask-mod-cpu-2026-12-03.json"
_MASK_MOD_SHAPES = ("2x4096x12x32", "1x8192x4x64")
_MASK_MOD_VARIANTS = ("builtin_causal", "mask_mod_causal", "mask_mod_prefix_lm", "mask_mod_chunked_causal")
REGISTRY.update({
    **{f"maskmod.{shape}.{variant}.{p}.{what}":
       Number(_MASK_MOD, f"rows.[shape={shape},variant={variant},pass={p}].{path}", fmt)
       for shape in _MASK_MOD_SHAPES for variant in _MASK_MOD_VARIANTS for p in ("fwd", "fwd+bwd")
       for what, path, fmt in (("cpu_s", "cpu_s", ".2f"), ("ratio", "vs_builtin_causal", ".2f"),
                               ("blocks", "blocks_visited", "d")) if what != "blocks" or p == "fwd"},
    **{f"maskmod.flags_s.{name}": Number(_MASK_MOD, f"tile_flags.[mask_mod={name}].cpu_s", ".2f")
       for name in ("causal", "prefix_lm", "chunked_causal")},
    **{f"maskmod.flags_tiles.{name}": Number(_MASK_MOD, f"tile_flags.[mask_mod={name}].tiles_nonempty", ",d")
       for name in ("causal", "prefix_lm", "chunked_causal")},
})

_STRICT = "strict-tier-cpu-2026-12-03.json"
REGISTRY.update({
    "strict.cpu_s": Number(_STRICT, "strict_tier.cpu_seconds_total", ".0f"),
    "strict.wall_s": Number(_STRICT, "strict_tier.wall_seconds", ".0f"),
    "strict.tests": Number(_STRICT, "strict_tier.passed", "d"),
    "tpucheck.dry_cpu_s": Number(_STRICT, "tpu_check_dry_run.cpu_seconds_total", ".1f"),
})

# Context-parallel strategies compiled for TPU pods (`python -m benchmarks.cp_aot --sweep`): one
# entry per column of the table `--table` prints, for every case the sweep compiled (not refused).
_CP_AOT = "cp-aot-2026-12-06.json"


def _cp_aot_numbers() -> dict[str, Number]:
  from benchmarks import cp_aot
  path = RESULTS / _CP_AOT
  if not path.is_file():
    return {}
  numbers = {}
  for case in json.loads(path.read_text())["cases"]:
    if "refused" in case:
      continue
    for _, key, field, scale, fmt in cp_aot.TABLE_COLUMNS:
      numbers[f"{cp_aot.case_key(case)}.{key}"] = Number(_CP_AOT, f"{cp_aot.case_selector(case)}.{field}",
                                                          f",{fmt}", scale)
  numbers["cpaot.date"] = Number(_CP_AOT, "date", "s")
  return numbers


REGISTRY.update(_cp_aot_numbers())

# The pod dry run (`python train.py --config configs/tpu_pod.py --aot_topology v5p:4x4x4`).
_POD = "tpu-pod-dry-run-v5p-4x4x4-2026-12-06.json"
REGISTRY.update({
    "pod.attention_mib_layer": Number(_POD, "report.attention.modelled_bytes_per_chip_per_layer", ",.1f",
                                      MIB),
    "pod.attention_mib_step": Number(_POD, "report.attention.modelled_bytes_per_chip_per_step", ",.0f", MIB),
    "pod.sequence_mib_step": Number(_POD, "report.collective_bytes_per_step_per_chip.by_axes.ici:sequence",
                                    ",.0f", MIB),
    "pod.peak_gib": Number(_POD, "report.per_chip_bytes.peak_estimate", ".2f", GIB),
})


# ---------------------------------------------------------------------------------------------
# Reading a number.

def _field(row, name: str):
  for part in name.split("/"):
    if not isinstance(row, dict) or part not in row:
      return _MISSING
    row = row[part]
  return row


_MISSING = object()


def _same(value, text: str) -> bool:
  if isinstance(value, list):
    return "x".join(str(v) for v in value) == text
  return str(value) == text


def lookup(data, path: str):
  """The value at `path` in `data` (see the module docstring); KeyError naming the step that fails."""
  node = data
  for step in re.findall(r"\[[^\]]*\]|[^.\[\]]+", path):
    if step.startswith("["):
      inner = step[1:-1]
      if re.fullmatch(r"-?\d+", inner):
        if not isinstance(node, list) or not -len(node) <= int(inner) < len(node):
          raise KeyError(f"{path}: no element {inner}")
        node = node[int(inner)]
        continue
      want = dict(item.split("=", 1) for item in inner.split(","))
      if not isinstance(node, list):
        raise KeyError(f"{path}: {step} selects from a list, found {type(node).__name__}")
      hits = [row for row in node
              if all((v := _field(row, k)) is not _MISSING and _same(v, text) for k, text in want.items())]
      if len(hits) != 1:
        raise KeyError(f"{path}: {step} matches {len(hits)} rows, not 1")
      node = hits[0]
    else:
      if not isinstance(node, dict) or step not in node:
        raise KeyError(f"{path}: no field {step!r}")
      node = node[step]
  return node


_LOADED: dict[tuple[pathlib.Path, int], object] = {}


def _load(path: pathlib.Path):
  """The file's JSON, parsed once per version of the file."""
  key = (path, path.stat().st_mtime_ns)
  if key not in _LOADED:
    _LOADED[key] = json.loads(path.read_text())
  return _LOADED[key]


def value(number: Number, results: pathlib.Path = RESULTS):
  """The number's value, read from its file (unscaled, unformatted)."""
  path = results / number.file
  if not path.is_file():
    raise FileNotFoundError(f"{number.file}: no such results file in {results}")
  data = _load(path)
  if isinstance(number.value, str):
    return lookup(data, number.value)
  op, *paths = number.value
  if op not in OPS:
    raise ValueError(f"value op must be one of {OPS}; got {op!r}")
  values = [float(lookup(data, p)) for p in paths]
  if op == "/":
    return values[0] / values[1]
  return min(values) if op == "min" else max(values)


def render(key: str, results: pathlib.Path = RESULTS) -> str:
  """The text a marker for `key` must hold."""
  if key not in REGISTRY:
    raise KeyError(f"{key!r} is not in benchmarks.docs_numbers.REGISTRY")
  number = REGISTRY[key]
  v = value(number, results)
  if isinstance(v, str):
    return format(v, number.fmt)
  v = v * number.scale
  return format(round(v) if number.fmt.endswith("d") else v, number.fmt)


# ---------------------------------------------------------------------------------------------
# The pages.

def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclasses.dataclass(frozen=True)
class Problem:
  where: str      # "README.md:112" or "REGISTRY"
  key: str
  message: str

  def __str__(self) -> str:
    return f"{self.where}: {self.key}: {self.message}"


def check(root: pathlib.Path = ROOT) -> list[Problem]:
  """Markers whose text differs from their file, unknown keys, unreadable entries, unused keys."""
  problems, used = [], set()
  for page in pages(root):
    for lineno, line in enumerate(page.read_text().splitlines(), 1):
      for match in MARKER.finditer(line):
        key, written = match.groups()
        used.add(key)
        where = f"{page.relative_to(root)}:{lineno}"
        try:
          expected = render(key, root / "benchmarks" / "results")
        except (KeyError, FileNotFoundError, ValueError, TypeError) as e:
          problems.append(Problem(where, key, str(e)))
          continue
        if written != expected:
          problems.append(Problem(where, key, f"written {written!r}, the results file gives {expected!r}"))
  for key in sorted(set(REGISTRY) - used):
    problems.append(Problem("REGISTRY", key, "no page marks this key"))
  return problems


def write(root: pathlib.Path = ROOT) -> list[str]:
  """Rewrites every marked value from its file; returns the pages changed."""
  changed = []
  for page in pages(root):
    text = page.read_text()
    new = MARKER.sub(lambda m: f"<!--n:{m[1]}-->{render(m[1], root / 'benchmarks' / 'results')}<!--/n-->",
                     text)
    if new != text:
      page.write_text(new)
      changed.append(str(page.relative_to(root)))
  return changed


# ---------------------------------------------------------------------------------------------
# Headline numbers: what must be marked.

# A measured number: digits with thousands commas, a decimal part or an exponent, standing alone
# (not part of a name such as v5p, 2x2x2, 32k or fwd+bwd's neighbours).
NUMBER = re.compile(r"(?<![\w.\-/:])\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?(?![\w])")


def _unmarked(text: str) -> list[str]:
  text = MARKER.sub("", text)
  text = re.sub(r"\[[^\]]*\]", "", text)  # shapes such as [8, 512, 12, 64] describe the case
  return NUMBER.findall(text)


def headline_cells(readme: str) -> list[tuple[int, str]]:
  """(line, text) of the README's headline numbers: the "number" column of the table under
  "## Headline numbers", and every bold span holding a digit outside tables (the quickstart's result)."""
  cells, in_section, column = [], False, None
  for lineno, line in enumerate(readme.splitlines(), 1):
    if line.startswith("## "):
      in_section, column = line.strip() == "## Headline numbers", None
    if line.startswith("|"):
      parts = [p.strip() for p in line.strip().strip("|").split("|")]
      if in_section:
        if column is None and "number" in parts:
          column = parts.index("number")
        elif column is not None and not set(parts[column]) <= set("-: "):
          cells.append((lineno, parts[column]))
      continue
    cells.extend((lineno, span) for span in re.findall(r"\*\*(.+?)\*\*", line) if re.search(r"\d", span))
  return cells


def unmarked_headline_numbers(readme: str) -> list[tuple[int, str, str]]:
  """(line, number, cell) for every headline number of the README written without a marker."""
  return [(lineno, n, cell) for lineno, cell in headline_cells(readme) for n in _unmarked(cell)]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.docs_numbers", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument("--check", action="store_true", help="report disagreements, exit 1 if any (default)")
  mode.add_argument("--write", action="store_true", help="rewrite the marked values from the files")
  args = parser.parse_args(argv)
  if args.write:
    for page in write():
      print(f"rewrote {page}")
  problems = check()
  problems += [Problem(f"README.md:{line}", "headline", f"{n} is not marked (in {cell!r})")
               for line, n, cell in unmarked_headline_numbers((ROOT / "README.md").read_text())]
  for problem in problems:
    print(problem)
  print(f"{len(problems)} problem(s)" if problems else "every marked number agrees with its results file")
  return 1 if problems else 0


# The test tiers (docs/testing.md, docs/benchmarks.md "The test suite"): the whole suite before the
# tiers, the default tier timed as a newcomer runs it, CI's two tiers, branch coverage, injected bugs.
_TESTS_BEFORE = "test-profile-before-2026-12-07.json"
_TESTS_TIME = "test-time-default-2026-12-07.json"
_TESTS_CI = "test-time-ci-coverage-2026-12-07.json"
_TESTS_COV = "test-coverage-2026-12-07.json"
_MUTANTS = "mutants-2026-12-07.json"
_TESTS_COV_NOW = "test-coverage-7cd30b7-2026-12-08.json"
_TESTS_CI_COV_NOW = "test-time-ci-coverage-7cd30b7-2026-12-08.json"
REGISTRY.update({
    "tests.before.count": Number(_TESTS_BEFORE, "profile.tests", ",d"),
    "tests.before.wall_min": Number(_TESTS_BEFORE, "wall_s", ".1f", 1 / 60),
    "tests.before.worker_min": Number(_TESTS_BEFORE, "profile.wall_s", ".0f", 1 / 60),
    "tests.before.compile_pct": Number(_TESTS_BEFORE, "profile.compile_share", ".0f", 100),
    "tests.default.median_min": Number(_TESTS_TIME, "median_wall_s", ".1f", 1 / 60),
    **{f"tests.default.round{i}_min": Number(_TESTS_TIME, f"rounds.[{i}].wall_s", ".1f", 1 / 60)
       for i in range(3)},
    "tests.default.count": Number(_TESTS_TIME, "default_tests", ",d"),
    "tests.default.date": Number(_TESTS_TIME, "date", "s"),
    "tests.ci.wall_min": Number(_TESTS_CI, "wall_s", ".1f", 1 / 60),
    "tests.ci.default_min": Number(_TESTS_CI, "default_tier_wall_s", ".1f", 1 / 60),
    "tests.ci.slow_count": Number(_TESTS_CI, "second_tier_tests", ",d"),
    "tests.ci.slow_min": Number(_TESTS_CI, "second_tier_wall_s", ".1f", 1 / 60),
    "tests.cov.before": Number(_TESTS_COV, "rows.before.branch_percent", ".1f"),
    "tests.cov.both": Number(_TESTS_COV, "rows.both.branch_percent", ".1f"),
    "tests.cov.default": Number(_TESTS_COV, "rows.default.branch_percent", ".1f"),
    "tests.cov.share": Number(_TESTS_COV, "rows.default_share_of_both_branches_percent", ".1f"),
    "tests.cov_now.both": Number(_TESTS_COV_NOW, "rows.both.branch_percent", ".1f"),
    "tests.cov_now.default": Number(_TESTS_COV_NOW, "rows.default.branch_percent", ".1f"),
    "tests.cov_now.share": Number(_TESTS_COV_NOW, "rows.default_share_of_both_branches_percent", ".1f"),
    "tests.cov_now.branches": Number(_TESTS_COV_NOW, "rows.both.branches", ",d"),
    "tests.ci_cov_now.commit": Number(_TESTS_CI_COV_NOW, "commit", "s"),
    "tests.ci_cov_now.wall_min": Number(_TESTS_CI_COV_NOW, "wall_s", ".1f", 1 / 60),
    "tests.ci_cov_now.default_count": Number(_TESTS_CI_COV_NOW, "default_tier_tests", ",d"),
    "tests.ci_cov_now.slow_count": Number(_TESTS_CI_COV_NOW, "second_tier_tests", ",d"),
    "tests.mutants.total": Number(_MUTANTS, "mutants_count", "d"),
    "tests.mutants.caught": Number(_MUTANTS, "caught_count", "d"),
})
# Re-measured in the afternoon: a plain `.ci/run` (both tiers, no coverage) on a fresh clone, the default
# tier of an earlier `.ci/run` round, and the tier in a checkout against tests/durations.json.
_TESTS_CI_PLAIN = "test-time-ci-afdc071-2026-12-07.json"
_TESTS_CI_EARLIER = "test-time-ci-de009be-2026-12-07.json"
_TESTS_CHECKOUT = "test-time-checkout-2026-12-07.json"
REGISTRY.update({
    "tests.ci_plain.wall_min": Number(_TESTS_CI_PLAIN, "rounds.[0].wall_s", ".1f", 1 / 60),
    "tests.ci_plain.commit": Number(_TESTS_CI_PLAIN, "commit", "s"),
    "tests.ci_plain.default_count": Number(_TESTS_CI_PLAIN, "rounds.[0].tiers.[0].passed", ",d"),
    "tests.ci_plain.default_min": Number(_TESTS_CI_PLAIN, "rounds.[0].tiers.[0].seconds", ".1f", 1 / 60),
    "tests.ci_plain.slow_count": Number(_TESTS_CI_PLAIN, "rounds.[0].tiers.[1].passed", ",d"),
    "tests.ci_plain.slow_min": Number(_TESTS_CI_PLAIN, "rounds.[0].tiers.[1].seconds", ".1f", 1 / 60),
    "tests.ci_earlier.default_min": Number(_TESTS_CI_EARLIER, "rounds.[0].tiers.[0].seconds", ".1f", 1 / 60),
    "tests.checkout.wall_min": Number(_TESTS_CHECKOUT, "wall_s", ".1f", 1 / 60),
    "tests.checkout.ratio": Number(_TESTS_CHECKOUT, "ratio_now_over_recorded", ".2f"),
    "tests.checkout.recorded_s": Number(_TESTS_CHECKOUT, "same_tests_one_process.recorded_sum_s_under_n2",
                                        ".1f"),
    "tests.checkout.same_min_s": Number(_TESTS_CHECKOUT, "same_tests_one_process.rounds.[4].s", ".1f"),
    "tests.checkout.same_max_s": Number(_TESTS_CHECKOUT, "same_tests_one_process.rounds.[0].s", ".1f"),
    "tests.checkout.gemm": Number(_TESTS_CHECKOUT, "gemm_gflops_4096_f32", ".0f"),
})


# docs/training.md: the task configs' worked examples (benchmarks/tasks.py) and the position copy from 512
# to 1,024 tokens under masked-LM training (benchmarks/position_copy.py).
_TASK = "task-{}-2026-12-07.json"
_POSITION_COPY = "position-copy-2026-12-07.json"
_TASK_METRICS = {
    "multi_label": ("micro_f1", "macro_f1", "samples_f1", "mean_average_precision"),
    "hierarchical": ("micro_f1", "macro_f1", "samples_f1", "mean_average_precision"),
    "regression": ("pearson", "spearman", "mae"),
    "token_classification": ("entity_f1", "token_accuracy"),
}
for _name, _metrics in _TASK_METRICS.items():
  _file = _TASK.format(_name)
  REGISTRY.update({f"tasks.{_name}.{m}": Number(_file, f"eval.{m}", ".3f") for m in _metrics})
  REGISTRY.update({
      f"tasks.{_name}.steps": Number(_file, "eval.checkpoint_step", "d"),
      f"tasks.{_name}.train_min": Number(_file, "stages.train.wall_s", ".1f", 1 / 60),
  })
REGISTRY.update({
    "tasks.multi_label.documents": Number(_TASK.format("multi_label"), "eval.num_examples", "d"),
    "tasks.multi_label.threshold": Number(_TASK.format("multi_label"), "eval.thresholds.[0]", ".2f"),
    "tasks.hierarchical.threshold": Number(_TASK.format("hierarchical"), "eval.thresholds.[0]", ".2f"),
    "tasks.token_classification.words":
        Number(_TASK.format("token_classification"), "eval.words_scored", ",d"),
    **{f"position_copy.{stage}.{k}": Number(_POSITION_COPY, f"{stage}.{k}", f, scale)
       for stage in ("step_0", "final")
       for k, f, scale in (("loss_below_512", ".2f", 1), ("loss_from_512", ".2f", 1),
                           ("relative_gap", ".1f", 100), ("mlm_accuracy", ".1f", 100))},
    "position_copy.head_steps": Number(_POSITION_COPY, "args.head_steps", "d"),
    "position_copy.long_steps": Number(_POSITION_COPY, "args.long_steps", "d"),
    "position_copy.articles": Number(_POSITION_COPY, "articles.train", "d"),
    "position_copy.masked_from_512": Number(_POSITION_COPY, "final.masked_from_512", ",d"),
})

# docs/training.md: the long-versus-short study (benchmarks/long_vs_short.py), its five arms and probe (f).
_LVS = "long-vs-short-2026-12-07/summary.json"
_LVS_ARMS = ("a", "b", "c", "d", "e", "f")
REGISTRY.update({
    "lvs.test_documents": Number(_LVS, "test_documents", "d"),
    "lvs.budget_tokens": Number(_LVS, "budget_tokens", ",d"),
    "lvs.median_tokens": Number(_LVS, "probe.tokens.median", ".0f"),
    "lvs.max_tokens": Number(_LVS, "probe.tokens.max", ",d"),
    "lvs.share_above_512": Number(_LVS, "probe.tokens.share_above_512", ".0f", 100),
    "lvs.share_above_1024": Number(_LVS, "probe.tokens.share_above_1024", ".1f", 100),
    "lvs.documents_above_512": Number(_LVS, "probe.documents.> 512", "d"),
    "lvs.documents_within_512": Number(_LVS, "probe.documents.<= 512", "d"),
    "lvs.mlm_short.accuracy": Number(_LVS, "mlm.short.dev.mlm_accuracy", ".1f", 100),
    "lvs.mlm_short.loss": Number(_LVS, "mlm.short.dev.mlm_loss", ".2f"),
    "lvs.mlm_long.accuracy": Number(_LVS, "mlm.long.dev.mlm_accuracy", ".1f", 100),
    "lvs.mlm_long.loss_below_512": Number(_LVS, "mlm.long.dev.mlm_loss_below_512", ".2f"),
    "lvs.mlm_long.loss_from_512": Number(_LVS, "mlm.long.dev.mlm_loss_from_512", ".2f"),
    **{f"lvs.{arm}.{k}": Number(_LVS, f"arms.{arm}.{k}", ".1f", 100)
       for arm in _LVS_ARMS for k in ("mean", "std")},
    **{f"lvs.{arm}.seed{i}": Number(_LVS, f"arms.{arm}.values.[{i}]", ".1f", 100)
       for arm in _LVS_ARMS for i in range(3)},
    **{f"lvs.{arm}.lr": Number(_LVS, f"arms.{arm}.lr", "g") for arm in _LVS_ARMS},
    **{f"lvs.{arm}.vs_a.seed{i}.{k}": Number(_LVS, f"arms.{arm}.paired_vs_a.[{i}].{path}", "+.1f", 100)
       for arm in _LVS_ARMS if arm != "a"
       for i in range(3) for k, path in (("delta", "delta"), ("low", "ci95.[0]"), ("high", "ci95.[1]"))},
    **{f"lvs.{arm}.{bucket}": Number(_LVS, f"probe.arms.{arm}.{name}.macro_f1", ".1f", 100)
       for arm in _LVS_ARMS for bucket, name in (("within_512", "<= 512"), ("above_512", "> 512"))},
})

if __name__ == "__main__":
  sys.exit(main())
