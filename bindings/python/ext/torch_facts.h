/*
 * torch_facts.h — the C interface between the _ferry extension and
 * _torchfacts_<torch version>, an optional C++ module built against one
 * torch's own headers (torch_facts.cpp). It reads what the pack and unpack
 * hooks need of a tensor straight from its at::Tensor, where the C path
 * calls four of torch's Python getters (each a few hundred instructions:
 * error and warning handling, a torch.Size built for the shape).
 *
 * The module is only loaded when its torch version is the running torch's
 * (ferry/torch.py picks it by name), and every read may decline (-1): the
 * hooks then take the getters, which also raise torch's own errors.
 */
#ifndef FERRY_TORCH_FACTS_H
#define FERRY_TORCH_FACTS_H

#include <stdint.h>

#define FERRY_FACTS_ABI 2
#define FERRY_FACTS_MAX_DIMS 8 /* = FERRY_MAX_DIMS */
#define FERRY_FACTS_CAPSULE "ferry._torchfacts.api"

typedef struct ferry_tensor_facts {
  int32_t scalar_type; /* c10::ScalarType */
  int32_t ndim;        /* at most FERRY_FACTS_MAX_DIMS */
  int64_t sizes[FERRY_FACTS_MAX_DIMS];
  void *data;          /* data_ptr(): the storage's bytes plus the offset */
  int64_t version;     /* the version counter, as Tensor._version */
  int32_t is_view;     /* 1: a view (Tensor._base is not None), 0: not */
} ferry_tensor_facts;

typedef struct ferry_facts_api {
  uint32_t abi;  /* FERRY_FACTS_ABI */
  uint32_t size; /* sizeof(ferry_facts_api) */
  /* tensor: an exact torch.Tensor or nn.Parameter (the caller checks the
   * type; anything else is undefined). Strided, not nested, with storage,
   * plain sizes and a version counter: 0 and *out filled; else -1 (never a
   * Python exception). */
  int (*read)(void *tensor, ferry_tensor_facts *out);
  /* The version counter alone (the same tensors): 0, or -1 (inference
   * tensors have none). */
  int (*version)(void *tensor, int64_t *out);
  /* A torch.dtype's c10::ScalarType, -1 if it is not one. */
  int (*scalar_type)(void *dtype);
} ferry_facts_api;

#endif
