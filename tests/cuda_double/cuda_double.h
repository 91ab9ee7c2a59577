/*
 * cuda_double.h — control API of the CUDA runtime TEST DOUBLE (libcudart_double).
 *
 * The double implements, on host threads, exactly the CUDA runtime entry
 * points ferry's cuda backend calls (plus cudaMalloc/cudaFree/cudaMemcpy for
 * the tests' "device" memory), with the real signatures from the toolkit's
 * cuda_runtime_api.h. Any other entry point is a link error in the double
 * build, so a new CUDA call in backend_cuda.c is a deliberate decision.
 *
 * Device memory is host memory; each stream is a worker thread that runs its
 * operations in order (copies really are asynchronous, and slowed by a
 * configurable delay so ordering bugs show); an event record is a completion
 * marker queued on its stream.
 *
 * Rules. Where real CUDA would corrupt data, crash or silently lose the
 * overlap ferry exists for, the double fails the call (an error code) AND
 * records a violation, printed to stderr at once. A process that exits with
 * violations not cleared by cuda_double_clear_violations() exits with status
 * 1, so any engine test in ferry_tests_cuda_double that breaks a rule fails.
 * The rules (each has a test in test_cuda_double.c):
 *   1. async copy to/from host memory that is not pinned (not inside a
 *      cudaHostAlloc block or a cudaHostRegister range). Real CUDA silently
 *      degrades it to a synchronous staged copy: no overlap.
 *   2. a copy whose device side is not inside a cudaMalloc block.
 *   3. a cudaMemcpyAsync direction other than DeviceToHost/HostToDevice.
 *   4. a stream used after cudaStreamDestroy, or a handle that was never a
 *      stream; destroying the default stream.
 *   5. an event used after cudaEventDestroy, or never created.
 *   6. cudaFreeHost / cudaHostUnregister / cudaFree of memory that a queued
 *      or running copy still reads or writes (real cudaFree and cudaFreeHost
 *      synchronize, but the embedder's caching allocator does not: ferry must
 *      release a buffer only after the event of the copy that reads it).
 *   7. cudaFreeHost of memory not from cudaHostAlloc, cudaHostUnregister of
 *      memory not registered, registering a range twice.
 *   8. cudaStreamWaitEvent on an event never recorded. Real CUDA treats this
 *      as a no-op that succeeds; the double flags it (and returns
 *      cudaErrorIllegalState) because in ferry it means a wait on a copy that
 *      was never issued: almost certainly an engine bug.
 *   9. two copies on different streams that touch the same bytes (at least
 *      one writing) with nothing ordering them: neither stream waited on an
 *      event recorded after the other copy (vector clocks over records and
 *      waits; checked while the earlier copy is still queued or running).
 *  10. cudaEventRecord of an event on a stream of another device.
 *  11. ferry's own conventions: streams created without
 *      cudaStreamNonBlocking, events created without cudaEventDisableTiming,
 *      cudaStreamWaitEvent flags other than 0.
 *  12. at exit: streams, events or pinned host memory never released.
 * Not a violation but modeled like the real runtime: cudaEventQuery's
 * cudaErrorNotReady is left in the thread's last-error slot (PyTorch clears
 * it too), so a test can check that ferry does not leak it to the embedder.
 *
 * Also: per-thread current device (new threads start on device 0), a
 * "no driver" switch (every call returns cudaErrorInsufficientDriver, as on
 * this project's CI machines), a device count, the
 * cudaDevAttrHostRegisterSupported answer, and failure injection.
 *
 * Not modeled: the implicit synchronization of the legacy default stream with
 * blocking streams (blocking streams are refused, rule 11) and with the
 * per-thread default stream; the double is stricter there, never laxer. As
 * on real CUDA, the legacy default stream orders nothing against the
 * non-blocking streams: work recorded there does not wait for theirs.
 */
#ifndef CUDA_DOUBLE_H
#define CUDA_DOUBLE_H

#include <cuda_runtime_api.h>
#include <stddef.h>

/* Violations recorded since the last clear, and the last one's message. */
long cuda_double_violations(void);
const char *cuda_double_last_violation(void);
void cuda_double_clear_violations(void);

/* Back to defaults: driver present, 1 device, host registration supported,
 * default copy delay, no injected failures, streams running; the calling
 * thread back on device 0 with no last error. Violations are kept. */
void cuda_double_reset(void);
/* 1: every entry point fails with cudaErrorInsufficientDriver. */
void cuda_double_set_no_driver(int on);
/* Devices visible (0..8); 0 makes cudaGetDeviceCount fail with NoDevice. */
void cuda_double_set_device_count(int n);
/* What cudaDeviceGetAttribute(cudaDevAttrHostRegisterSupported) answers. */
void cuda_double_set_host_register_supported(int on);
/* Each async copy sleeps this long before moving its bytes (default 50 us,
 * or CUDA_DOUBLE_COPY_DELAY_US from the environment). */
void cuda_double_set_copy_delay_us(unsigned us);
/* While paused, stream workers start no operation (deterministic "not yet"). */
void cuda_double_pause_streams(int paused);
/* Block until every stream's queue is empty (streams must not be paused). */
void cuda_double_drain(void);

/* The nth next call (1 = the next) of entry_point ("cudaMemcpyAsync")
 * returns err without doing anything. Up to 16 pending injections. */
void cuda_double_fail_call(const char *entry_point, int nth, cudaError_t err);
/* How many times entry_point was called since start. */
long cuda_double_calls(const char *entry_point);

/* The device a live stream/event belongs to, -1 if not a live one. NULL and
 * cudaStreamLegacy mean the legacy stream of the current device. */
int cuda_double_stream_device(cudaStream_t s);
int cuda_double_event_device(cudaEvent_t e);

/* 1 once device's primary context was made: by cudaSetDevice(device) (as
 * since CUDA 12: several hundred MB of that GPU) or by memory, a stream or
 * an event made while it was current; cuda_double_reset forgets them. The
 * backend reads the same state through cudaGetDriverEntryPointByVersion
 * ("cuDevicePrimaryCtxGetState"). */
int cuda_double_primary_context(int device);

typedef struct cuda_double_counts {
  long streams;        /* live streams created by cudaStreamCreateWithFlags */
  long events;         /* live events */
  long pinned_blocks;  /* cudaHostAlloc blocks + registered ranges */
  size_t pinned_bytes;
  long registered_ranges;
  long hostalloc_blocks;
  long device_blocks;  /* cudaMalloc blocks */
  size_t device_bytes;
  long ops_queued;     /* operations queued or running on all streams */
} cuda_double_counts;
void cuda_double_get_counts(cuda_double_counts *out);

/* Rule 12 now: a violation for each stream, event and pinned range still
 * held (the exit handler runs this). */
void cuda_double_check_leaks(void);

#endif
