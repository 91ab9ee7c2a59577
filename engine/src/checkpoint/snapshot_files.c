/*
 * snapshot_files.c — file-system helpers of checkpoint staging (staging.c):
 * the directory fsync after the rename, the umask, what a path is.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "snapshot_image.h"

/* The directory of path, for the fsync that makes the rename durable. */
int snap_fsync_parent_dir(const char *path) {
  const char *slash = strrchr(path, '/');
  char dir[PATH_MAX];
  if (!slash) {
    strcpy(dir, ".");
  } else if (slash == path) {
    strcpy(dir, "/");
  } else {
    size_t len = (size_t)(slash - path);
    if (len >= sizeof dir) return ENAMETOOLONG;
    memcpy(dir, path, len);
    dir[len] = '\0';
  }
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int rc = fsync(fd) ? errno : 0;
  close(fd);
  return rc;
}

/* The process's umask, read without changing it (umask() would, racily). */
mode_t snap_process_umask(void) {
  FILE *f = fopen("/proc/self/status", "r");
  unsigned mask = 022;
  char line[128];
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "Umask: %o", &mask) == 1) break;
  if (f) fclose(f);
  return (mode_t)mask;
}

const char *snap_file_type(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}
