"""The ending the CLI tests share: each failure printed, then exit nonzero
when there was one, else the test's ok line."""
import sys


def finish(failures, ok_line):
    for f in failures:
        print("FAIL", f)
    if failures:
        sys.exit(f"{len(failures)} failure(s)")
    print(ok_line)
