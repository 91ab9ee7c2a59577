/* errors.c — names and messages of ferry's error codes, from the one list
 * in ferry.h, and the version functions. */
#include <stdarg.h>
#include <stdio.h>

#include "util/errbuf.h"
#include "ferry.h"

const char *ferry_strerror(int code) {
  switch (code) {
#define FERRY_MSG_(name, c, msg) case c: return msg;
    FERRY_ERRNO_MAP(FERRY_MSG_)
#undef FERRY_MSG_
  }
  return "unknown ferry error code";
}

const char *ferry_err_name(int code) {
  switch (code) {
#define FERRY_NAME_(name, c, msg) case c: return "FERRY_" #name;
    FERRY_ERRNO_MAP(FERRY_NAME_)
#undef FERRY_NAME_
  }
  return "FERRY_UNKNOWN";
}

#define FERRY_STR2_(x) #x
#define FERRY_STR_(x) FERRY_STR2_(x)

unsigned ferry_version(void) { return FERRY_VERSION_HEX; }

const char *ferry_version_string(void) {
  return FERRY_STR_(FERRY_VERSION_MAJOR) "." FERRY_STR_(FERRY_VERSION_MINOR) "." FERRY_STR_(
      FERRY_VERSION_PATCH);
}

int ferry_errbuf(char *errbuf, size_t errlen, int code, const char *fmt, ...) {
  if (errbuf && errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, errlen, fmt, ap);
    va_end(ap);
  }
  return code;
}
