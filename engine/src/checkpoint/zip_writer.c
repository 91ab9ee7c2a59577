/*
 * zip_writer.c — the zip writer of checkpoint snapshots (ferry_tools.h).
 * Field layouts follow PKWARE's APPNOTE.TXT (sections 4.3.7 local file
 * header, 4.3.9 data descriptor, 4.3.12 central directory header, 4.3.14-16
 * end records, 4.5.3 ZIP64 extra field). All integers are little-endian.
 *
 * The choices within the format are those of torch.save's writer (torch's
 * PyTorchStreamWriter on miniz), so that a snapshot's file is byte for byte
 * the file torch.save writes for the same records (issue 37; torch's
 * loaders that compute storage offsets from the layout, torch.load(mmap=True)
 * with calculate_storage_offsets, depend on it): "version needed" and "made
 * by" 0, flags 0x0808 (UTF-8 names, a data descriptor after the data;
 * 0x0800 and no descriptor for an empty entry), no time or date, CRC and
 * sizes 0 in the local header and given in the data descriptor, ZIP64 extra fields holding only what overflows, and the ZIP64
 * end records always.
 */
#include "ferry_tools.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#define SIG_LOCAL 0x04034b50u
#define SIG_CENTRAL 0x02014b50u
#define SIG_END 0x06054b50u
#define SIG_END64 0x06064b50u
#define SIG_END64_LOCATOR 0x07064b50u
#define SIG_DATA_DESCRIPTOR 0x08074b50u
#define EXTRA_ZIP64 0x0001u
#define EXTRA_PADDING 0x4246u /* "FB": torch.save's alignment padding */
#define DATA_ALIGNMENT 64
#define END64_MADE_BY 0x031eu /* miniz's: Unix, spec 3.0 */
#define END64_NEEDED 45
#define FLAG_UTF8_NAME 0x0800u
#define FLAG_DESCRIPTOR 0x0008u /* CRC-32 and sizes in a data descriptor */
#define WRITE_BUFFER 65536
#define DIRECT_WRITE_MIN 16384 /* larger pieces skip the buffer */
/* A large piece is checksummed and written this much at a time, so that
 * write()'s copy into the page cache reads bytes the CRC just brought into
 * the cache instead of reading them from memory a second time. */
#define CRC_WRITE_SLICE ((size_t)256 << 10)

static _Atomic uint64_t zip64_threshold = 0xffffffffu;

void zipw_set_zip64_threshold(uint64_t threshold) {
  atomic_store(&zip64_threshold, threshold ? threshold : 0xffffffffu);
}

static uint64_t threshold(void) { return atomic_load(&zip64_threshold); }

/* ---- CRC-32 --------------------------------------------------------------
 * zlib 1.2.13 (Debian 12) computes CRC-32 at about 2.5 GB/s of one core;
 * libdeflate's, which uses PCLMULQDQ where the CPU has it, at about 6 GB/s
 * on the development VM (bench/README.md): for a 256 MiB snapshot that is
 * 100 ms of the writer's CPU against 43. Same polynomial and conventions
 * (the running CRC in, 0 to start). libdeflate.so.0 is looked up at run time,
 * as jemalloc is (Debian's libdeflate0, no header needed); zlib when it is
 * absent or FERRY_CRC32=zlib. */
typedef uint32_t (*crc32_fn)(uint32_t crc, const void *data, size_t n);
static crc32_fn fast_crc32;
static pthread_once_t crc32_once = PTHREAD_ONCE_INIT;

static void crc32_lookup(void) {
  const char *want = getenv("FERRY_CRC32");
  if (want && strcmp(want, "zlib") == 0) return;
  void *lib = dlopen("libdeflate.so.0", RTLD_NOW | RTLD_LOCAL);
  if (lib) fast_crc32 = (crc32_fn)dlsym(lib, "libdeflate_crc32"); /* kept open */
}

const char *zipw_crc32_impl(void) {
  pthread_once(&crc32_once, crc32_lookup);
  return fast_crc32 ? "libdeflate" : "zlib";
}

