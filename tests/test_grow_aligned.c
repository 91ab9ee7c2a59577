/* test_grow_aligned.c — issue 38 review: the stash's 64-byte entries are
 * grown with util_grow_aligned, since realloc keeps only malloc's 16-byte
 * alignment (glibc returns a large block at page + 16: each entry then
 * straddles two cache lines). Growth keeps the alignment and the contents. */
#include <stdint.h>

#include "../engine/src/util/util.h"
#include "test.h"

TEST(grow_aligned_keeps_alignment_and_contents) {
  /* 4096 is more than any malloc gives a 64-byte block by itself */
  static const size_t aligns[] = {64, 4096};
  for (int a = 0; a < 2; a++) {
    uint64_t *arr = NULL;
    uint32_t cap = 0, n = 0;
    for (uint32_t need = 1; need <= 100000; need = need * 3 + 1) {
      CHECK_EQ(util_grow_aligned((void **)&arr, &cap, 8 * sizeof *arr, need, 1, aligns[a]), 0);
      CHECK(cap >= need);
      CHECK_EQ((uintptr_t)arr % aligns[a], 0);
      for (uint32_t i = 0; i < n * 8; i++) CHECK_EQ(arr[i], (uint64_t)i * 2654435761u);
      for (uint32_t i = n * 8; i < need * 8; i++) arr[i] = (uint64_t)i * 2654435761u;
      n = need;
    }
    CHECK_EQ(util_grow_aligned((void **)&arr, &cap, 64, cap, 1, aligns[a]), 0); /* no growth */
    free(arr);
  }
  return 0;
}
