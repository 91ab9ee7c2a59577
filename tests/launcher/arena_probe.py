"""Child process of the launcher tests: reports what a trainer started by
`ferry run` (or not) sees. Loads libferry with ctypes, as the Python binding
does, creates a host-backend engine with FERRY_ARENA_AUTO, offloads one
tensor through the arena and gets it back, and prints one JSON line:
  jemalloc_mapped   libjemalloc is mapped in this process (/proc/self/maps)
  arena             ferry_arena_name(): "jemalloc" or "pool"
  jemalloc_arenas_added  arenas jemalloc gained across engine creation
                    (None when jemalloc is absent): ferry's arena is one of them
  roundtrip_identical, bytes_d2h, arena_peak   the offload really used the arena
  env               the FERRY_* and LD_PRELOAD variables

usage: arena_probe.py LIBFERRY
"""
import ctypes
import json
import os
import sys

FERRY_MAX_DIMS = 8
FERRY_KIND_ACTIVATION = 0
FERRY_DTYPE_U8 = 11
FERRY_OFFLOAD = 1

ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))
RELEASE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


class Link(ctypes.Structure):
    _fields_ = [("d2h_bytes_per_s", ctypes.c_double), ("h2d_bytes_per_s", ctypes.c_double),
                ("latency_us", ctypes.c_double), ("duplex", ctypes.c_double)]


class TensorDesc(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint64), ("dtype", ctypes.c_int32), ("kind", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("flags", ctypes.c_uint32),
                ("shape", ctypes.c_int64 * FERRY_MAX_DIMS), ("layer", ctypes.c_int32),
                ("layer_count", ctypes.c_int32), ("phase", ctypes.c_int32),
                ("reserved0", ctypes.c_int32), ("module_path", ctypes.c_char_p),
                ("module_class", ctypes.c_char_p)]


class Decision(ctypes.Structure):
    _fields_ = [("action", ctypes.c_int32), ("reload", ctypes.c_int32),
                ("prefetch_distance", ctypes.c_int32), ("cacheable", ctypes.c_int32)]


DECIDE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(TensorDesc),
                             ctypes.c_void_p, ctypes.POINTER(Decision))


class Config(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("backend", ctypes.c_int32), ("device", ctypes.c_int32),
                ("arena", ctypes.c_int32), ("max_fwd_stash", ctypes.c_uint32),
                ("host_cap_bytes", ctypes.c_uint64), ("host_cap_pct", ctypes.c_double),
                ("min_offload_bytes", ctypes.c_uint64), ("prefetch_distance", ctypes.c_uint32),
                ("reserved0", ctypes.c_uint32), ("link", Link),
                ("device_alloc", ALLOC_FN), ("release", RELEASE_FN), ("retain", ctypes.c_void_p),
                ("callback_ud", ctypes.c_void_p), ("decide", DECIDE_FN),
                ("decide_ud", ctypes.c_void_p), ("policy_path", ctypes.c_char_p),
                ("policy_source", ctypes.c_char_p), ("policy_trusted", ctypes.c_int32),
                ("reserved1", ctypes.c_int32), ("trace_path", ctypes.c_char_p),
                ("host_reserve", ctypes.c_void_p), ("host_reserve_ud", ctypes.c_void_p),
                ("max_fwd_stash_bytes", ctypes.c_uint64), ("faults", ctypes.c_char_p),
                ("host_ram", ctypes.c_void_p), ("host_ram_ud", ctypes.c_void_p),
                ("release_when_copied", ctypes.c_int32),
                ("prefetch_at_backward_begin", ctypes.c_int32),
                ("knobs_fixed", ctypes.c_uint32),
                ("reserved2", ctypes.c_uint32), ("chrome_trace_path", ctypes.c_char_p),
                ("count_reasons", ctypes.c_int32), ("reserved3", ctypes.c_uint32)]


def jemalloc_mapped():
    with open("/proc/self/maps") as maps:
        return any("libjemalloc" in line for line in maps)


def jemalloc_narenas():
    """jemalloc's arena count, or None when jemalloc is not the allocator."""
    proc = ctypes.CDLL(None)
    if not hasattr(proc, "mallctl"):
        return None
    n = ctypes.c_uint(0)
    size = ctypes.c_size_t(ctypes.sizeof(n))
    if proc.mallctl(b"arenas.narenas", ctypes.byref(n), ctypes.byref(size), None, 0) != 0:
        return None
    return n.value


