#!/usr/bin/env python3
"""Fails when a CUDA kernel of the build spills registers beyond the list of known spills.

ptxas runs with --warn-on-spills; tools/ptxas_log.sh keeps each object's ptxas output as
<object>.ptxas.txt. This reads them all and compares the spills (kernel, spill stores, spill loads;
one line per architecture that spills) with csrc/cuda/spills_allowed.txt. A spill not listed, or
larger than listed, fails; a listed spill that is gone is reported so the list can shrink.

usage: check_spills.py BUILD_DIR ALLOWED_LIST
"""
import collections
import pathlib
import re
import shutil
import subprocess
import sys

SPILL = re.compile(r"Registers are spilled to local memory in function '([^']+)', (\d+) bytes spill stores, (\d+) bytes spill loads")


def canonical(names):
    """Demangled names without the per-file anonymous namespace (its hash changes with the path)."""
    if shutil.which("c++filt"):
        names = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return [re.sub(r"\(anonymous namespace\)::", "", n).replace(" ", "") for n in names]


def main():
    build, allowed_path = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    # this build tree's own objects (a nested build, e.g. pip's under build/wheel, has its own)
    logs = sorted(build.glob("CMakeFiles/**/*.ptxas.txt"))
    if not logs:
        print(f"no ptxas logs under {build}: build with tools/ptxas_log.sh as the CUDA compiler launcher")
        return 1
    found = []
    for log in logs:
        for m in SPILL.finditer(log.read_text(errors="replace")):
            found.append((m.group(1), int(m.group(2)), int(m.group(3))))
    names = canonical([f[0] for f in found])
    seen = collections.Counter((n, s, l) for n, (_, s, l) in zip(names, found))
    allowed = collections.Counter()
    for line in allowed_path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            stores, loads, name = line.split(None, 2)
            allowed[(name.replace(" ", ""), int(stores), int(loads))] += 1
    new = seen - allowed
    gone = allowed - seen
    print(f"{len(logs)} objects, {sum(seen.values())} spilling kernel builds, {sum(allowed.values())} listed as known")
    for (name, s, l), c in sorted(gone.items()):
        print(f"  gone (shrink the list): {s} {l} {name} x{c}")
    for (name, s, l), c in sorted(new.items()):
        print(f"  NEW SPILL: {s} bytes stores, {l} bytes loads in {name} x{c}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
