#include <stdio.h>
#include <math.h>
#include <stdint.h>
#include <jemalloc/jemalloc.h>
static uint64_t r(uint64_t *s){*s^=*s<<13;*s^=*s>>7;*s^=*s<<17;return *s;}
int main(void){ uint64_t seed=20240601; double t=0,c=0,cp=0,psz=0;
 for(int i=0;i<300;i++){double u=(double)(r(&seed)>>11)/9007199254740992.0; size_t s=(size_t)(4096.0*pow(16384.0,u));
  size_t n=nallocx(s,0); t+=s; c+=n; cp+=n+(n>14336?4096:0); size_t e=n+(n>14336?4096:0); psz+= nallocx(e,0);}
 printf("class %.4f class+pad %.4f psz(class+pad) %.4f\n",c/t,cp/t,psz/t); }