uint32_t zipw_crc32(uint32_t crc, const void *data, size_t n) {
  pthread_once(&crc32_once, crc32_lookup);
  if (fast_crc32) return fast_crc32(crc, data, n);
  return (uint32_t)crc32_z(crc, data, n);
}

/* ---- little-endian encoding -------------------------------------------- */
static unsigned char *put16(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)v;
  p[1] = (unsigned char)(v >> 8);
  return p + 2;
}
static unsigned char *put32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
  return p + 4;
}
static unsigned char *put64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
  return p + 8;
}

/* ---- output -------------------------------------------------------------- */
static int write_all(zip_writer *z, const void *data, size_t n) {
  const unsigned char *p = data;
  while (n) {
    ssize_t w = write(z->fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      z->failed_op = "write";
      return errno;
    }
    if (w == 0) { /* cannot happen for a regular file; never spin */
      z->failed_op = "write";
      return EIO;
    }
    p += w;
    n -= (size_t)w;
    z->flushed += (uint64_t)w;
  }
  return 0;
}

static int flush(zip_writer *z) {
  if (!z->buf_len || z->fd < 0) return 0; /* memory mode: the caller takes them */
  int rc = write_all(z, z->buf, z->buf_len);
  z->buf_len = 0;
  return rc;
}

static int emit(zip_writer *z, const void *data, size_t n) {
  int rc;
  if (z->fd < 0) { /* memory mode: everything gathers until taken */
    if (z->buf_len + n > z->buf_cap) {
      size_t ncap = z->buf_cap * 2 > z->buf_len + n ? z->buf_cap * 2 : z->buf_len + n;
      unsigned char *nb = realloc(z->buf, ncap);
      if (!nb) {
        z->failed_op = "malloc";
        return ENOMEM;
      }
      z->buf = nb;
      z->buf_cap = ncap;
    }
    memcpy(z->buf + z->buf_len, data, n);
    z->buf_len += n;
  } else if (n >= DIRECT_WRITE_MIN) {
    if ((rc = flush(z)) || (rc = write_all(z, data, n))) return rc;
  } else {
    if (z->buf_len + n > z->buf_cap && (rc = flush(z))) return rc;
    memcpy(z->buf + z->buf_len, data, n);
    z->buf_len += n;
  }
  z->offset += n;
  return 0;
}

/* ---- the archive -------------------------------------------------------- */
int zipw_init(zip_writer *z, int fd) {
  memset(z, 0, sizeof *z);
  z->fd = fd;
  z->buf = malloc(WRITE_BUFFER);
  if (!z->buf) {
    z->failed_op = "malloc";
    return ENOMEM;
  }
  z->buf_cap = WRITE_BUFFER;
  return 0;
}

void zipw_free(zip_writer *z) {
  for (size_t i = 0; i < z->n_entries; i++) free(z->entries[i].name);
  free(z->entries);
  free(z->buf);
  z->entries = NULL;
  z->buf = NULL;
  z->n_entries = z->cap_entries = 0;
}

static uint32_t entry_flags(const zip_entry_info *e) {
  return e->size ? FLAG_UTF8_NAME | FLAG_DESCRIPTOR : FLAG_UTF8_NAME;
}

