/* intern.h — a set of owned strings where equal strings share one copy, so
 * their pointers can be compared and hashed instead of their text. Used for
 * module paths and classes (engine, trace reader). Not thread-safe. */
#ifndef FERRY_INTERN_H
#define FERRY_INTERN_H

#include <stddef.h>

typedef struct intern_table {
  char **slots; /* open addressing, power-of-two size */
  size_t cap, count;
} intern_table;

/* The table's copy of s (made on first sight); NULL when out of memory. */
const char *intern_get(intern_table *t, const char *s);
/* Frees every string and the table's memory; the table is empty after. */
void intern_clear(intern_table *t);

#endif
