/* test_list.h — the central list of C tests. X(name) registers test_name,
 * defined with TEST(name) in one of the tests/test_*.c files. ctest runs
 * each one as `ferry_tests NAME`. Keep each area's tests in its block. */
#define FERRY_TEST_LIST(X)                                                 \
  /* api: errors, version, config */                                       \
  X(errors_one_list)                                                       \
  X(version_matches_header)                                                \
  X(config_rejects_bad_values)                                             \
  X(number_parser_is_strict)                                               \
  X(api_refuses_null_and_bad_arguments)                                    \
  X(api_refuses_out_of_order_calls)                                        \
  /* the embedding contract (test_contract.c) */                           \
  X(contract_config_init_writes_only_the_callers_size)                     \
  X(contract_config_read_only_within_struct_size)                          \
  X(contract_refused_phase_call_changes_nothing)                           \
  X(contract_leak_counts_only_this_steps_handles)                          \
  X(contract_device_alloc_may_discard_an_alias)                            \
  X(contract_device_alloc_may_discard_what_it_prefetches)                  \
  X(contract_host_reserve_runs_without_the_engine_lock)                    \
  X(contract_last_policy_error_outlives_set_policy)                        \
  X(contract_last_error_read_by_threads)                                   \
  X(contract_destroyed_engine_is_refused)                                  \
  X(contract_config_size_inside_a_field_is_refused)                        \
  X(contract_config_huge_size_is_refused_unread)                           \
  X(contract_failed_creates_keep_destroyed_engines_quarantined)            \
  X(contract_trace_call_errors_read_by_threads)                            \
  X(contract_unpack_discarded_by_a_failing_device_alloc)                   \
  /* the message sink (test_log.c) */                                     \
  X(log_file_is_capped_and_rotated)                                        \
  X(log_counts_repeats_and_filters_levels)                                 \
  X(log_refuses_what_is_not_a_regular_file)                                \
  /* host RAM readings (test_ram.c) */                                     \
  X(ram_rules_see_the_host_ram_reading)                                    \
  X(ram_cap_cached_until_the_reading_crosses)                                    \
  X(ram_read_only_for_policies_that_read_it)                               \
  X(ram_percent_cap_is_of_the_reading)                                     \
  X(meminfo_reader_parses_and_refuses)                                     \
  /* stream ordering (test_ordering.c) */                                  \
  X(copies_wait_for_a_busy_compute_stream)                                 \
  /* issue 36's stream rules (test_stream_rules.c) */                      \
  X(backward_begin_prefetch_is_ordered_after_the_compute_stream)           \
  X(waiting_for_a_reload_lets_the_embedders_lock_go)                      \
  /* issue 36's engine API (test_alias_key.c) */                           \
  X(pack_keyed_aliases_only_the_same_storage_and_version)                  \
  X(stash_cold_fields_follow_growth_and_reuse)                  \
  X(grow_aligned_keeps_alignment_and_contents)                  \
  X(in_step_is_the_engines_own_flag)                                       \
  X(reloads_wait_for_the_compute_stream_before_writing)                    \
  /* FERRY_FLAG_RESIZABLE (test_resizable.c) */                             \
  X(resizable_pack_copies_before_it_returns)                               \
  /* fault injection (test_faults.c) */                                    \
  X(faults_lose_nothing)                                                   \
  X(faults_spec_is_checked)                                                \
  /* host backend (test_backend_host.c) */                                 \
  X(host_stream_runs_copies_in_order)                                      \
  X(host_event_never_recorded_is_complete)                                 \
  X(host_event_rerecord)                                                   \
  X(host_stream_wait_event_orders_streams)                                 \
  X(host_null_stream_wait_blocks)                                          \
  X(host_link_model_lower_bound)                                           \
  X(host_link_duplex_slows_both_directions)                                \
  X(host_alloc_alignment)                                                  \
  X(host_backend_rejects_bad_arguments)                                    \
  X(host_stream_destroy_drains)                                            \
  X(host_synchronize_runs_unstarted_copies)                               \
  X(host_stream_order_holds_while_waiters_help)                           \
  X(host_concurrent_record_query)                                          \
  X(host_concurrent_producers_fill_ring)                                   \
  /* @@backend_host */                                                     \
  /* arena (test_arena.c) */                                               \
  X(arena_kind_selection)                                                  \
  X(arena_round_trip_and_stats)                                            \
  X(arena_cap_is_hard)                                                     \
  X(arena_backend_failure_is_not_a_cap_refusal)                            \
  X(arena_steady_state_has_no_backend_calls)                               \
  X(arena_threads_allocate_and_free_concurrently)                          \
  X(arena_destroy_frees_live_allocations)                                  \
  X(arena_blocks_never_straddle_backend_allocations)                       \
  /* arena trim (test_arena_trim.c) */                                     \
  X(arena_trim_gives_free_memory_back)                                     \
  X(arena_trim_after_snapshot)                                             \
  X(arena_trim_while_threads_allocate)                                          \
  /* @@arena */                                                            \
  /* node budget (test_node_budget.c) */                                   \
  X(node_budget_two_handles_share_the_cap)                                 \
  X(node_budget_cap_is_never_exceeded)                                     \
  X(node_budget_reclaims_a_killed_process)                                 \
  X(node_budget_rejects_bad_arguments)                                     \
  /* @@node_budget */                                                      \
  /* stash manager (test_stash*.c) */                                      \
  X(stash_roundtrip_random)                                                \
  X(stash_roundtrip_any_order)                                             \
  X(stash_fwd_bound_and_release_after_event)                               \
  X(stash_released_when_copy_completes)                                    \
  X(stash_policy_knobs_release_and_tail_prefetch)                         \
  X(stash_prefetch_explicit_and_ahead)                                     \
  X(stash_alias_stored_once)                                               \
  X(stash_context_thresholds_and_alias_sizes)                              \
  X(stash_cap_keeps_on_device)                                             \
  X(stash_no_leak_10000_steps)                                             \
  X(stash_error_paths_lose_nothing)                                        \
  X(stash_backend_alloc_failure_keeps)                                     \
  X(stash_step_end_reports_leaks)                                          \
  X(stash_pack_unpack_on_two_threads)                                      \
  X(stash_recompute_during_backward)                                       \
  X(stash_shared_budget_hook)                                              \
  X(stash_fwd_bound_in_bytes)                                              \
  X(stash_fixed_knobs_win_over_the_policy)                                 \
  X(stash_breakdown_by_rule_and_layer)                                     \
  X(stash_cached_keep_without_handle)                                      \
  X(stash_cached_keep_on_two_threads)                                      \
  X(stash_policy_swapped_back_without_reload)                              \
  /* @@stash */                                                            \
  /* trace recorder (test_trace_recorder.c) */                             \
  X(trace_records_every_event)                                             \
  X(chrome_trace_times_copies_and_joins_them)                              \
  X(chrome_trace_one_file_per_engine)                                      \
  /* @@trace */                                                            \
  /* cuda backend (test_backend_cuda.c) */                                 \
  X(cuda_create_without_driver_is_enodev)                                  \
  X(cuda_backend_round_trip)                                               \
  X(cuda_backend_events_and_waits)                                         \
  X(cuda_backend_rejects_bad_arguments)                                    \
  /* only in ferry_tests_cuda_double: */                                   \
  FERRY_CUDA_DOUBLE_TEST_LIST(X)                                           \
  /* @@cuda */                                                             \
  /* checkpoint staging (test_snapshot*.c) */                              \
  X(snapshot_round_trip_random)                                            \
  X(snapshot_consistent_after_fence)                                       \
  X(snapshot_staging_waits_for_the_compute_stream)                         \
  X(snapshot_cap_holds_chunked)                                            \
  X(snapshot_error_unwritable_path)                                        \
  X(snapshot_error_write_fails_midway)                                     \
  X(snapshot_crash_keeps_previous)                                         \
  X(snapshot_engine_destroy_waits)                                         \
  X(snapshot_writer_threads_are_reused)                                    \
  X(snapshot_concurrent_pack_unpack)                                       \
  X(snapshot_zip64)                                                        \
  X(zip_crc32_matches_zlib)                                                \
  X(snapshot_torch_load)                                                   \
  X(snapshot_rejects_bad_input)                                            \
  X(snapshot_target_must_be_regular)                                       \
  X(snapshot_two_processes_one_path)                                       \
  X(snapshot_direct_on_disk)                                               \
  X(snapshot_direct_falls_back)                                            \
  X(snapshot_direct_layouts)                                               \
  X(snapshot_cap_of_the_device_bytes_stages_at_once)                      \
  /* @@snapshot */                                                         \
  /* checkpoint staging's write thread (test_snapshot_pipe.c) */           \
  X(snapshot_pipe_threads_overlap_writes)                                         \
  X(snapshot_pipe_threads_write_error)                                             \
  X(snapshot_pipe_off_writes_in_series)                                    \
  X(snapshot_pipe_threads_writer_fails_midway)                                    \
  X(snapshot_pipe_threads_two_at_once_then_destroy)                               \
  /* resident buffers (test_resident.c) */                                 \
  X(resident_round_trip_bit_identical)                                     \
  X(resident_cap_refusal)                                                  \
  X(resident_copies_are_ordered)                                           \
  X(resident_to_host_waits_for_the_callers_stream)                         \
  X(resident_destroy_with_copies_in_flight)                                \
  X(resident_rejects_misuse)                                               \
  X(resident_threads_share_an_engine)                                      \
  /* @@resident */                                                         \
  /* synchronous copies, the sync_copies knob (test_sync_copies.c) */       \
  X(sim_sync_copy_blocks_compute_by_its_copy_time)                        \
  X(sync_copies_engine_waits_for_each_copy)                               \
  X(sync_copies_compute_waits_before_overwriting_the_saved_buffer)        \
  /* one copy stream for both directions (test_one_copy_stream.c) */    \
  X(sim_one_copy_stream_queues_a_reload_behind_the_offloads)              \
  X(sim_policy_hidden_states_mirrors_axolotl)                             \
  X(one_copy_stream_engine_round_trips_the_bytes)                         \
  X(chrome_trace_one_copy_stream_follows_a_swapped_policy)                \
  X(sim_chrome_trace_names_the_one_stream_lane_by_the_knob)                \
  X(get_knobs_fills_every_byte_of_the_callers_size)                        \
  /* the simulator's cost terms (test_sim_cost.c) */                        \
  X(sim_copy_slows_a_concurrent_memory_bound_kernel)                      \
  X(sim_gpus_of_a_node_share_host_memory_bandwidth)                       \
  X(sim_host_overhead_counts_only_when_the_host_falls_behind)             \
  X(sim_host_runs_ahead_through_a_reload_stall)                           \
  X(sim_node_apply_shares_the_presets_node)                               \
  /* the stall floor's instants in backward (test_sim_floor.c) */          \
  X(sim_floor_holds_past_backwards_kept_unpacks)                          \
  X(sim_floor_counts_reloads_before_a_recompute_pack_once)                \
  X(sim_floor_takes_only_the_reloads_after_a_recompute_pack)              \
  X(sim_floor_counts_the_gpus_wait_for_the_host_as_hiding_time)           \
  X(sim_floor_counts_an_optimizer_transient_at_its_device_share)          \
  /* the error bands from the validation table (test_sim_bands.c) */         \
  X(sim_band_one_gpu_eager_long_context_picks_the_axolotl_rows)           \
  X(sim_band_eight_gpu_compiled_picks_the_compiled_rows)                  \
  X(sim_band_falls_back_to_all_rows_when_none_alike)                      \
  X(sim_band_class_from_the_trace_header)                                 \
  X(sim_band_lo_never_above_hi)                                           \
  X(sim_band_needs_two_publications_not_two_runs)                         \
  X(sim_band_none_for_optimizer_or_weight_offload)                        \
  X(sim_band_copy_bound_line_only_widens)                                 \
  X(sim_band_torchtitan_sweep_is_one_publication)                         \
  /* simulator (test_sim*.c) */                                            \
  X(sim_copy_takes_latency_plus_bytes_over_bandwidth)                   \
  X(trace_fast_parser_takes_written_lines)                              \
  X(trace_fast_parser_agrees_or_passes_on)                              \
  X(trace_fast_parser_strings_of_every_length)                          \
  X(trace_fast_parser_numbers_read_exactly)                             \
  X(trace_fast_parser_mutants_read_as_simdjson_reads)                  \
  X(trace_fast_parser_member_names_exactly)                            \
  X(trace_reader_remembered_names_are_exact)                           \
  X(trace_reader_owned_strings_stay_apart)                             \
  X(trace_reader_near_names_and_numbers_keep_their_errors)             \
  X(sim_trace_reader_refuses_escaped_nul)                               \
  X(sim_trace_load_refuses_escaped_nul)                                 \
  X(sim_trace_reader_takes_other_escapes)                               \
  X(sim_trace_escaped_nul_names_the_member_holding_it)                 \
  X(sim_duplex_slows_both_directions_exactly)                           \
  X(sim_stream_waits_for_compute_event)                                 \
  X(sim_wait_on_a_later_stream_starts_at_once)                          \
  X(sim_host_memory_is_address_space_only)                              \
  X(sim_trace_reader_names_line_and_problem)                            \
  X(sim_trace_errors_full_text_after_blank_lines)                       \
  X(sim_trace_reader_fast_and_cjson_paths_agree)                        \
  X(sim_trace_load_streams_what_parse_reads)                            \
  X(sim_trace_transient_alloc_and_free)                                 \
  X(sim_synth_matches_korthikanti_formula)                              \
  X(sim_synth_llama_shapes_and_sizes)                                   \
  X(sim_synth_saved_tensors_per_op_fused_and_eager)                     \
  X(sim_synth_checkpoint_modes_save_what_the_formulas_say)              \
  X(sim_synth_recompute_time_goes_to_backward)                          \
  X(sim_synth_selective_with_flash_is_refused)                          \
  X(sim_synth_presets_match_published_parameter_counts)                 \
  X(sim_synth_moe_router_and_experts)                                   \
  X(sim_synth_loss_working_set_full_and_chunked)                        \
  X(sim_synth_resident_knobs_match_hand_arithmetic)                     \
  X(sim_synth_tensor_parallel_matches_korthikanti)                      \
  X(sim_floor_holds_at_backwards_transients)                            \
  X(sim_untracked_from_device_peak)                                     \
  X(sim_replay_matches_hand_computed_times)                             \
  X(sim_replay_policies_on_synthesized_llama)                           \
  X(sim_link_presets_and_syntax)                                        \
  X(sim_consistent_with_host_backend)                                   \
  X(sim_fuzz_corpus_replays_clean)                                      \
  X(sim_budget_beats_default_on_llama3_8b)                                 \
  X(sim_host_ram_is_the_simulated_hosts)                                   \
  X(sim_pinned_pool_vs_no_pool)                                            \
  X(sim_warmup_steps_and_first_step)                                       \
  X(sim_fit_picks_the_cheapest_setting_that_fits)                          \
  X(sim_recorded_trace_flops_and_resident)                                 \
  X(sim_compute_roofline_hand_computed)                                    \
  X(sim_synth_compute_follows_the_simulated_gpu)                           \
  X(sim_recorded_trace_flops_all)                                          \
  X(sim_prefetch_starts_at_backward_begin)                                 \
  X(sim_cached_keep_starts_no_reload)                                      \
  X(sim_optimizer_fraction_zero_is_no_offload)                             \
  X(sim_optimizer_offload_frees_exactly_the_share)                         \
  X(sim_optimizer_offload_hand_computed_steps)                             \
  X(sim_trace_resident_layer_bytes)                                        \
  X(sim_weight_offload_hand_computed_steps)                                \
  X(sim_weight_offload_composes_with_activations)                          \
  X(sim_weight_offload_refusals_and_estimate)                              \
  /* issue 42: what the simulator models of an eager trainer (test_sim_model.c) */ \
  X(sim_synth_hook_sees_per_checkpoint_impl)                               \
  X(sim_steady_state_begins_after_the_arena_stopped_growing)               \
  X(sim_report_names_the_steady_steps_when_warmup_exceeds_steps)           \
  X(sim_synth_flash_backward_is_2_5x_forward)                              \
  X(sim_fits_is_exposed_capacity_less_the_allowance)                       \
  X(sim_block_backward_holds_saved_tensors_and_gradients)                  \
  X(sim_synth_optimizer_traffic_and_gpt3_preset)                           \
  X(sim_synth_gradients_appear_per_layer)                                  \
  X(sim_synth_fsdp_gathers_per_unit_and_frees_unsharded_gradients)        \
  X(sim_report_says_where_the_peak_falls)                                  \
  X(sim_peak_at_a_forward_pack_names_the_op_that_saved_it)                \
  X(sim_synth_fsdp_unsharded_gradients_in_the_compute_dtype)              \
  X(sim_synth_cp_quarters_activations_and_keeps_attention_flops)          \
  X(sim_policy_checkpointed_inputs_offloads_block_inputs_only)            \
  X(sim_optimizer_offload_shrinks_the_steps_transients)                    \
  X(sim_comm_fsdp_single_node_hides_gathers)                               \
  X(sim_comm_multi_node_exposes_computed_time)                             \
  X(sim_comm_nic_shares_pcie_with_offload_copies)                          \
  X(sim_comm_tensor_parallel_adds_its_time)                                \
  X(sim_comm_full_recompute_repeats_tensor_parallel_exchanges)             \
  X(sim_mfu_sensitivity_replays_at_both_rates)                             \
  X(sim_mfu_sensitivity_off_replays_once_and_says_so)                      \
  X(sim_chrome_trace_draws_one_stream_reloads_on_its_lane)                 \
  X(sim_comm_trace_errors)                                                 \
  X(sim_comm_more_nodes_than_ranks_refused)                               \
  X(sim_comm_across_nodes_uses_every_nic_of_a_node)                       \
  X(sim_comm_nic_share_ends_with_its_collective)                          \
  X(sim_fsdp_units_memory_and_lane_agree)                                 \
  X(sim_fsdp_units_root_on_the_lane)                                      \
  X(sim_fsdp_reduce_scatter_moves_what_backward_wrote)                    \
  X(sim_fsdp_tied_embedding_is_one_unit)                                  \
  X(sim_synth_ulysses_saves_flops_and_all_to_alls)                        \
  X(sim_synth_ulysses_needs_cp_to_divide_the_heads)                       \
  X(sim_synth_ulysses_without_cp_refused)                                 \
  /* @@sim */                                                              \
  /* policies by name (test_policy_files.c) */                             \
  X(policy_found_by_shipped_name)                                          \
  X(policy_dir_env_comes_first)                                            \
  X(suggest_finds_typos_only)                                              \
  /* policy host (test_policy*.c) */                                       \
  X(policy_sees_descriptor_and_context)                            \
  X(policy_fields_follow_every_tensor)                             \
  X(policy_rules_own_functions_get_the_views)                      \
  X(policy_rules_fields_follow_every_tensor)                       \
  X(policy_rules_own_functions_reentrant_decide)                   \
  X(policy_sandbox_refuses_escapes)                                \
  X(policy_refuses_bytecode)                                       \
  X(policy_runtime_errors_carry_file_line)                         \
  X(policy_load_errors)                                            \
  X(policy_api_version_mismatch)                                   \
  X(policy_bad_knobs)                                              \
  X(policy_nonsense_answers_kept)                                  \
  X(policy_runaway_loops_interrupted)                              \
  X(policy_wall_clock_and_c_functions_bounded)                               \
  X(policy_sandbox_globals_are_the_allow_list)                              \
  X(policy_env_limits_are_strict)                                           \
  X(policy_memory_bomb_stopped)                                    \
  X(policy_error_budget_disables)                                  \
  X(policy_site_cache)                                             \
  X(policy_trusted_gets_ffi)                                       \
  X(policy_require_library_modules)                                \
  X(policy_failed_reload_keeps_old)                                \
  X(policy_shipped_default_loads)                                  \
  X(policy_cli_check_exit_codes)                                   \
  X(policy_explain_hand_written)                                   \
  X(policy_explain_rules_lines)                                    \
  X(policy_snapshot_answers)                                       \
  X(policy_snapshot_faults_stage)                                  \
  X(policy_snapshot_rules_and_default)                             \
  X(policy_resident_hand_written)                                  \
  X(policy_resident_rules)                                         \
  /* the policy host's fast paths (test_policy_fastpath.c) */              \
  X(policy_fast_site_cache_keys_whole_site)                                \
  X(policy_fast_fields_keep_their_signs)                                   \
  X(policy_fast_recompute_kept_inline)                                     \
  X(policy_fast_frozen_answers_match_live)                                 \
  /* the pointer cache's slots (test_policy_ptr_cache.c) */                 \
  X(policy_ptr_cache_spreads_strided_strings)                              \
  X(policy_ptr_cache_two_slots_answer_by_content)                          \
  /* hostile policies (test_policy_hostile.c) */                           \
  X(policy_hostile_tostring_loop)                                          \
  X(policy_hostile_sort_c_comparator)                                      \
  X(policy_hostile_insert_position)                                        \
  X(policy_hostile_pattern_cost)                                           \
  X(policy_hostile_c_recursion)                                            \
  X(policy_needs_stated_stack)                                             \
  X(policy_hostile_globals_after_raw_set)                                  \
  X(policy_hostile_more)                                                   \
  X(policy_large_source_loads)                                             \
  /* @@policy */

/* Tests that exist only in ferry_tests_cuda_double (the CUDA test double's
 * rules); tests/cuda_double/CMakeLists.txt registers them with ctest. */
#ifdef FERRY_TEST_CUDA_DOUBLE
#include "cuda_double/cuda_double_test_list.h"
#else
#define FERRY_CUDA_DOUBLE_TEST_LIST(X)
#endif