int zipw_begin_entry(zip_writer *z, const char *name, uint64_t size) {
  size_t len = strlen(name);
  if (z->open || len == 0 || len > ZIP_MAX_NAME) {
    z->failed_op = z->open ? "begin_entry (an entry is open)" : "begin_entry (name length)";
    return EINVAL;
  }
  if (z->n_entries == z->cap_entries) {
    size_t ncap = z->cap_entries ? z->cap_entries * 2 : 64;
    zip_entry_info *n = realloc(z->entries, ncap * sizeof *n);
    if (!n) {
      z->failed_op = "malloc";
      return ENOMEM;
    }
    z->entries = n;
    z->cap_entries = ncap;
  }
  zip_entry_info *e = &z->entries[z->n_entries];
  e->name = malloc(len + 1);
  if (!e->name) {
    z->failed_op = "malloc";
    return ENOMEM;
  }
  memcpy(e->name, name, len + 1);
  e->name_len = (uint16_t)len;
  e->header_offset = z->offset;
  e->size = size;
  e->crc = 0;
  z->n_entries++;

  /* a ZIP64 extra field with the sizes and/or the offset that overflow;
   * with one, the data descriptor's sizes are 64-bit */
  uint64_t thr = threshold();
  int big_size = size >= thr, big_offset = e->header_offset >= thr;
  e->zip64 = big_size || big_offset;
  size_t z64_len = e->zip64 ? 4 + (big_size ? 16 : 0) + (big_offset ? 8 : 0) : 0;
  uint64_t before_pad = z->offset + 30 + len + z64_len + 4;
  size_t pad = (size_t)((DATA_ALIGNMENT - before_pad % DATA_ALIGNMENT) % DATA_ALIGNMENT);

  unsigned char h[30 + 28 + 4 + DATA_ALIGNMENT], *p = h;
  p = put32(p, SIG_LOCAL);
  p = put16(p, 0); /* version needed */
  p = put16(p, entry_flags(e));
  p = put16(p, 0); /* stored */
  p = put16(p, 0); /* time */
  p = put16(p, 0); /* date */
  p = put32(p, 0); /* CRC-32 and sizes: in the data descriptor */
  p = put32(p, 0);
  p = put32(p, 0);
  p = put16(p, (uint32_t)len);
  p = put16(p, (uint32_t)(z64_len + 4 + pad));
  int rc = emit(z, h, (size_t)(p - h));
  if (!rc) rc = emit(z, name, len);
  if (rc) return rc;
  p = h;
  if (e->zip64) {
    p = put16(p, EXTRA_ZIP64);
    p = put16(p, (uint32_t)(z64_len - 4));
    if (big_size) { /* torch.save's: the compressed size left 0 here */
      p = put64(p, size);
      p = put64(p, 0);
    }
    if (big_offset) p = put64(p, e->header_offset);
  }
  p = put16(p, EXTRA_PADDING);
  p = put16(p, (uint32_t)pad);
  memset(p, 'Z', pad);
  p += pad;
  if ((rc = emit(z, h, (size_t)(p - h)))) return rc;
  z->open = 1;
  z->written_in_entry = 0;
  z->crc = 0;
  return 0;
}

static int check_data(zip_writer *z, size_t n) {
  if (!z->open) {
    z->failed_op = "write_entry (no entry is open)";
    return EINVAL;
  }
  const zip_entry_info *e = &z->entries[z->n_entries - 1];
  if (n > e->size - z->written_in_entry) {
    z->failed_op = "write_entry (more bytes than declared)";
    return EINVAL;
  }
  return 0;
}

int zipw_place(zip_writer *z, const void *data, size_t n) {
  int rc = check_data(z, n);
  if (rc) return rc;
  if (z->fd >= 0) {
    z->failed_op = "place (not in memory mode)";
    return EINVAL;
  }
  if (data && n) z->crc = zipw_crc32(z->crc, data, n);
  z->written_in_entry += n;
  z->offset += n;
  return 0;
}

int zipw_write(zip_writer *z, const void *data, size_t n) {
  int rc0 = check_data(z, n);
  if (rc0) return rc0;
  if (!n) return 0;
  const unsigned char *p = data;
  z->written_in_entry += n;
  int rc = 0;
  while (n && !rc) {
    size_t take = n > CRC_WRITE_SLICE ? CRC_WRITE_SLICE : n;
    z->crc = zipw_crc32(z->crc, p, take);
    rc = emit(z, p, take);
    p += take;
    n -= take;
  }
  return rc;
}

