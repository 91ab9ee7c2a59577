/*
 * sync_copies.c — the policy's sync_copies knob (ferry.h, FERRY_SYNC_*):
 * after the engine issues a copy, the compute stream waits for it (as a
 * copy on the compute stream makes later kernels wait: save_on_cpu with
 * pin_memory=True in torch 2.x, compilers that wait at issue), or the host
 * waits for it too (a blocking copy: save_on_cpu()'s .cpu() and
 * .to(device)); and the one_copy_stream knob, the stream a reload goes on.
 * Its own file to keep stash.c under the size limit.
 */
#include "engine_internal.h"

int stash_sync_copy(ferry_engine *e, bk_event *ev, void *compute_stream) {
  if (e->sync_copies == FERRY_SYNC_ASYNC) return FERRY_OK;
  const ferry_backend_ops *o = e->bk->ops;
  if (e->sync_copies == FERRY_SYNC_HOST) {
    /* the host's later launches come after the copy, so compute does too */
    e->stats.waits++;
    return o->event_synchronize(e->bk, ev);
  }
  return o->stream_wait_event(e->bk, compute_stream, ev);
}

/* The one_copy_stream knob: the peers that offload on a single side stream
 * (torchtune's and TRL's OffloadActivations, axolotl's hidden_states
 * offload, PyTorch's ao::offload/reload ops) put a reload behind the
 * offloads issued before it; with two streams it runs beside them. */
bk_stream stash_reload_stream(ferry_engine *e) { return e->one_copy_stream ? e->d2h : e->h2d; }
