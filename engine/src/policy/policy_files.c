/* policy_files.c — where a policy named "default" lives: the folders of
 * ferry's shipped policies, found relative to libferry or the program that
 * holds it (installed, in a Python package, or the build tree's share/ link
 * to the source policies): no build path is compiled in (ferry_policy_find). */
#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ferry_tools.h"
#include "util/errbuf.h"

#define MAX_DIRS 16
#define MAX_NAMES 64

typedef struct policy_dirs {
  char dir[MAX_DIRS][PATH_MAX];
  int n;
} policy_dirs;

static int is_file(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static int is_dir(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Adds dir, as a real path ("<prefix>/share", not "<prefix>/bin/../share"), if
 * it is a folder. */
static void add_dir(policy_dirs *d, const char *dir) {
  char real[PATH_MAX];
  if (d->n < MAX_DIRS && dir && *dir && is_dir(dir) && realpath(dir, real))
    snprintf(d->dir[d->n++], PATH_MAX, "%s", real);
}

/* The folder of the library or program that holds this code. A program
 * linked with libferry statically is named as it was run ("ferry", found on
 * PATH): that name is no path, the kernel's /proc/self/exe is. */
static int code_dir(char *out, size_t n) {
  Dl_info info;
  if (!dladdr((void *)&ferry_policy_find, &info) || !info.dli_fname) return -1;
  char real[PATH_MAX];
  if ((!strchr(info.dli_fname, '/') || !realpath(info.dli_fname, real)) &&
      !realpath("/proc/self/exe", real))
    return -1;
  char *slash = strrchr(real, '/');
  if (!slash) return -1;
  *slash = 0;
  snprintf(out, n, "%s", real);
  return 0;
}

/* $FERRY_POLICY_DIR (colon-separated), <prefix>/share/ferry/policies beside
 * an installed (or build-tree) lib/ or bin/, policies/ beside a Python
 * package's module. */
static void find_dirs(policy_dirs *d) {
  d->n = 0;
  const char *env = getenv("FERRY_POLICY_DIR");
  if (env) {
    char copy[4096];
    snprintf(copy, sizeof copy, "%s", env);
    for (char *save = NULL, *p = strtok_r(copy, ":", &save); p; p = strtok_r(NULL, ":", &save))
      add_dir(d, p);
  }
  char here[PATH_MAX], buf[PATH_MAX + 64];
  if (code_dir(here, sizeof here) == 0) {
    snprintf(buf, sizeof buf, "%s/../share/ferry/policies", here);
    add_dir(d, buf);
    snprintf(buf, sizeof buf, "%s/policies", here);
    add_dir(d, buf);
  }
}

static int by_name(const void *a, const void *b) { return strcmp(a, b); }

/* Writes the shipped names ("budget, default, ...") of the found folders. */
static size_t list_names(const policy_dirs *d, char names[][64], size_t max) {
  size_t n = 0;
  for (int i = 0; i < d->n; i++) {
    DIR *dir = opendir(d->dir[i]);
    if (!dir) continue;
    for (struct dirent *ent; (ent = readdir(dir)) && n < max;) {
      size_t len = strlen(ent->d_name);
      if (len < 5 || len - 4 >= 64 || strcmp(ent->d_name + len - 4, ".lua")) continue;
      char name[64];
      snprintf(name, sizeof name, "%.*s", (int)(len - 4), ent->d_name);
      size_t k = 0;
      while (k < n && strcmp(names[k], name)) k++;
      if (k == n) snprintf(names[n++], 64, "%s", name);
    }
    closedir(dir);
  }
  qsort(names, n, sizeof names[0], by_name);
  return n;
}

int ferry_policy_find(const char *name, char *path, size_t pathlen, char *err, size_t errlen) {
  if (!name || !*name || !path || !pathlen)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "policy: no name given");
  if (is_file(name) || strchr(name, '/') || strstr(name, ".lua")) {
    if (!is_file(name))
      return ferry_errbuf(err, errlen, FERRY_ENOENT, "policy %s: no such file", name);
    if ((size_t)snprintf(path, pathlen, "%s", name) >= pathlen)
      return ferry_errbuf(err, errlen, FERRY_EINVAL, "policy %s: path too long", name);
    return FERRY_OK;
  }
  policy_dirs d;
  find_dirs(&d);
  for (int i = 0; i < d.n; i++) {
    char p[PATH_MAX + 80];
    snprintf(p, sizeof p, "%s/%s.lua", d.dir[i], name);
    if (is_file(p)) {
      if ((size_t)snprintf(path, pathlen, "%s", p) >= pathlen)
        return ferry_errbuf(err, errlen, FERRY_EINVAL, "policy %s: path too long", name);
      return FERRY_OK;
    }
  }
  char names[MAX_NAMES][64];
  const char *list[MAX_NAMES];
  size_t n = list_names(&d, names, MAX_NAMES);
  char shipped[512] = "";
  for (size_t i = 0; i < n; i++) {
    list[i] = names[i];
    size_t len = strlen(shipped);
    snprintf(shipped + len, sizeof shipped - len, "%s%s", i ? ", " : "", names[i]);
  }
  const char *close = ferry_suggest(name, list, n);
  char hint[96] = "";
  if (close) snprintf(hint, sizeof hint, "; did you mean '%s'?", close);
  return ferry_errbuf(err, errlen, FERRY_ENOENT,
                      "unknown policy '%s'%s (shipped: %s; or give a .lua path; "
                      "FERRY_POLICY_DIR adds folders)",
                      name, hint, n ? shipped : "none found");
}

int ferry_policy_libdir(char *out, size_t outlen) {
  policy_dirs d;
  find_dirs(&d);
  for (int i = 0; i < d.n; i++) {
    char probe[PATH_MAX + 32];
    snprintf(probe, sizeof probe, "%s/lib/ferry/rules.lua", d.dir[i]);
    if (is_file(probe) && (size_t)snprintf(out, outlen, "%s/lib", d.dir[i]) < outlen)
      return FERRY_OK;
  }
  return FERRY_ENOENT;
}
