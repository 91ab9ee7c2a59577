/* errbuf.h — the one helper that writes a formatted message into a
 * caller's (errbuf, errlen) pair, as constructors report their failures. */
#ifndef FERRY_ERRBUF_H
#define FERRY_ERRBUF_H

#include <stddef.h>

/* Writes the message when errbuf is not NULL and errlen > 0; returns code. */
int ferry_errbuf(char *errbuf, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
