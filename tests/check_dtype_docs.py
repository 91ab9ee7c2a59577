#!/usr/bin/env python3
"""The dtypes docs/trace-format.md lists are the ones libferry names, in the
order of FERRY_DTYPE_LIST (ferry.h): the one table, checked against the docs.

Usage: check_dtype_docs.py LIBFERRY_SO DOC"""
import ctypes
import re
import sys


def library_dtypes(path):
    lib = ctypes.CDLL(path)
    lib.ferry_dtype_name.restype = ctypes.c_char_p
    lib.ferry_dtype_name.argtypes = [ctypes.c_int]
    names = []
    for code in range(1, 256):
        name = lib.ferry_dtype_name(code).decode()
        if name == "unknown":
            break
        names.append(name)
    return names + ["unknown"]


def documented_dtypes(doc):
    with open(doc, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\|\s*`dtype`\s*\|\s*string\s*\|\s*`([^`]*)`", line)
            if m:
                return m.group(1).split()
    return None


def main():
    lib, doc = sys.argv[1], sys.argv[2]
    have, said = library_dtypes(lib), documented_dtypes(doc)
    if said is None:
        print(f"{doc}: no `dtype` row found")
        return 1
    if have != said:
        print(f"{doc}: dtype row {' '.join(said)!r} differs from libferry's {' '.join(have)!r}")
        return 1
    print(f"{doc}: the {len(have)} dtypes match FERRY_DTYPE_LIST")
    return 0


if __name__ == "__main__":
    sys.exit(main())
