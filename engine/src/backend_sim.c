/* backend_sim.c — the sim backend (virtual clock) is not part of this build
 * yet: the dry-run simulator issue adds it. Asking for it fails clearly. */
#include <stdio.h>

#include "backend.h"

int ferry_backend_sim_create(const ferry_config *cfg, ferry_backend **out, char *errbuf,
                             size_t errlen) {
  (void)cfg;
  *out = NULL;
  if (errbuf && errlen)
    snprintf(errbuf, errlen, "the sim backend is not available in this build of ferry");
  return FERRY_EUNSUPPORTED;
}
