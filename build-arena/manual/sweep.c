#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include "arena.h"
typedef struct { ferry_backend base; uint64_t allocs; } bb_t;
static int ha(ferry_backend *b, size_t bytes, size_t al, void **out){ void *p=mmap(NULL,(bytes+4095)&~4095UL,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE,-1,0); if(p==MAP_FAILED)return -2; ((bb_t*)b)->allocs++; *out=p; return 0;}
static int hf(ferry_backend *b, void *p, size_t bytes){ munmap(p,(bytes+4095)&~4095UL); return 0;}
static const ferry_backend_ops ops={.name="x",.host_alloc=ha,.host_free=hf};
static uint64_t r(uint64_t *s){*s^=*s<<13;*s^=*s>>7;*s^=*s<<17;return *s;}
int main(int argc,char**argv){ int kind=atoi(argv[1]); int n=atoi(argv[2]); uint64_t seed=strtoull(argv[3],0,0); double hi=argc>4?atof(argv[4]):64.0*1048576; int jitter=argc>5?atoi(argv[5]):0;
 size_t *base=malloc(n*sizeof*base), *sz=malloc(n*sizeof*sz); void **p=malloc(n*sizeof*p);
 for(int i=0;i<n;i++){double u=(double)(r(&seed)>>11)/9007199254740992.0; base[i]=(size_t)(4096.0*pow(hi/4096.0,u));}
 bb_t bb={.base={.ops=&ops}}; ferry_arena *a; char e[256]; if(ferry_arena_create(&bb.base,kind,0,&a,e,256)){puts(e);return 1;}
 uint64_t a1=0; struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0);
 int steps = jitter ? 50 : 10;
 for(int s=0;s<steps;s++){ for(int i=0;i<n;i++){ sz[i]=base[i]; if(jitter) sz[i]+= r(&seed)%(base[i]/4+1); p[i]=ferry_arena_alloc(a,sz[i]); if(!p[i]){puts("fail");return 1;} }
   for(int i=n-1;i>=0;i--) ferry_arena_free(a,p[i],sz[i]);
   if(s==0) a1=bb.allocs; }
 clock_gettime(CLOCK_MONOTONIC,&t1);
 ferry_arena_stats st; ferry_arena_get_stats(a,&st);
 printf("kind %d n %d seed %llu jit %d: ratio %.4f allocs %llu after-warmup %llu  %.0f ms\n",kind,n,(unsigned long long)seed,jitter,(double)st.reserved/st.peak,(unsigned long long)bb.allocs,(unsigned long long)(bb.allocs-a1),(t1.tv_sec-t0.tv_sec)*1e3+(t1.tv_nsec-t0.tv_nsec)/1e6);
 ferry_arena_destroy(a); return 0; }
