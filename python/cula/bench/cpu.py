"""Benchmarks. ``cula bench cpu``: the fast CPU path against the float64 reference, side by side
in one process, medians over repetitions, written as JSON + Markdown."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import numpy as np

from .. import _lib, ops
from ..cli.demo import Progress, _inputs

CPU_CONFIGS = [
    # (family, B, T, H, K, V)
    ("kda", 1, 4096, 8, 128, 128),
    ("gdn", 1, 4096, 8, 128, 128),
    ("gla", 1, 4096, 8, 128, 128),
    ("lightning", 1, 4096, 8, 128, 128),
]


def _median_ms(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_cpu(out_dir: str, reps: int = 5) -> int:
    rng = np.random.default_rng()
    records = []
    prog = Progress(len(CPU_CONFIGS), "bench cpu")
    for fam, B, T, H, K, V in CPU_CONFIGS:
        q, k, v, kw = _inputs(rng, fam, B, T, H, K, V)
        config = dict(family=fam, B=B, T=T, H=H, K=K, V=V, dtype="float32", threads=os.cpu_count())
        res = {}
        for impl in ("cpu", "reference"):
            n = reps if impl == "cpu" else max(1, reps // 2)
            res[impl] = _median_ms(lambda: ops.chunk_fwd(fam, q, k, v, output_final_state=True, backend=impl, **kw), n)
            records.append(dict(op=f"chunk_fwd_{fam}", config=config, impl=impl, median_ms=round(res[impl], 3), reps=n))
        records.append(dict(op=f"chunk_fwd_{fam}", config=config, impl="speedup_cpu_vs_reference",
                            ratio=round(res["reference"] / res["cpu"], 2)))
        prog.step(fam)
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(machine=platform.processor() or platform.machine(), cores=os.cpu_count(),
                build=_lib.LIB.cula_build_info().decode(), date=time.strftime("%Y-%m-%d"))
    with open(os.path.join(out_dir, "chunk_fwd_cpu.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    lines = ["# CPU chunked forward vs the float64 reference", "",
             f"{meta['machine']}, {meta['cores']} cores, {meta['date']}; medians (ms) of {reps} runs after a warm-up.", "",
             "| op | B | T | H | K=V | cpu ms | reference ms | speedup |", "|---|---|---|---|---|---|---|---|"]
    for fam, B, T, H, K, V in CPU_CONFIGS:
        r = {x["impl"]: x for x in records if x["op"] == f"chunk_fwd_{fam}"}
        lines.append(f"| {fam} | {B} | {T} | {H} | {K} | {r['cpu']['median_ms']:.1f} | {r['reference']['median_ms']:.1f} | "
                     f"{r['speedup_cpu_vs_reference']['ratio']:.1f}x |")
    with open(os.path.join(out_dir, "chunk_fwd_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
