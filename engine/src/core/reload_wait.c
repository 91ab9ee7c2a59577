/*
 * reload_wait.c — an unpack that finds its entry being reloaded by another
 * thread waits for it here (stash.c calls it, the engine lock held; a
 * discard never waits). Its own file to keep stash.c under the size limit.
 */
#include "engine_internal.h"

/* Blocks until entry idx is no longer RELOADING; called and returns with
 * the lock held. With the embedder's wait_begin/wait_end the embedder's
 * global lock (Python's GIL) is let go meanwhile: the reloading thread,
 * inside device_alloc, may need it before it can finish. */
void stash_wait_reloading(ferry_engine *e, uint32_t idx) {
  while (e->entries[idx].state == ENTRY_RELOADING) {
    if (!e->cfg.wait_begin || !e->cfg.wait_end) {
      pthread_cond_wait(&e->reload_done, &e->lock);
      continue;
    }
    /* the embedder's lock goes and comes back without ours held: taking it
     * while holding ours would invert the order its threads take them in */
    pthread_mutex_unlock(&e->lock);
    void *token = e->cfg.wait_begin(e->cfg.callback_ud);
    pthread_mutex_lock(&e->lock);
    while (e->entries[idx].state == ENTRY_RELOADING) pthread_cond_wait(&e->reload_done, &e->lock);
    pthread_mutex_unlock(&e->lock);
    e->cfg.wait_end(e->cfg.callback_ud, token);
    pthread_mutex_lock(&e->lock);
  }
}
