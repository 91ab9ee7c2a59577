"""The `ferry` command of an installed package: runs the CLI binary that
travels in the wheel (ferry/bin/ferry), pointed at the package's policies."""
import os
import sys


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    exe = os.path.join(here, "bin", "ferry")
    if not os.access(exe, os.X_OK):
        sys.exit(f"ferry: the command's binary is missing at {exe}: this copy of the package was "
                 "not installed from a wheel (pip install .); use <build>/bin/ferry")
    policies = os.path.join(here, "policies")
    if os.path.isdir(policies):
        os.environ.setdefault("FERRY_POLICY_DIR", policies)
        os.environ.setdefault("FERRY_POLICY_LIBDIR", os.path.join(policies, "lib"))
    os.execv(exe, ["ferry"] + sys.argv[1:])


if __name__ == "__main__":
    main()
