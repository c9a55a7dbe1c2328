#!/usr/bin/env python3
"""Summarises the SASS source page of an Nsight Compute report with source counters:

    ncu --kernel-name regex:NAME -c 1 --section SourceCounters -o R python3 ...
    ncu --import R.ncu-rep --page source --print-source sass --csv > R.csv
    python3 tools/ncu_source_summary.py R.csv [--top 25] [--bucket 2048] [--units N]

prints the stall reasons' shares of all warp samples, the instructions holding the most samples
(with their main reasons), and the share of instructions executed and of samples per address
range (a range of --bucket bytes, 16 bytes per instruction), which is how a kernel without line
information is read region by region. --units divides the executed warp instructions (e.g. by
CTAs x warps x chunks) to give instructions per unit of work. Reads the CSV only (no ncu needed).
"""

from __future__ import annotations

import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_rows(path):
    """(header, rows) of the source table: the first line names the kernel, the second is the header."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    for i, line in enumerate(lines):
        if "Address" in line and "Source" in line:
            return line, [r for r in lines[i + 1:] if len(r) == len(line)]
    raise ValueError(f"{path}: no source table (expected a header with 'Address' and 'Source')")


def _int(x):
    try:
        return int(x)
    except ValueError:
        return 0


def summarise(header, rows, top=25, bucket=2048, units=None):
    """The report's lines."""
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    samples = [_int(r[col[SAMPLES]]) for r in rows]
    executed = [_int(r[col[EXECUTED]]) for r in rows]
    total_s, total_e = sum(samples) or 1, sum(executed) or 1
    out = [f"{len(rows)} instructions, {sum(samples)} warp samples, {sum(executed)} warp instructions executed"]
    if units:
        out.append(f"{sum(executed) / units:.1f} warp instructions per unit ({units} units)")
    by_reason = {h: sum(_int(r[col[h]]) for r in rows) for h in reasons}
    out.append("stall reasons (share of all samples):")
    for h, v in sorted(by_reason.items(), key=lambda x: -x[1]):
        if v:
            out.append(f"  {h[6:]:<20} {100 * v / total_s:5.1f}%")
    out.append(f"top {top} instructions by samples (address, samples, executed, main reasons):")
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:top]:
        r = rows[i]
        main = sorted(((_int(r[col[h]]), h[6:]) for h in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {v}" for v, name in main if v)
        out.append(f"  {r[col['Address']][-6:]:>6} {samples[i]:6d} {executed[i]:10d}  {r[col['Source']].strip()[:56]:<56} {why}")
    base = int(rows[0][col["Address"]], 16) if rows else 0
    ranges = {}
    for r, s, e in zip(rows, samples, executed):
        b = ranges.setdefault((int(r[col["Address"]], 16) - base) // bucket, [0, 0])
        b[0] += e
        b[1] += s
    out.append(f"address ranges of {bucket} bytes holding >= 1% of instructions or samples (offset: instructions%, samples%):")
    for k in sorted(ranges):
        e, s = ranges[k]
        if e / total_e >= 0.01 or s / total_s >= 0.01:
            out.append(f"  +{k * bucket:06x}  {100 * e / total_e:5.1f}%  {100 * s / total_s:5.1f}%")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--bucket", type=int, default=2048)
    ap.add_argument("--units", type=float, default=None)
    a = ap.parse_args(argv)
    header, rows = read_rows(a.csv)
    print("\n".join(summarise(header, rows, a.top, a.bucket, a.units)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
