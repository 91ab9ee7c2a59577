/*
 * backend_cuda_absent.c — the cuda backend's constructor in a build made
 * without the CUDA toolkit: engines asking for it fail with a clear reason.
 */
#include <stdio.h>

#include "ferry_tools.h"

int ferry_backend_cuda_create(const ferry_config *cfg, ferry_backend **out,
                              char *errbuf, size_t errlen) {
  (void)cfg;
  if (out) *out = NULL;
  if (errbuf && errlen)
    snprintf(errbuf, errlen,
             "ferry was built without the cuda backend (no CUDA toolkit at "
             "configure time)");
  return FERRY_EUNSUPPORTED;
}
