#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include "arena.h"
static int ha(ferry_backend *b, size_t n, size_t al, void **out){ *out=mmap(NULL,(n+4095)&~4095UL,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); return 0;}
static int hf(ferry_backend *b, void *p, size_t n){ munmap(p,(n+4095)&~4095UL); return 0;}
static const ferry_backend_ops ops={.name="x",.host_alloc=ha,.host_free=hf};
int main(int argc,char**argv){ ferry_backend bk={.ops=&ops}; ferry_arena *a; ferry_arena_create(&bk,FERRY_ARENA_POOL,0,&a,NULL,0);
 volatile char *p=ferry_arena_alloc(a,1000); p[999]=1; printf("in bounds ok\n"); fflush(stdout);
 if(argc>1 && argv[1][0]=='u'){ ferry_arena_free(a,(void*)p,1000); p[0]=2; } else p[1000]=1;
 printf("not caught\n"); return 0;}
