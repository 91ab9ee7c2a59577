#include <stdio.h>
#include <string.h>
#define L(X) X(arena_kind_selection) X(arena_round_trip_and_stats) X(arena_cap_is_hard) X(arena_backend_failure_is_not_a_cap_refusal) X(arena_steady_state_has_no_backend_calls) X(arena_threads_allocate_and_free_concurrently) X(arena_destroy_frees_live_allocations)
#define D(n) int test_##n(void);
L(D)
int main(int argc,char**argv){int f=0;
#define R(n) if(argc<2||!strcmp(argv[1],#n)){int rc=test_##n();printf("%s %s\n",rc?"FAIL":"ok  ",#n);fflush(stdout);f+=rc;}
L(R)
return f;}
