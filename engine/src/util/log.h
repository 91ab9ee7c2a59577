/* log.h — the engine's messages, through the sink ferry_log_open (ferry.h)
 * or FERRY_LOG_* configures (docs/embedding.md). */
#ifndef FERRY_LOG_H
#define FERRY_LOG_H

#include <stddef.h>

/* One message of level FERRY_LOG_* (no trailing newline); dropped above the
 * sink's level, counted if it repeats the previous one. */
void util_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Applies FERRY_LOG_* once; FERRY_EINVAL with a message naming the variable
 * and its value when one is wrong (every later call says the same). */
int util_log_check_env(char *err, size_t errlen);
/* On: this thread's info and warning messages are dropped, errors kept (a
 * simulator's extra replays, which would repeat the first one's lines).
 * Returns the previous setting. */
int util_log_quiet(int on);

#endif
