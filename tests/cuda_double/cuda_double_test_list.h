/* cuda_double_test_list.h — tests that exist only in ferry_tests_cuda_double
 * (test_cuda_double.c): the CUDA test double's rules, and the cuda backend
 * under failures only the double can inject. tests/test_list.h pulls this
 * list in when FERRY_TEST_CUDA_DOUBLE is defined; tests/cuda_double/
 * CMakeLists.txt registers each name with ctest. */
#define FERRY_CUDA_DOUBLE_TEST_LIST(X)                                     \
  X(cuda_double_rule_unpinned_async_copy)                                  \
  X(cuda_double_rule_device_memory_from_cudamalloc)                        \
  X(cuda_double_rule_copy_direction)                                       \
  X(cuda_double_rule_stream_after_destroy)                                 \
  X(cuda_double_rule_event_after_destroy)                                  \
  X(cuda_double_rule_free_during_copy)                                     \
  X(cuda_double_rule_pinned_pairs)                                         \
  X(cuda_double_rule_wait_on_unrecorded_event)                             \
  X(cuda_double_rule_unordered_copies)                                     \
  X(cuda_double_rule_record_on_other_device)                               \
  X(cuda_double_rule_ferry_conventions)                                    \
  X(cuda_double_rule_leaks_reported)                                       \
  X(cuda_double_streams_are_asynchronous)                                  \
  X(cuda_double_no_driver_and_injected_failures)                           \
  X(cuda_backend_maps_and_clears_errors)                                   \
  X(cuda_backend_uses_its_device_and_restores_the_threads)                 \
  X(cuda_backend_makes_no_context_on_another_device)                       \
  X(cuda_backend_pins_by_register_or_hostalloc)                            \
  X(cuda_engine_round_trip_over_double)
