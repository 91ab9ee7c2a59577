/* suggest.c — "did you mean": the closest of a list of names to a word. */
#include <string.h>

#include "ferry_tools.h"

#define MAX_WORD 64

/* Levenshtein distance of a and b (each at most MAX_WORD bytes). */
static size_t edit_distance(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  if (la > MAX_WORD || lb > MAX_WORD) return (size_t)-1;
  size_t row[MAX_WORD + 1];
  for (size_t j = 0; j <= lb; j++) row[j] = j;
  for (size_t i = 1; i <= la; i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= lb; j++) {
      size_t up = row[j];
      size_t best = diag + (a[i - 1] != b[j - 1]);
      if (up + 1 < best) best = up + 1;
      if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
      row[j] = best;
      diag = up;
    }
  }
  return row[lb];
}

const char *ferry_suggest(const char *word, const char *const *names, size_t n) {
  if (!word || !*word) return NULL;
  size_t limit = strlen(word) / 3 + 1; /* a typo, not another word */
  const char *best = NULL;
  size_t best_d = limit + 1;
  for (size_t i = 0; i < n; i++) {
    if (!names[i]) continue;
    size_t d = edit_distance(word, names[i]);
    if (d < best_d) best = names[i], best_d = d;
  }
  return best;
}