int zipw_end_entry(zip_writer *z) {
  if (!z->open) {
    z->failed_op = "end_entry (no entry is open)";
    return EINVAL;
  }
  zip_entry_info *e = &z->entries[z->n_entries - 1];
  if (z->written_in_entry != e->size) {
    z->failed_op = "end_entry (fewer bytes than declared)";
    return EINVAL;
  }
  z->open = 0;
  e->crc = z->crc;
  if (!e->size) return 0; /* an empty entry has no descriptor */
  unsigned char d[24], *p = d;
  p = put32(p, SIG_DATA_DESCRIPTOR);
  p = put32(p, e->crc);
  if (e->zip64) {
    p = put64(p, e->size);
    p = put64(p, e->size);
  } else {
    p = put32(p, (uint32_t)e->size);
    p = put32(p, (uint32_t)e->size);
  }
  return emit(z, d, (size_t)(p - d));
}

int zipw_finish(zip_writer *z) {
  if (z->open) {
    z->failed_op = "finish (an entry is open)";
    return EINVAL;
  }
  uint64_t thr = threshold();
  uint64_t cd_start = z->offset;
  int rc;
  for (size_t i = 0; i < z->n_entries; i++) {
    const zip_entry_info *e = &z->entries[i];
    int big_size = e->size >= thr, big_offset = e->header_offset >= thr;
    size_t z64_fields = (big_size ? 2 : 0) + (big_offset ? 1 : 0);
    size_t extra_len = z64_fields ? 4 + 8 * z64_fields : 0;
    unsigned char h[46 + 4 + 24], *p = h;
    p = put32(p, SIG_CENTRAL);
    p = put16(p, 0); /* made by */
    p = put16(p, 0); /* version needed */
    p = put16(p, entry_flags(e));
    p = put16(p, 0); /* stored */
    p = put16(p, 0); /* time */
    p = put16(p, 0); /* date */
    p = put32(p, e->crc);
    p = put32(p, big_size ? 0xffffffffu : (uint32_t)e->size);
    p = put32(p, big_size ? 0xffffffffu : (uint32_t)e->size);
    p = put16(p, e->name_len);
    p = put16(p, (uint32_t)extra_len);
    p = put16(p, 0); /* comment */
    p = put16(p, 0); /* disk */
    p = put16(p, 0); /* internal attributes */
    p = put32(p, 0); /* external attributes */
    p = put32(p, big_offset ? 0xffffffffu : (uint32_t)e->header_offset);
    if ((rc = emit(z, h, (size_t)(p - h))) || (rc = emit(z, e->name, e->name_len))) return rc;
    if (z64_fields) {
      /* Only the fields that overflowed, in the spec's order. */
      p = h;
      p = put16(p, EXTRA_ZIP64);
      p = put16(p, (uint32_t)(8 * z64_fields));
      if (big_size) {
        p = put64(p, e->size);
        p = put64(p, e->size);
      }
      if (big_offset) p = put64(p, e->header_offset);
      if ((rc = emit(z, h, (size_t)(p - h)))) return rc;
    }
  }
  uint64_t cd_size = z->offset - cd_start;
  uint64_t n = z->n_entries;
  unsigned char h[56 + 20 + 22], *p = h;
  { /* the ZIP64 end records, always (torch.save's) */
    uint64_t end64_at = z->offset;
    p = put32(p, SIG_END64);
    p = put64(p, 44); /* size of the rest of this record */
    p = put16(p, END64_MADE_BY);
    p = put16(p, END64_NEEDED);
    p = put32(p, 0);
    p = put32(p, 0);
    p = put64(p, n);
    p = put64(p, n);
    p = put64(p, cd_size);
    p = put64(p, cd_start);
    p = put32(p, SIG_END64_LOCATOR);
    p = put32(p, 0);
    p = put64(p, end64_at);
    p = put32(p, 1);
  }
  p = put32(p, SIG_END);
  p = put16(p, 0);
  p = put16(p, 0);
  p = put16(p, n >= 0xffff ? 0xffffu : (uint32_t)n);
  p = put16(p, n >= 0xffff ? 0xffffu : (uint32_t)n);
  p = put32(p, cd_size >= thr ? 0xffffffffu : (uint32_t)cd_size);
  p = put32(p, cd_start >= thr ? 0xffffffffu : (uint32_t)cd_start);
  p = put16(p, 0); /* comment */
  if ((rc = emit(z, h, (size_t)(p - h)))) return rc;
  return flush(z);
}
