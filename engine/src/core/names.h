/* names.h — text names of ferry's enums, as written in traces, reports and
 * shown to policies' authors. Parsing returns -1 for an unknown name. */
#ifndef FERRY_NAMES_H
#define FERRY_NAMES_H

/* dtypes: ferry_dtype_name, ferry_dtype_size, ferry_dtype_from_name (ferry.h) */
const char *ferry_kind_name(int kind); /* "activation" */
int ferry_kind_parse(const char *s);
const char *ferry_phase_name(int phase); /* "forward" */
int ferry_phase_parse(const char *s);

#endif
