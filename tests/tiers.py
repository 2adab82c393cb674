"""The fast tier: the tests ``python -m pytest -m fast`` runs (the README's test command).

Three tiers of one suite:

- ``python -m pytest -m fast``: a few cheap tests from every area users rely on, on meshes of 3 (uneven) and 8
  devices; minutes on 2 cores.
- ``python -m pytest``: the full default matrix (everything not marked slow; meshes of 1, 2, 3 and 8 devices).
- ``python -m pytest -m slow``: the heavy cases.

``FAST`` lists, per test file, the tests of the fast tier: ``name`` takes every parametrisation of a test,
``name[id]`` one of them, where ``*`` in the id matches any characters. tests/conftest.py marks the matching tests
``fast`` and refuses (a usage error at collection) an entry that names no test of its file, or a slow test.
"""

from __future__ import annotations

import re

FAST: dict[str, tuple[str, ...]] = {
    # Hugging Face checkpoints: a mapping with fused, transposed and concatenated tensors; the errors; --help.
    "test_safetensors.py": ("test_custom_ops_fused_qkv_heads_and_concat",),
    "test_safetensors_errors.py": (
        "test_error_missing_tensor_names_near_ones",
        "test_error_unexpected_tensor_unless_ignored",
        "test_error_index_names_absent_file",
    ),
    "test_examples_cli.py": ("test_help_answers_without_importing_jax[train_gpt.py]",),
    # Preemption and one run per checkpoint directory.
    "test_preemption.py": ("test_sigterm_in_one_process_names_the_next_step", "test_another_runs_steps_are_refused"),
    "test_train_gpt_checkpoints.py": ("test_resume_needs_a_directory_with_a_finished_step",),
    # The layer order and the census parser.
    "test_structure.py": ("test_no_import_cycle", "test_no_import_goes_up_a_layer"),
    # Planner and layouts (pure).
    "test_planner.py": (
        "test_whole_tensor_blocks_stay_on_one_device",
        "test_element_granularity_is_padding_free_up_to_alignment",
        "test_spanning_two_boundaries_forces_multiple_of_block",
        "test_invalid_input_names_the_index",
        "test_ragged_shard_derived_from_layout_matches_buffer_ranges",
    ),
    "test_tiles.py": (
        "test_storage_round_trip_matches_reference[8-8-*]",
        "test_plan_bucket_never_cuts_a_tile",
        "test_shard_unshard_bitwise[m3]",
    ),
    "test_tp_planner.py": ("test_grouping_matches_vj_plan[rows(1)-none-3-2]",),
    # Plan, shard / unshard.
    "test_plan.py": (
        "test_default_units_find_repeated_layers_wherever_they_sit",
        "test_shard_unshard_bit_exact[m3-*]",
        "test_shard_unshard_bit_exact[m8-rows(4)]",
        "test_padding_is_zero_and_leaves_sit_at_offsets[m3]",
        "test_blocks_never_cut[m3]",
        "test_whole_granularity_puts_each_leaf_on_one_device[m8]",
        "test_stacked_layer_group[m3]",
        "test_linen_and_nnx_trees[m3]",
        "test_plan_is_hashable_and_deterministic",
        "test_split_cuts_large_units_into_per_leaf_buckets[m3]",
        "test_error_non_array_leaf",
        "test_error_prng_key_leaf",
        "test_error_mesh_without_axis",
        "test_error_bad_granularity",
        "test_error_stacked_without_layer_dim",
        "test_error_tree_does_not_match_plan",
    ),
    "test_redistribute.py": (
        "test_to_and_from_ragged[m3-*]",
        "test_reshard_between_placements[m3-(23, 7)]",
        "test_reshard_is_one_all_to_all[m3]",
        "test_reshard_gradient_is_the_reverse_move[m3]",
        "test_ragged_shard_validation",
    ),
    "test_policies.py": (
        "test_init_opt_state_places_by_type",
        "test_place_batch_passes_placed_arrays_through[3-*]",
        "test_place_batch_checks_device_arrays",
    ),
    # vj.fsdp on NNX and Linen, point-of-use gathers, the gather and its reduce-scatter.
    "test_fsdp.py": (
        "test_nnx_matches_unsharded[m3-auto]",
        "test_params_not_matching_the_plan",
        "test_mesh_without_the_axis",
    ),
    # Model state and keyword inputs through vj.flax: BatchNorm over the global batch, the refusals.
    # Every transform a model uses (a Linen and an NNX lifted one), followed through to tell a handed-back
    # variable from an update.
    "test_transforms.py": (
        "test_construct_trains_as_unsharded[nnx.remat-module-argument-m3]",
        "test_construct_trains_as_unsharded[nn.remat-static_argnums-m3]",
        "test_a_real_update_inside_a_lifted_transform_is_refused[SwapsInsideJit-*]",
        "test_the_docs_table_is_this_matrix",
    ),
    "test_forwarding.py": (
        "test_forwarded_inputs_follow_lifted_transforms",
        "test_a_closed_over_value_is_not_an_input",
    ),
    "test_flax_state.py": (
        "test_nnx_batch_norm_matches_unsharded[plain-m3]",
        "test_linen_scan_over_stacked_group_is_refused",
        "test_state_update_that_differs_per_device_is_refused",
    ),
    # Statistics over the global batch, batch-free outputs, branches on the batch slice refused.
    "test_batch_statistics.py": (
        "test_moe_aux_loss_gradients_match_unsharded[m3]",
        "test_cond_on_a_per_device_mean_is_refused[m3]",
        "test_per_device_scalar_output_is_refused",
    ),
    "test_point_of_use.py": (
        "test_a_tied_bucket_gets_a_segment_per_use_when_the_layers_between_are_at_least_its_size",
        "test_a_stacked_group_between_two_uses_splits_a_tied_bucket",
        "test_gradients_match_unsharded_for_every_kind_of_use[m3-reshard]",
        "test_gradients_match_unsharded_for_every_kind_of_use[m8-keep]",
        "test_segments_are_affine_only_for_linear_uses",
        "test_a_leaf_the_model_returns_has_no_segment",
    ),
    "test_gather.py": (
        "test_gradients_match_unsharded_reference[m3]",
        "test_census_one_all_gather_and_one_reduce_scatter_per_bucket",
    ),
    "test_padding.py": ("test_a_nan_batch_leaves_padding_of_params_and_moments_zero[m3]",),
    # What runs on each device: draws from a replicated key.
    "test_random.py": (
        "test_closed_over_key_draws_the_unsharded_mask[3-typed]",
        "test_key_as_a_step_argument_trains_like_unsharded[8-raw]",
    ),
    # Mixed precision, accumulation, HSDP.
    "test_low_precision.py": (
        "test_bf16_leaf_gradient_matches_unsharded[3-True]",
        "test_default_reduce_dtype_of_low_precision_masters",
    ),
    "test_widening.py": ("test_bf16_leaf_inside_the_models_own_nnx_scan_trains_like_unsharded[3]",),
    "test_scale.py": (
        "test_master_dtype_is_checked",
        "test_microbatches_must_divide_the_batch",  # the accumulation equivalence (28 s) runs in the default matrix
        "test_hsdp_matches_unsharded_and_reduces_in_two_stages",
    ),
    # Optax over shards.
    "test_logical.py": ("test_shape_based_masks_and_labels_on_sharded_params_raise",),
    "test_optim_conformance.py": ("test_params_required",),
    # Muon, Shampoo, 8-bit AdamW.
    "test_muon.py": (
        "test_parity_element[3]",
        "test_run_tables_match_brute_force[3-None]",
        "test_rejects_unsharded_updates",
    ),
    "test_shampoo.py": (
        "test_parity_with_reference[3]",
        "test_blocks_cut_by_the_plan_are_rejected_with_the_fix",
        "test_update_has_no_parameter_sized_collective",
        "test_inverse_root_matches_numpy",
    ),
    "test_shampoo_reference.py": ("test_one_step_single_block_matches_svd", "test_errors"),
    "test_adam8bit.py": (
        "test_dynamic_code_is_monotone_with_zero_and_unit_levels",
        "test_inside_a_vj_fsdp_step",
        "test_element_granularity_that_cuts_a_block_is_refused_with_the_fix",
        "test_state_is_at_most_027_of_fp32_adamw[m3]",
    ),
    # FP8 gathers.
    "test_fp8_gather.py": (
        "test_gathered_weights_are_the_reference_quantizer_bit_for_bit[tiles-3]",
        "test_a_plan_that_cuts_a_tile_is_refused_naming_the_leaf_and_the_fix",
        "test_bad_fp8_block_is_rejected",
    ),
    "test_quant.py": ("test_quantize_matches_the_numpy_reference_bitwise", "test_error_is_bounded_by_half_a_step"),
    "test_fused_kernels.py": ("test_units_cover_every_element_once", "test_kernels_lower_for_cuda[quantize-triton]"),
    "test_kernels.py": (
        "test_pack_matches_reference_and_writes_padding[odd-*]",
        "test_unpack_matches_reference[odd-*]",
        "test_pack_errors",
        "test_unpack_errors",
        "test_choose_backend",
        "test_vector_width_follows_every_windows_alignment",
    ),
    # The Mosaic GPU kernels in Mosaic GPU's interpreter (skipped on a JAX without one).
    "test_mosaic_kernels.py": (
        "test_pack_and_unpack_match_the_references[small-unaligned-*]",
        "test_inside_shard_map_on_each_device_count",
    ),
    # Lowering for CUDA on CPU: the kernels follow the platform; explicit requests refused where they cannot run.
    # Every JAX / optax internal, pinned in each JAX line CI runs (JAX 0.10.2 and the newest).
    "test_compat.py": (
        "test_as_closed_closes_an_open_jaxpr",
        "test_astype_is_a_convert_with_its_dtype",
        "test_aval_varying_axes_reads_shard_map_types",
        "test_backends_are_initialized_does_not_start_them",
        "test_checkpoint_params_re_express_the_checkpoint",
        "test_cluster_types_are_detectors",
        "test_cond_branches_re_express_the_cond",
        "test_cond_while_scan_parts",
        "test_coordination_client_is_a_key_value_store",
        "test_distributed_job_before_initialize",
        "test_higher_order_equations_stay_whole_and_rebind",
        "test_internals_only_in_compat",
        "test_jaxpr_structure_is_the_public_one",
        "test_linearity_table",
        "test_literal_is_a_constant_atom",
        "test_mosaic_gpu_kernel_api_lowers_for_cuda_and_interprets",
        "test_muon_default_coeffs_are_optax_default",
        "test_muon_normalize_axes",
        "test_muon_preconditionings_and_orthogonalize_match_optax",
        "test_muon_presets_are_optax_strings",
        "test_nested_jaxprs_and_source",
        "test_nested_jit_is_a_nested_call_that_inlines",
        "test_optax_norms_map_in_their_own_frames",
        "test_call_body_is_the_equations_own_computation",
        "test_passes_values_through_copies_barriers_and_same_dtype_casts",
        "test_optax_per_leaf_code_runs_in_its_module",
        "test_optax_per_leaf_transforms_map_in_their_own_frames",
        "test_params_placeholder_is_what_map_params_passes",
        "test_partitionable_threefry_is_the_hash_of_flat_indices",
        "test_pcast_to_varying_is_pvary",
        "test_psum_names_and_varying_axes",
        "test_random_draws_are_random_bits_and_random_split",
        "test_rerun_nested_covers_scan_while_cond_remat_and_jit",
        "test_scan_counts_reads_both_forms",
        "test_scan_params_re_express_the_scan",
        "test_scan_re_expressed_keeps_values_and_gradients",
        "test_select_predicate_is_not_linear",
        "test_selections_are_recognised_and_rebind_on_fp32_copies",
        "test_shard_map_equations_rebind_inside_and_out",
        "test_tracers",
        "test_triton_lowering_target_lowers_inside_shard_map_without_a_gpu",
        "test_varying_axes_inside_shard_map",
        "test_views_are_recognised",
        "test_while_loop_rebinds",
    ),
    "test_cuda_lowering.py": (
        "test_kernels_follow_the_lowering_platform",
        "test_explicit_compiled_kernels_are_refused_for_cpu",
        "test_mosaic_takes_every_bucket",
        "test_mosaic_small_unaligned_leaves_lower_for_cuda",
    ),
    # Tensor parallelism.
    "test_tp.py": (
        "test_megatron_mlp_gradients_for_each_kernel_policy[xla]",
        "test_plan_description_names_the_groups",
    ),
    "test_tp_errors.py": (
        "test_bad_tp_raises_naming_the_leaf",
        "test_nnx_partition_specs_and_sharding_give_the_explicit_plan",
        "test_linen_logical_partitioning_with_rules",
    ),
    # Checkpoints and relayout.
    "test_checkpoint.py": (
        "test_round_trip_into_another_plan_is_bitwise[3to8]",
        "test_storage_split_rule",
        "test_mismatched_tree_raises_naming_the_leaf[recorded]",
        "test_corrupt_or_truncated_file_raises[flip]",
        "test_manager_keeps_max_to_keep_and_async_save_finishes",
    ),
    "test_relayout.py": (
        "test_relayout_round_trips_exactly[m8-m3-blocks]",
        "test_relayout_errors_name_the_key_and_shapes",
    ),
    # Multi-process start.
    "test_multihost.py": (
        "test_initialize_without_cluster_is_a_noop",
        "test_initialize_errors",
        "test_local_batch_slice",
    ),
    "test_distributed_failures.py": ("test_missing_process_and_coordinator_are_named",),
    # Error messages.
    "test_errors.py": ("test_error_names_the_thing",),
    "test_testing.py": (
        "test_replica_group_forms",
        "test_all_gather_count_bytes_and_wire",
        "test_replica_groups_mesh_form_with_device_ids",
        "test_replica_groups_of_compiled_programs_match_the_mesh",
    ),
    # Dependencies match imports; the README's snippet runs as shown.
    "test_packaging.py": (
        "test_the_package_imports_only_its_dependencies",
        "test_readme_tested_versions_are_the_pinned_ones",
    ),
    "test_pin_drift.py": ("test_read_junit_counts_and_gives_each_failure_its_first_error_line",),
    "test_snippets.py": ("test_snippets_run_as_shown[README.md]",),
}


