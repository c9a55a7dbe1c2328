"""Shared pieces of the GPU forward benchmarks: the timer and the JSON / Markdown / PNG report."""

from __future__ import annotations

import json
import os
import statistics

REPS = 20


def time_ms(torch, fn, reps=REPS, warmup=3):
    """Median of ``reps`` single calls ``fn(i)`` timed with CUDA events, after ``warmup`` calls."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def causal_sdpa(x, seqlens=None):
    """torch SDPA, causal, on the q, k, v of input set x ([B, T, H, D]); one call per sequence for
    varlen inputs (the softmax baseline of the forward benchmarks)."""
    import torch.nn.functional as F

    q, k, v = (x[n].transpose(1, 2) for n in "qkv")
    if not seqlens:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    start = 0
    for n in seqlens:
        F.scaled_dot_product_attention(q[:, :, start:start + n], k[:, :, start:start + n], v[:, :, start:start + n],
                                       is_causal=True)
        start += n
    return None


def geomean(xs):
    out = 1.0
    for x in xs:
        out *= x
    return out ** (1 / len(xs))


def write_report(out_dir, op, title, meta, rows, records, peers):
    """rows: (config name, {impl: ms}, floor ms, cula kernel, {"rel_vs_fla": x}). Appends the
    geometric-mean records, writes <op>.json, <op>.md and <op>.png; returns the Markdown lines."""
    lines = [f"# {title} ({meta['gpu']})", "", f"{meta['method']}. Copy bandwidth {meta['copy_gb_per_s']:.0f} GB/s. "
             "Times in ms; ratios are peer time / cula time (> 1: cula faster).", "",
             "| config | floor | cula | " + " | ".join(peers) + " | " + " | ".join(f"{p}/cula" for p in peers) +
             " | cula kernel | rel. diff vs FLA |",
             "|---" * (4 + 2 * len(peers) + 1) + "|"]
    geo = {p: [] for p in peers}
    for name, res, floor, kernel, check in rows:
        cells = [f"{res[p]:.3f}" if p in res else "-" for p in peers]
        ratios = []
        for p in peers:
            if p in res:
                geo[p].append(res[p] / res["cula"])
                ratios.append(f"{res[p] / res['cula']:.2f}x")
            else:
                ratios.append("-")
        lines.append(f"| {name} | {floor:.3f} | {res['cula']:.3f} | " + " | ".join(cells) + " | " + " | ".join(ratios) +
                     f" | {kernel} | {check.get('rel_vs_fla', float('nan')):.1e} |")
    lines.append("")
    for p in peers:
        if geo[p]:
            gm = geomean(geo[p])
            lines.append(f"- geometric mean {p}/cula: {gm:.2f}x (worst {min(geo[p]):.2f}x)")
            records.append(dict(op=op, config="grid", impl=f"geomean_{p}_over_cula", ratio=round(gm, 3),
                                worst=round(min(geo[p]), 3)))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{op}.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    with open(os.path.join(out_dir, f"{op}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 4))
        names = [r[0] for r in rows]
        allimpl = ["floor", "cula"] + list(peers)
        w = 0.8 / len(allimpl)
        for j, impl in enumerate(allimpl):
            vals = [r[2] if impl == "floor" else r[1].get(impl, 0) for r in rows]
            ax.bar([i + j * w for i in range(len(rows))], vals, w, label=impl)
        ax.set_xticks([i + 0.4 for i in range(len(rows))], names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("ms")
        ax.set_title(f"{title} ({meta['gpu']})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{op}.png"), dpi=110)
    except Exception as e:
        print(f"no plot ({e})")
    print("\n".join(lines))
    return lines
