# ctest examples/trainer_cuda*: run the CUDA example and accept only its
# legitimate outcomes (see the exit statuses in trainer_cuda.c).
#   EXPECT=trained          exit 0, every tensor came back bit-identical
#   EXPECT=trained_or_nodev that, or exit 3: no usable driver or device, with
#                           the message naming FERRY_ENODEV and carrying CUDA's
#                           own text from the failed call, and nothing else
# Anything else (a crash, a mismatch, another error) fails.
execute_process(COMMAND ${TRAINER} --steps 2 --floats 65536
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
message("exit: ${rc}\nstdout:\n${out}\nstderr:\n${err}")
if(rc STREQUAL "0")
  if(NOT out MATCHES "every tensor came back bit-identical: yes")
    message(FATAL_ERROR "exit 0 without the bit-identical confirmation")
  endif()
elseif(rc STREQUAL "3" AND EXPECT STREQUAL "trained_or_nodev")
  if(NOT err MATCHES "^trainer_cuda: no usable CUDA device: FERRY_ENODEV: [^\n]*cuda[A-Za-z]+: [^\n]+\n$")
    message(FATAL_ERROR "exit 3 should print one line naming FERRY_ENODEV and the failed CUDA call")
  endif()
  if(out)
    message(FATAL_ERROR "the no-driver exit should print nothing on stdout")
  endif()
else()
  message(FATAL_ERROR "trainer_cuda exited with '${rc}'; expected 0 (trained)"
                      " or, with EXPECT=trained_or_nodev, 3 (no driver)")
endif()