def _entry_regex(entry: str) -> re.Pattern[str]:
    """``name`` or ``name[id]`` (``*`` in the id matching anything) as a regex over a test's ``item.name``."""
    name, bracket, ids = entry.partition("[")
    if not bracket:
        return re.compile(re.escape(name) + r"(\[.*\])?")
    return re.compile(re.escape(name) + r"\[" + ".*".join(map(re.escape, ids[:-1].split("*"))) + r"\]")


HEAVY: dict[str, tuple[str, ...]] = {
    # Heavy parametrisations moved from the default matrix to the slow tier (``-m slow``), entries as in FAST:
    # each costs 10-80 s of CPU, and a cheaper case of the same test (or a test of the same property) stays in
    # the default matrix.
    "test_snippets.py": (  # each page's snippets are checked in the slow tier; the other pages stay
        "test_snippets_run_as_shown[docs/devices.md]",
        "test_snippets_run_as_shown[docs/fsdp.md]",
        "test_snippets_run_as_shown[docs/checkpoint.md]",
        "test_snippets_run_as_shown[docs/kernels.md]",
        "test_snippets_run_as_shown[docs/offload.md]",
        "test_snippets_run_as_shown[docs/quant.md]",
        "test_snippets_run_as_shown[docs/huggingface.md]",
        "test_snippets_run_as_shown[docs/optax.md]",
        "test_snippets_run_as_shown[docs/raggedshard.md]",
        "test_snippets_run_as_shown[docs/planner.md]",
        "test_snippets_run_as_shown[docs/architecture.md]",
    ),
    "test_transforms.py": ("test_construct_trains_as_unsharded[*-m8]",),
    "test_planner.py": ("test_invariants_hold_on_random_instances",),
    "test_checkpoint_prepare.py": ("test_prepare_of_an_abstract_or_offloaded_state",),  # the concrete state stays
    "test_checkpoint_optim.py": (
        "test_low_precision_state_restores_in_its_own_dtype",
        "test_optimizer_state_restores_into_another_device_count[shampoo-m8-m3]",
    ),
    "test_adam8bit.py": (
        "test_bitwise_equal_to_the_logical_reference[m8-rows]",
        "test_bitwise_equal_to_the_logical_reference[m3-tiles]",
        "test_tiles_that_hold_several_blocks_and_padding",
        "test_padding_stays_zero_with_nan_gradients",
    ),
    "test_cuda_lowering.py": (
        "test_mosaic_mixed_precision",
        "test_mixed_precision_bf16[no-prefetch]",
        "test_optimizers[muon]",
        "test_optimizers[shampoo]",
        "test_hsdp_2x4[triton]",
        "test_fp8_gather",  # the fused FP8 kernels' own CUDA lowering stays (test_fused_kernels.py)
        "test_accumulate",
        "test_mosaic_step_exports_for_cuda",  # test_hsdp_2x4[mosaic_gpu] stays
    ),
    "test_fused_kernels.py": ("test_step_with_fused_kernels_is_bitwise_the_xla_step[fp8-m3]",),
    "test_watchdog.py": ("test_stopped_process_is_reported[coordinator]",),
    "test_logical.py": ("test_masks_partition_and_lamb_match_optax_on_the_logical_tree[m3]",),
    "test_flax_state.py": ("test_linen_batch_norm_matches_unsharded[m1]",),
    "test_fp8_gather.py": ("test_fp8_gather_sends_about_half_the_bf16_bytes",),
    "test_tp.py": (
        "test_tp_training_matches_unsharded[fsdp2xexpert4]",
        # moved with the Mosaic GPU tile-relayout tests: TP training stays in test_tp.py's other tests (the model
        # sees TP-local leaves, the Megatron MLP per kernel policy in the fast tier, the step nested in jit)
        "test_tp_training_matches_unsharded[fsdp2xtensor4]",
    ),
    "test_plan_travels.py": ("test_optax_wrappers_without_the_plan",),
    "test_scale.py": ("test_bf16_training_tracks_fp32",),
    "test_tp_optim.py": ("test_muon_parity_on_a_tp_plan[2x4]",),
    "test_relayout.py": ("test_trained_state_moves_to_another_plan[shampoo-m8-m3]",),
    "test_tiles.py": ("test_block_and_compact_layouts_of_a_tiles_plan_are_logical[3-2]",),
    "test_shampoo.py": (
        "test_large_blocks_on_eight_cpu_devices_do_not_deadlock",
        "test_shampoo_inside_a_vj_fsdp_step_matches_the_reference",  # test_tp_optim's stays
    ),
    "test_redistribute.py": ("test_reshard_between_placements[m8-*]",),
    "test_fsdp.py": (
        "test_census[keep]",
        "test_census[prefetch]",
        "test_pallas_kernels_on_the_gather_path_give_identical_gradients[reshard]",  # [keep] stays (17 s)
    ),
    # Moved when CI gained the fast tier on the newest JAX (its default matrix measured 1783 s, the whole run 2450 s):
    # each 20-40 s, a test of the same feature staying in the default matrix or the fast tier.
    "test_muon.py": (
        "test_muon_inside_a_vj_fsdp_step_matches_optax_unsharded",  # test_tp_optim's stays
        # Moved when the default matrix gained the checkpoint and Mosaic GPU tests of issues 41 / 42 (CI 2327 s):
        "test_parity_element[2]",  # [1] stays, [3] is in the fast tier
        "test_parity_element[8]",
    ),
    "test_checkpoint_speed.py": ("test_prepare_compiles_every_conversion_ahead",),  # test_checkpoint_prepare's stays
    # Moved to make room for the context-parallel and async-save tests (CI measured 2263 s, the bound 2400 s):
    "test_tp_checkpoint.py": ("test_tp_to_fsdp_only_and_back_with_adamw_is_bitwise",),  # tp-to-tp cases stay
    "test_hf_models.py": ("test_hf_flax_model_trains_under_fsdp_as_unsharded[gpt2-m3]",),  # llama-m8 stays
    "test_checkpoint.py": ("test_plain_orbax_restores_vj_params_into_an_nnx_model[moved]",),  # linen stays
    # Moved when the context-parallel tests of kept K/V, dropout and micro-batches came in (CI 2731 s on a busy
    # machine): the kept-K/V plain and prefetching loops and the regather path stay in the default matrix.
    "test_context.py": (
        "test_kept_or_regathered_kv_in_every_scan_path[layers-kept]",
        "test_a_context_parallel_run_restores_into_a_run_without_one_bit_for_bit",
        "test_context_parallel_steps_are_the_unsharded_models[3x2-rope-arange-packed]",  # 2x4-rope-arange stays
    ),
    # Moved when the any-dtype state and scanned-layer closure tests came in: the 3-device cases (and 8 for the
    # 8-bit round trip) stay in the default matrix.
    "test_state_dtypes.py": (
        "test_state_of_another_dtype_round_trips_through_a_checkpoint[adamw_fp32-m1]",
        "test_state_of_another_dtype_round_trips_through_a_checkpoint[adamw_fp32-m8]",
        "test_state_of_another_dtype_round_trips_through_a_checkpoint[adamw_8bit-m1]",
        "test_state_of_another_dtype_round_trips_through_a_checkpoint[shampoo-m1]",
        "test_state_of_another_dtype_round_trips_through_a_checkpoint[shampoo-m8]",
    ),
    "test_scan_closures.py": (
        "test_nnx_layers_closing_over_ints_give_the_unsharded_gradients[m1]",
        "test_nnx_layers_closing_over_ints_give_the_unsharded_gradients[m3-keep]",
    ),
    "test_offload.py": (
        "test_adamw_ten_steps_bitwise[m1]",
        "test_adamw_ten_steps_bitwise[m8]",
        "test_optimizers_bitwise[muon]",
        "test_optimizers_bitwise[shampoo]",
        "test_optimizers_bitwise[clipped_chain]",
        "test_hsdp_bitwise",
        "test_tensor_parallel_plan[layer]",
        "test_accumulation_bitwise",
        "test_optimizers_bitwise[adamw_8bit]",
        "test_optimizers_bitwise[masks_and_segment_norms]",
    ),
}


def heavy_entries() -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    """Per test file: each entry of ``HEAVY`` with its compiled pattern."""
    return {file: [(e, _entry_regex(e)) for e in entries] for file, entries in HEAVY.items()}


def fast_entries() -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    """Per test file: each entry of ``FAST`` with its compiled pattern."""
    return {file: [(e, _entry_regex(e)) for e in entries] for file, entries in FAST.items()}
