#!/bin/sh
# usage: build.sh OUT extra-flags...
out=$1; shift
M=/work/main
gcc -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wstrict-prototypes -Wno-unused-parameter -Wno-comment -Werror -g -O1 "$@" \
  -I$M/engine/include -I$M/engine/src -I$M/tests \
  $M/engine/src/arena.c $M/engine/src/arena_jemalloc.c $M/engine/src/arena_pool.c $M/tests/test_arena.c main.c \
  -o $out -ljemalloc -lpthread -ldl -lm
