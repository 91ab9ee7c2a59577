/* test_copy_knobs.h — what the copy-stream knob tests (test_sync_copies.c,
 * test_one_copy_stream.c) share: the lines of a hand-written two-layer
 * trace, an engine over the device under test with a policy's source, and
 * a 1-D u8 activation's descriptor. */
#ifndef FERRY_TEST_COPY_KNOBS_H
#define FERRY_TEST_COPY_KNOBS_H

#include <stdio.h>

#include "ferry.h"
#include "test_device.h"

#define TRACE_START                                                     \
  "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n" \
  "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"
#define BACKWARD_BEGIN "{\"ev\":\"backward_begin\",\"t_us\":0}\n"
#define TRACE_STOP \
  "{\"ev\":\"backward_end\",\"t_us\":0}\n{\"ev\":\"step_end\",\"t_us\":9,\"step\":1}\n"
#define PACK(id, bytes, layer)                                                              \
  "{\"ev\":\"pack\",\"t_us\":0,\"id\":" #id ",\"step\":1,\"bytes\":" #bytes ",\"dtype\":\"u8\"," \
  "\"shape\":[" #bytes "],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":" #layer "," \
  "\"layers\":2,\"decision\":\"offload\"}\n"
#define COMPUTE "{\"ev\":\"compute\",\"t_us\":0,\"us\":300}\n"
#define UNPACK(id) "{\"ev\":\"unpack\",\"t_us\":0,\"id\":" #id "}\n"

/* An engine over the device under test (test_engine_config, retaining
 * owners) run by policy_source; link_bytes_per_s, when not 0, sets the
 * link's speed both ways. Prints the engine's error. */
static inline int copy_knob_engine(const char *policy_source, test_device_stats *st,
                                   double link_bytes_per_s, ferry_engine **e) {
  ferry_config c = test_engine_config(st);
  c.retain = test_device_retain_cb;
  c.policy_source = policy_source;
  if (link_bytes_per_s) c.link.d2h_bytes_per_s = c.link.h2d_bytes_per_s = link_bytes_per_s;
  char err[512] = "";
  int rc = ferry_engine_create(&c, e, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  return rc;
}

/* A 1-D activation of bytes u8 elements. */
static inline ferry_tensor_desc u8_activation(size_t bytes) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_U8;
  d.kind = FERRY_KIND_ACTIVATION;
  d.ndim = 1;
  d.shape[0] = bytes;
  return d;
}

#endif