def main():
    lib = ctypes.CDLL(sys.argv[1])
    lib.ferry_arena_name.restype = ctypes.c_char_p
    lib.ferry_last_error.restype = ctypes.c_char_p

    cfg = Config()
    # The library writes only this mirror's bytes: it may lag the header's
    # newest fields (ferry_config_init_sized).
    if lib.ferry_config_init_sized(ctypes.byref(cfg), ctypes.c_size_t(ctypes.sizeof(Config))) != 0:
        sys.exit(f"arena_probe: ferry_config_init_sized refused {ctypes.sizeof(Config)} bytes")

    buffers = {}  # owner token -> ctypes buffer ("device" memory of the host backend)

    @ALLOC_FN
    def on_alloc(ud, nbytes, stream, ptr, owner):
        buf = ctypes.create_string_buffer(nbytes)
        token = len(buffers) + 1000
        while token in buffers:
            token += 1
        buffers[token] = buf
        ptr[0] = ctypes.addressof(buf)
        owner[0] = token
        return 0

    @RELEASE_FN
    def on_release(ud, owner):
        del buffers[owner]

    @DECIDE_FN
    def offload_everything(ud, desc, ctx, out):
        out[0].action = FERRY_OFFLOAD
        return 0

    cfg.device_alloc = on_alloc
    cfg.release = on_release
    cfg.decide = offload_everything
    cfg.max_fwd_stash = 0  # release the device buffer at once: unpack must reload

    arenas_before = jemalloc_narenas()
    engine = ctypes.c_void_p()
    err = ctypes.create_string_buffer(512)
    rc = lib.ferry_engine_create(ctypes.byref(cfg), ctypes.byref(engine), err, len(err))
    if rc != 0:
        sys.exit(f"arena_probe: ferry_engine_create failed ({rc}): {err.value.decode()}")
    arenas_after = jemalloc_narenas()

    nbytes = 256 * 1024
    pattern = bytes((i * 131 + 7) & 0xFF for i in range(nbytes))
    ptr, owner = ctypes.c_void_p(), ctypes.c_void_p()
    on_alloc(None, nbytes, None, ctypes.byref(ptr), ctypes.byref(owner))
    ctypes.memmove(ptr.value, pattern, nbytes)
    desc = TensorDesc(bytes=nbytes, dtype=FERRY_DTYPE_U8, kind=FERRY_KIND_ACTIVATION, ndim=1,
                      layer=0, layer_count=1)
    desc.shape[0] = nbytes
    handle = ctypes.c_uint64()
    lib.ferry_step_begin(engine)
    if lib.ferry_pack(engine, ctypes.byref(desc), ptr, owner, None, ctypes.byref(handle)) != 0:
        sys.exit("arena_probe: ferry_pack: " + lib.ferry_last_error(engine).decode())
    lib.ferry_backward_begin(engine)
    if lib.ferry_unpack(engine, handle, None, ctypes.byref(ptr), ctypes.byref(owner)) != 0:
        sys.exit("arena_probe: ferry_unpack: " + lib.ferry_last_error(engine).decode())
    identical = ctypes.string_at(ptr.value, nbytes) == pattern
    on_release(None, owner.value)
    lib.ferry_backward_end(engine)
    lib.ferry_step_end(engine)

    stats = (ctypes.c_uint64 * 64)()  # ferry_stats: uint64 fields, bytes_d2h 9th, arena_peak 15th
    lib.ferry_get_stats(engine, stats, ctypes.sizeof(stats))
    arena = lib.ferry_arena_name(engine).decode()
    lib.ferry_engine_destroy(engine)

    print(json.dumps({
        "jemalloc_mapped": jemalloc_mapped(),
        "arena": arena,
        "jemalloc_arenas_added": None if arenas_before is None else arenas_after - arenas_before,
        "roundtrip_identical": identical,
        "bytes_d2h": stats[8],
        "arena_peak": stats[14],
        "buffers_left": len(buffers),
        "pid": os.getpid(),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith("FERRY_") or k == "LD_PRELOAD"},
    }))


if __name__ == "__main__":
    main()
