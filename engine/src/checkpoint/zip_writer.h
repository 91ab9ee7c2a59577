/*
 * snapshot_zip.h — a streaming writer of zip archives with stored (not
 * compressed) entries, the container torch.save uses.
 *
 * Entries are written in order: begin (local header), data in any number of
 * pieces, end (the CRC-32 is patched into the local header, so no data
 * descriptor is needed), then finish writes the central directory. ZIP64
 * extra fields and end records are written where a size, an offset or the
 * entry count does not fit the classic fields. Each entry's data starts on a
 * 64-byte boundary (padding in an extra field, as torch.save does), so a
 * reader may map tensors in place.
 *
 * Errors are errno values (a positive int), with zip_writer.failed_op naming
 * the call that failed; the writer is then unusable.
 */
#ifndef FERRY_SNAPSHOT_ZIP_H
#define FERRY_SNAPSHOT_ZIP_H

#include <stddef.h>
#include <stdint.h>

#define ZIP_MAX_NAME 0xffff /* the name length field is 16 bits */

typedef struct zip_entry_info {
  uint64_t header_offset;
  uint64_t size;
  uint32_t crc;
  uint16_t name_len;
  char *name;
} zip_entry_info;

typedef struct zip_writer {
  int fd;
  uint64_t offset;         /* bytes of the archive produced so far */
  uint64_t flushed;        /* bytes of it already in the file */
  unsigned char *buf;      /* small writes are gathered here */
  size_t buf_len, buf_cap;
  zip_entry_info *entries;
  size_t n_entries, cap_entries;
  uint64_t written_in_entry; /* data bytes of the open entry so far */
  uint32_t crc;              /* running CRC-32 of the open entry */
  int open;                  /* an entry is between begin and end */
  const char *failed_op;     /* "write", "pwrite", ... after an error */
} zip_writer;

/* fd: a new, empty file opened for writing (not closed by the writer). */
int zipw_init(zip_writer *z, int fd);
/* Frees the writer's memory; does not close fd. */
void zipw_free(zip_writer *z);
int zipw_begin_entry(zip_writer *z, const char *name, uint64_t size);
int zipw_write(zip_writer *z, const void *data, size_t n);
/* EINVAL if fewer or more bytes than declared were written. */
int zipw_end_entry(zip_writer *z);
/* Central directory and end records; everything is in the file afterwards. */
int zipw_finish(zip_writer *z);

/* Values at or above this threshold are written as ZIP64 (default
 * 0xffffffff, the spec's). Tests lower it to exercise the ZIP64 paths with
 * small files; it applies to archives begun after the call. */
void zipw_set_zip64_threshold(uint64_t threshold);

#endif
