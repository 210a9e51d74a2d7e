"""The two test tiers, as data: which cases of a parametrized grid the default tier runs.

Every case of a grid stays collected under its own test id. The ones the default tier does not need
carry the `slow` mark, so `-m slow` (the second tier, which CI also runs) runs them, and together the
two tiers run exactly the whole grid. docs/testing.md says what each tier holds.

Three ways to choose the default-tier cases:
- `cover`: where each case is a bundle of features (the conformance configurations), the cheapest
  cases that together hold every attribute, chosen greedily in a fixed order. It keeps every feature,
  and every listed combination of interacting features, in the default tier.
- `COVERINGS`: where the grid's dimensions are independent (a property that holds per generation and
  per shape, say), a covering array of strength 1 from allpairspy: every value of every dimension
  appears in some default-tier case. allpairspy's generation is deterministic for a given order of the
  dimensions and values (no random seed is involved), so the tiers do not change from run to run.
- `SECOND_TIER`: single tests by id, each beside the default-tier test that checks the same property.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence

import pytest

SLOW = pytest.mark.slow


def param(*values, default: bool, id: str | None = None):
  """One case of a grid, marked `slow` unless the default tier runs it."""
  return pytest.param(*values, id=id, marks=() if default else (SLOW,))


def cover(cases: Sequence, attributes: Callable[[object], Iterable[Hashable]],
          cost: Callable[[object], float] = lambda case: 0.0) -> list:
  """The cases the default tier runs: greedily the case adding the most uncovered attributes per unit
  of cost (ties: the cheaper, then the earlier), until every attribute of any case is held by a
  chosen case."""
  attrs = {i: set(attributes(c)) for i, c in enumerate(cases)}
  chosen: list[int] = []
  need = set().union(*attrs.values())
  while need:
    best = max((i for i in attrs if i not in chosen and attrs[i] & need),
               key=lambda i: (len(attrs[i] & need) / (1.0 + cost(cases[i])), -cost(cases[i]), -i))
    chosen.append(best)
    need -= attrs[best]
  return [cases[i] for i in sorted(chosen)]


def covering(dimensions: Sequence[Sequence]) -> set[tuple]:
  """A covering array of strength 1 over `dimensions` (each a list of values), from allpairspy."""
  if len(dimensions) <= 1:
    return set(itertools.product(*dimensions))
  from allpairspy import AllPairs
  return {tuple(row) for row in AllPairs([list(d) for d in dimensions], n=1)}


# Tests of the second tier by id (an id ending in "[" takes every case of that test), each with the
# default-tier test that checks the same property at a smaller size or on fewer cases. conftest.py
# marks them and the COVERINGS cases left out `slow`; the conformance grid (`cover`) is marked where it
# is parametrized.
CP = "tests/test_context_parallel.py::"
SECOND_TIER: dict[str, str] = {
    # 8 simulated devices in subprocesses: the full strategy x mesh x request tables.
    CP + "test_every_request_on_every_mesh_with_every_strategy":
        "test_every_strategy_on_eight_devices_in_one_process",
    CP + "test_reference_on_every_strategy": "test_every_strategy_on_eight_devices_in_one_process",
    CP + "test_interpreted_flash_kernels_on_every_strategy_and_on_batch_and_head_splits":
        "test_sharded_mods.py (the kernels' global offsets and a shard's rows and heads in one process) "
        "+ the 8-device xla_chunked strategies",
    "tests/test_parallel.py::test_sharded_equals_unsharded[": "test_context_parallel's 8-device test, "
    "test_flax_attention_fn_shards_over_its_mesh_or_the_current_one, test_interpret_mesh.py",
    "tests/test_parallel.py::test_ring_with_gpu_kernels_interpreted":
        "the ring on 8 devices + the GPU family "
    "in test_conformance",
    "tests/test_cp_all_gather.py::test_all_gather_equals_unsharded[reference]": "[xla_chunked]",
    "tests/test_cp_all_gather.py::test_all_gather_equals_unsharded[flash_pallas]": "[xla_chunked] + "
    "test_sharded_mods.py",
    "tests/test_cp_ulysses.py::test_strategies_equal_unsharded[reference]": "[xla_chunked]",
    "tests/test_cp_ulysses.py::test_strategies_equal_unsharded[flash_pallas]": "[xla_chunked] + "
    "test_sharded_mods.py",
    "tests/test_cp_aot.py::test_ulysses_moves_fewer_bytes_per_chip_than_the_ring_at_128k": "test_cp_cost.py "
    "(the model's bytes) + test_parallel.py::test_ring_flash_pallas_compiles_for_v5p_slice",
    # Interpreted kernels at full size.
    "tests/test_tpu_grid.py::test_executed_grid_points_of_a_mask_mod_are_its_visible_tiles[":
        "test_executed_grid_points_of_a_mask_mod_at_small_tiles",
    "tests/test_tpu_strict.py::test_tpu_kernels_conform_under_the_strict_interpreter[":
        "test_tpu_kernels_conform_under_the_strict_interpreter_on_one_walk",
    "tests/test_conformance.py::test_interpreted_cases_on_random_configs[flash_pallas-tpu]":
        "the TPU family's default-tier conformance configurations; [flash_pallas-gpu]",
    "tests/test_masks.py::test_block_map_matches_brute_force": "test_block_map_edge_cases",
    # Training and the CLIs in subprocesses.
    "tests/test_training.py::test_long_docs_config_smoke_trains_on_one_cpu_device":
        "test_shipped_configs_are_valid + test_train_then_eval_end_to_end",
    "tests/test_training.py::test_sigterm_then_sigkill_then_resume_gives_identical_losses":
        "test_corrupt_latest_checkpoint_falls_back_to_the_previous, "
        "test_restore_params_reads_no_optimizer_state",
    "tests/test_training.py::test_quickstart_step_with_attention_dropout_zero_applies_none[xla_native]":
        "[auto]",
    "tests/test_memory.py::test_training_memory_plateaus": "test_memory.py's other test",
    "tests/test_bench.py::test_quick_grid_writes_every_cell_json_and_plots": "test_bench.py's cpu_dense and "
    "decode_cpu tests",
    "tests/test_flax_upstream.py::test_flax_module_tests_pass_with_our_classes": "test_flax_compat.py, "
    "test_flax_interface.py",
    "tests/test_export.py::test_cli_exports_a_trained_workdir_with_its_stored_config":
        "test_bert_round_trip_and_schema + the round trips of every family",
    "tests/test_tpu_check.py::test_dry_run_checks_times_and_reports": "test_gpu_check.py's dry run",
    "tests/test_serve.py::test_every_request_gets_the_tokens_it_gets_alone": "test_the_example_runs + "
    "test_paged_cache.py",
    "tests/test_bench_profile.py::test_auto_trace_names_the_impl_it_chose":
        "test_attention_trace_is_written_and_names_the_impl",
    # Decoding: every impl's generation loop; the float64 offsets with static offsets.
    "tests/test_decoding.py::test_cached_greedy_generation_equals_uncached[flash_pallas]":
        "[xla_chunked] + test_offsets_match_the_float64_oracle[flash_pallas-traced]",
    "tests/test_decoding.py::test_cached_greedy_generation_equals_uncached[reference]": "[xla_chunked]",
    "tests/test_decoding.py::test_cached_greedy_generation_equals_uncached[xla_dense]": "[xla_chunked]",
    "tests/test_decoding.py::test_cached_greedy_generation_equals_uncached[xla_native]": "[xla_chunked]",
    "tests/test_decoding.py::test_offsets_match_the_float64_oracle[flash_pallas-static]":
        "[flash_pallas-traced]",
    # AOT compiles per generation: one generation stays.
    "tests/test_tpu_aot.py::test_float32_head_dim_256_fits_the_generations_vmem[v4]":
        "test_kernel_config.py's per-generation tiles",
    "tests/test_tpu_aot.py::test_float32_head_dim_256_fits_the_generations_vmem[v5p]":
        "test_kernel_config.py's per-generation tiles",
    "tests/test_tpu_aot.py::test_float32_head_dim_256_fits_the_generations_vmem[v6e]":
        "test_kernel_config.py's per-generation tiles",
    "tests/test_training.py::test_nan_loss_stops_and_keeps_the_last_good_checkpoint":
        "test_corrupt_latest_checkpoint_falls_back_to_the_previous",
    "tests/test_operand_grads.py::test_forward_and_backward_with_the_table_compile_for_a_tpu[v6e]":
        "test_tpu_aot.py::test_mods_compile_into_our_mosaic_kernels",
    "tests/test_sharded_mods.py::test_traced_offsets_compile_for_a_tpu[v6e]":
        "test_tpu_aot.py::test_mods_compile_into_our_mosaic_kernels",
    "tests/test_parallel.py::test_multiprocess_sharded_and_ring_agree_with_single_process": "the 8-device "
    "checks in one process (jax.distributed itself is jax's)",
    "tests/test_export.py::test_cli_bad_arguments_give_one_line_naming_them": "test_cli.py's one-line errors",
    "tests/test_flash_pallas_gpu.py::test_block_size_override_changes_tiles_not_results":
        "test_interior_and_edge_blocks_with_small_tiles",
    "tests/test_cp_ulysses.py::test_strategies_equal_unsharded[xla_chunked]": "test_collectives (the HLO) + "
    "test_context_parallel's 8-device strategies",
    "tests/test_paged_tpu.py::"
    "test_the_kernel_is_race_free_under_the_strict_interpreter[strict_int8_gqa_causal]":
        "[strict_f32_gqa_window]",
    "tests/test_serve.py::test_token_buckets_give_the_same_tokens":
        "test_the_example_runs + test_paged_cache.py",
    "tests/test_training.py::test_quickstart_step_with_attention_dropout_zero_applies_none[auto]":
        "test_every_layer_receives_the_resolved_attention_dropout",
    "tests/test_cp_all_gather.py::test_all_gather_equals_unsharded[xla_chunked]":
        "test_context_parallel.py::test_every_strategy_on_eight_devices_in_one_process",
    "tests/test_multislice.py::test_two_slice_dry_run_report[dcn_fsdp]": "[dcn_data]",
    "tests/test_multislice.py::test_two_slice_dry_run_keeps_ring_and_tensor_collectives_on_ici[dcn_fsdp]":
        "[dcn_data]",
    "tests/test_gpu_check.py::test_dry_run_checks_times_and_reports": "test_gpu_check.py's other tests",
    "tests/test_export.py::test_modernbert_with_biases_round_trip":
        "test_modernbert_round_trip_reproduces_transformers_logits",
    "tests/test_decoding.py::test_cached_greedy_generation_equals_uncached[xla_chunked]":
        "test_linen_decoding_equals_the_uncached_layer + test_serve.py::test_the_example_runs",
    "tests/test_conformance.py::test_conforms_on_random_configs[xla_chunked]": "[reference], [xla_dense]",
    "tests/test_flash_pallas_tpu.py::test_traced_offsets_and_lse_cotangent_match_reference[kwargs1]":
        "[kwargs0]",
    "tests/test_flash_pallas_tpu.py::test_traced_offsets_and_lse_cotangent_match_reference[kwargs2]":
        "[kwargs0]",
    "tests/test_flash_pallas_gpu.py::test_offsets_and_lse_cotangent_match_reference[kwargs1]": "[kwargs0]",
    "tests/test_flash_pallas_gpu.py::test_offsets_and_lse_cotangent_match_reference[kwargs2]": "[kwargs0]",
    "tests/test_conformance.py::test_interpreted_cases_on_random_configs[flash_pallas-gpu]":
        "the GPU family's default-tier conformance configurations",
    # The document tasks end to end (train, evaluate, predict, export): each task's reader, loss, metrics
    # and export head are default-tier unit tests; test_train_then_eval_end_to_end keeps the loop there.
    "tests/test_tasks.py::test_multi_label_trains_evaluates_predicts_and_exports":
        "test_multi_label_scores_predictions_and_tuned_thresholds + "
        "test_multi_label_loss_is_the_mean_binary_cross_entropy_of_real_documents + "
        "test_export.py::test_every_task_head_exports_and_reads_back",
    "tests/test_tasks.py::test_masked_lm_trains_evaluates_and_resumes_bitwise":
        "test_masking_statistics_over_many_draws + test_masked_lm_loss_splits_at_position_512 + "
        "test_export.py::test_every_task_head_exports_and_reads_back",
    "tests/test_tasks.py::test_init_from_starts_a_task_from_a_masked_lm_run_with_its_positions_extended":
        "test_models.py::test_extend_positions_repeat_and_interpolate + "
        "test_training.py's restore_params tests",
    "tests/test_tasks.py::test_hierarchical_documents_train_evaluate_and_predict":
        "test_a_hierarchical_row_is_one_documents_chunks + test_chunk_vectors_are_combined_as_documented",
    "tests/test_tasks.py::test_regression_trains_evaluates_predicts_and_exports_in_target_units":
        "test_regression_loss_is_on_standardized_targets_and_metrics_in_their_units + "
        "test_export.py::test_every_task_head_exports_and_reads_back",
    "tests/test_tasks.py::test_token_classification_trains_evaluates_predicts_and_exports":
        "test_each_word_is_predicted_once_from_the_window_where_it_is_most_central + "
        "test_token_loss_and_word_scores + test_export.py::test_every_task_head_exports_and_reads_back",
    "tests/test_interpret_mesh.py::test_tpu_interpret_under_a_mesh_runs_and_matches[mqa-ring]":
        "[gqa-data-mesh] + the ring in test_context_parallel's 8-device test",
    "tests/test_tpu_aot.py::test_262k_tokens_on_one_v5p_chip_keep_temporaries_linear":
        "test_a_131k_token_mask_mod_plan_fits_one_v5p_chip + "
        "test_dropout_and_alibi_compile_with_no_extra_memory",
    "tests/test_export.py::test_roberta_refuses_a_tokenizer_whose_pad_token_is_not_padding_idx":
        "test_refusals_name_what_is_wrong",
    "tests/test_paged_gpu.py::test_bfloat16_within_twice_the_reference_impl_error":
        "test_paged.py::test_bfloat16_matches_oracle's flash_pallas-gpu cases",
    "tests/test_serve.py::test_int8_pages_stay_within_their_rounding":
        "test_paged_cache.py::test_int8_pages_stay_within_their_rounding + test_the_example_runs",
    "tests/test_export.py::test_modernbert_round_trip_reproduces_transformers_logits[mean]": "[cls] + "
    "test_mean_pooled_bert_and_roberta_are_refused",
    # Single cases beside a default-tier test of the same property (the default tier's wall, 2026-12-07).
    "tests/test_tpu_aot.py::test_float32_head_dim_256_fits_the_generations_vmem[v5e]":
        "test_compiles_to_mosaic_kernels_with_analytic_flops's head_dim-256 shape + "
        "test_kernel_config.py's per-generation tiles",
    "tests/test_parallel.py::test_flax_layer_shards_over_its_mesh_or_the_current_one":
        "test_flax_attention_fn_shards_over_its_mesh_or_the_current_one",
    "tests/test_flash_pallas_tpu.py::test_invisible_blocks_are_skipped_not_masked":
        "test_tpu_grid.py::test_grid_steps_are_the_visible_tiles (the grid points the kernels execute)",
    "tests/test_operand_grads.py::test_forward_and_backward_with_the_table_compile_for_a_tpu[v5e]":
        "test_tpu_aot.py::test_mods_compile_into_our_mosaic_kernels + "
        "test_table_gradient_matches_the_float64_oracle (interpreted)",
    "tests/test_parallel.py::test_ring_hlo_permutes_and_never_gathers_the_sequence":
        "test_multislice.py::test_two_slice_dry_run_keeps_ring_and_tensor_collectives_on_ici + "
        "the ring in test_context_parallel's 8-device test",
    "tests/test_bench_profile.py::test_train_step_trace_names_the_impl":
        "test_attention_trace_is_written_and_names_the_impl",
    "tests/test_sharded_mods.py::test_traced_offsets_compile_for_a_tpu[v5e]":
        "test_a_shards_mods_see_global_rows_and_heads + "
        "test_tpu_aot.py::test_mods_compile_into_our_mosaic_kernels",
    "tests/test_host.py::test_demo_prints_no_libtpu_lines":
        "test_training.py::test_first_run_prints_no_libtpu_warnings",
    "tests/test_flash_pallas_tpu.py::test_bfloat16_gqa_head_dim_v":
        "test_conformance.py's bfloat16 flash_pallas-tpu cases (GQA, head_dim_v)",
}


# Grids whose dimensions are independent, cut by a covering array of strength 1 (every value of every
# dimension in some default-tier case): test function id -> its dimensions, each a parameter name or a
# tuple of names that vary together. Why each is independent is said beside it.
COVERINGS: dict[str, tuple] = {
    # A Mosaic compile per shape and per generation: the shape's kernels and FLOPs do not depend on the
    # generation beyond its tile table, which test_kernel_config.py and the vmem test hold per generation.
    "tests/test_tpu_aot.py::test_compiles_to_mosaic_kernels_with_analytic_flops": ("generation", "shape"),
    "tests/test_tpu_aot.py::test_jax_splash_compiles_to_splash_kernels": ("generation", "shape"),
    "tests/test_tpu_aot.py::test_decoding_queries_compile_to_the_split_kv_kernel": ("generation", "head_dim"),
    "tests/test_tpu_aot.py::test_mods_compile_into_our_mosaic_kernels": ("generation", "mods"),
    "tests/test_tpu_aot.py::test_gqa_forward_streams_kv_once_per_group": ("generation",),
    "tests/test_tpu_aot.py::test_a_decoding_step_compiles_to_our_mosaic_kernel": ("window", "cache_layout"),
    # A named mask_mod equals its built-in argument: the rule and the impl (or kernel family) meet only
    # through the mask, which every impl evaluates the same way (contract.mask_rules).
    "tests/test_mask_mods.py::test_named_mask_mods_equal_the_builtin_arguments": (("impl", "sizes"), "rule"),
    # Layer-level agreement per impl and per request: the request's features are each impl's own
    # conformance cases (test_conformance.py, every feature per impl in the default tier).
    "tests/test_layers.py::test_same_params_same_output_under_every_impl": (("impl", "kind"), "case"),
    # A decoding layer per impl, with and without a ring buffer: the buffer is the cache's (kv_cache.py),
    # the attention the impl's own decode case in test_conformance.py.
    "tests/test_decoding.py::test_linen_decoding_equals_the_uncached_layer": ("impl", "window"),
    "tests/test_decoding.py::test_a_heads_first_cache_decodes_like_the_uncached_layer": ("impl", "window"),
    # Paged attention per impl and per pool configuration: the configurations' features meet each impl's
    # kernel in test_paged_tpu.py / test_paged_gpu.py (every configuration there, in the default tier).
    "tests/test_paged.py::test_float32_matches_oracle": ("case", "name"),
    "tests/test_paged.py::test_bfloat16_within_twice_the_reference_impl_error": ("case", "name"),
    "tests/test_paged_tpu.py::test_compiles_to_our_mosaic_kernel": ("generation", "kv_dtype"),
    # Parity with transformers per impl and per checkpoint family: the impl's attention is its conformance
    # case, the family's layout is independent of it (test_models.py, test_export.py per family).
    "tests/test_hf_parity.py::test_matches_hugging_face_padded_and_packed": ("case", "name"),
    # The mask_mod path once per kernel family (each rule: the XLA impls above and the conformance mods).
    "tests/test_mask_mods.py::test_named_mask_mods_equal_the_builtin_arguments_in_our_kernels": ("family",),
    # The score_mod table's gradient per kernel family and per mask: the mask reaches the gradient only
    # through the visible pairs (each family's masks are its conformance cases).
    "tests/test_operand_grads.py::test_table_gradient_matches_the_float64_oracle":
        ("platform", ("causal", "prefix")),
}


def _value_id(value) -> str:
  return str(getattr(value, "name", value))


def covering_keeps(items: list) -> set[str]:
  """The node ids of COVERINGS' default-tier cases among `items` (collected pytest items).

  The covering array is built over every parametrization of the function, not only the collected
  ones, so a case's tier does not depend on the selection (`pytest file::test[id]` runs it in the
  tier a whole run gives it): the module (or class) of a function with a collected case is collected
  again, once, for all of its cases.
  """
  keep: set[str] = set()
  recollected: dict[str, list] = {}  # parent node id -> its items
  for function, dims in COVERINGS.items():
    cases = [i for i in items if i.nodeid.split("[")[0] == function and hasattr(i, "callspec")]
    if not cases:
      continue
    parent, name = cases[0].parent, cases[0].originalname
    if parent.nodeid not in recollected:
      recollected[parent.nodeid] = list(parent.collect())
    cases = [i for i in recollected[parent.nodeid] if getattr(i, "originalname", None) == name]
    dims = [d if isinstance(d, tuple) else (d,) for d in dims]
    coords = {i.nodeid: tuple(tuple(_value_id(i.callspec.params[n]) for n in d) for d in dims) for i in cases}
    values = [list(dict.fromkeys(c[k] for c in coords.values())) for k in range(len(dims))]
    for combo in covering(values):  # the first case with those values (others: second tier)
      keep.update(next(([n] for n, c in coords.items() if c == combo), []))
  return keep
