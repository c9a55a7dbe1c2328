"""Shared pieces of the GPU forward benchmarks: the timer and the JSON / Markdown / PNG report."""

from __future__ import annotations

import json
import os
import statistics

REPS = 30
FLUSH_BYTES = 256 << 20  # zeroed before each queued call, as triton.testing.do_bench does: L2 keeps nothing


def time_interleaved(torch, impls, reps=REPS, warmup=3, queued=False):
    """Median ms of ``reps`` calls of each implementation in ``impls`` ([(name, fn)]), each between
    two CUDA events. The implementations take turns call by call, so a drift of the host or the GPU
    during the run reaches all of them alike. fn(i) gets the running call count, whose parity picks
    the input set: consecutive calls never read the same inputs.

    Single calls (default): each call is synchronized, so its time includes the host's.
    queued: the method of triton.testing.do_bench. Before every call a FLUSH_BYTES buffer is zeroed (L2
    keeps nothing of the inputs) and there is no synchronization between calls; the host runs ahead
    of the GPU, so each time is the GPU's time for the call, the host's time hidden unless the host
    falls behind (or the implementation synchronizes)."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda") if queued else None
    k = 0
    for _ in range(warmup):
        for _, fn in impls:
            fn(k)
            k += 1
    torch.cuda.synchronize()
    marks = {name: [] for name, _ in impls}
    for _ in range(reps):
        for name, fn in impls:
            if queued:
                flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(k)
            b.record()
            if not queued:
                b.synchronize()
            marks[name].append((a, b))
            k += 1
    torch.cuda.synchronize()
    return {name: statistics.median(a.elapsed_time(b) for a, b in m) for name, m in marks.items()}


QUEUED_METHOD = (f"median of {REPS} calls enqueued back to back with no synchronization between them (the method "
                 f"of triton.testing.do_bench: a {FLUSH_BYTES >> 20} MB buffer zeroed before every call, each call between two CUDA "
                 "events, so the host's time per call is hidden while the host keeps ahead of the GPU), the "
                 "implementations taking turns, torch SDPA in a block of its own")


# How time_peers_and_baseline times (the start of each results file's "method"; bench kda --resume
# keeps only rows whose file states the same method).
PEERS_AND_BASELINE_METHOD = (
    f"median of {REPS} single calls (CUDA events, synchronized) after 3 warm-up calls, the linear-attention "
    "implementations taking turns call by call, torch SDPA timed after them in a block of its own, consecutive "
    "calls on different input sets")


def time_peers_and_baseline(torch, impls, baseline, reps=REPS, queued=False):
    """time_interleaved (single or queued calls) over the linear-attention implementations ``impls``,
    then the softmax baseline ``baseline`` (name, fn) in a block of its own. The baseline stays out
    of the turns: a call of it loads the GPU for up to ~14 ms at full tensor-core power, and whichever
    implementation came next in the turn ran on a GPU whose clocks had dropped (cula's single
    call at 1x32768 H32 0.80 -> 1.05 ms when it followed SDPA, FLA's 1.28 -> 1.71 ms)."""
    res = time_interleaved(torch, impls, reps, queued=queued)
    if baseline is not None:  # (None: no baseline, e.g. decode)
        name, fn = baseline
        res[name] = time_interleaved(torch, [(name, fn)], reps, queued=queued)[name]
    return res


def measure_config(torch, op, name, config, impls, baseline, floor, floor_note, records, rows, queued_rows, *,
                   cula_out, fla_out=None, peers=("fla_triton", "torch_sdpa"), ratio_queued=False):
    """One configuration of a benchmark against its peers: single and queued calls timed
    (time_peers_and_baseline; baseline None: none), then cula's output (cula_out(): runs cula once and returns o) against
    FLA's (fla_out(), when FLA runs the configuration), the floor, the peers' ratios and the kernel
    cula ran, appended to records, rows and queued_rows (write_report's inputs). Returns (single,
    queued, kernel)."""
    from .. import ops

    check = {}
    with torch.inference_mode():
        res = time_peers_and_baseline(torch, impls, baseline)
        resq = time_peers_and_baseline(torch, impls, baseline, queued=True)
        for impl in res:
            records.append(dict(op=op, config=config, impl=impl, median_ms=round(res[impl], 4),
                                median_ms_queued=round(resq[impl], 4), reps=REPS))
        o_cula = cula_out()
        kernel = ops.last_kernel()
        if fla_out is not None:  # same inputs through FLA: agreement of the outputs
            o_fla = fla_out()
            torch.cuda.synchronize()
            a, b = o_cula.float(), o_fla.float()
            check["rel_vs_fla"] = float((a - b).norm() / b.norm())
    records.append(dict(op=op, config=config, impl="floor", median_ms=round(floor, 4), note=floor_note))
    for peer in peers:
        if peer in res:
            ratio = dict(ratio=round(res[peer] / res["cula"], 3))
            if ratio_queued:
                ratio["ratio_queued"] = round(resq[peer] / resq["cula"], 3)
            records.append(dict(op=op, config=config, impl=f"ratio_{peer}_over_cula", **ratio))
    records.append(dict(op=op, config=config, impl="cula_kernel", name=kernel, **check))
    rows.append((name, res, floor, kernel, check))
    queued_rows.append((name, resq, floor, kernel, {}))
    return res, resq, kernel


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


def plot(path, title, names, series):
    """Bar chart of median ms per configuration: series = [(implementation, [ms per name])]."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"no plot ({e})")
        return False
    fig, ax = plt.subplots(figsize=(11, 4))
    w = 0.8 / len(series)
    for j, (impl, vals) in enumerate(series):
        ax.bar([i + j * w for i in range(len(names))], vals, w, label=impl)
    ax.set_xticks([i + 0.4 for i in range(len(names))], names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def series_from_records(records):
    """(config names in order, [(implementation, [ms per name])]) from a results file's records:
    floor, cula, then the peers in the order they first appear."""
    names, ms = [], {}
    for r in records:
        if "median_ms" not in r or not isinstance(r.get("config"), dict) or "name" not in r["config"]:
            continue
        name = r["config"]["name"]
        if name not in names:
            names.append(name)
        ms.setdefault(r["impl"], {})[name] = r["median_ms"]
    order = [i for i in ("floor", "cula") if i in ms] + [i for i in ms if i not in ("floor", "cula")]
    return names, [(i, [ms[i].get(n, 0) for n in names]) for i in order]


def replot(out_dir):
    """Re-draws <op>.png from every <op>.json in out_dir (the plot beside a results file then always
    shows that file's numbers)."""
    done = 0
    for fn in sorted(os.listdir(out_dir)):
        if not fn.endswith(".json"):
            continue
        with open(os.path.join(out_dir, fn)) as f:
            data = json.load(f)
        meta = data.get("meta", {})
        names, series = series_from_records(data.get("records", []))
        if not names:
            continue
        title = meta.get("title")
        md = os.path.join(out_dir, fn[:-5] + ".md")
        if not title and os.path.exists(md):  # files written before the title was kept in meta
            with open(md) as f:
                head = f.readline().strip().lstrip("# ")
            title = head.rsplit(" (", 1)[0] if head.endswith(")") else head
        title = title or fn[:-5]
        done += plot(os.path.join(out_dir, fn[:-5] + ".png"), f"{title} ({meta.get('gpu', '?')})", names, series)
    print(f"{done} plots written in {out_dir}")
    return 0


def rows_of_records(records, names=None):
    """Table rows and queued-timing rows (write_report's rows and queued_rows) of a results file's
    per-configuration records, for the configurations in names (default: all, as they first appear):
    what a resumed or merged report is rebuilt from."""
    by_name = {}
    for r in records:
        if isinstance(r.get("config"), dict):
            by_name.setdefault(r["config"]["name"], []).append(r)
    rows, queued_rows = [], []
    for name in by_name if names is None else names:
        mine = by_name[name]
        res = {r["impl"]: r["median_ms"] for r in mine if "median_ms" in r and r["impl"] != "floor"}
        floor = next((r["median_ms"] for r in mine if r["impl"] == "floor"), float("nan"))
        kern = next((r for r in mine if r["impl"] == "cula_kernel"), {})
        check = {k: v for k, v in kern.items() if k == "rel_vs_fla"}
        grads = next((r for r in mine if r["impl"] == "grad_rel_diff_vs_fla"), None)  # the training suite's
        if grads and grads.get("by_input"):
            check["rel_vs_fla"] = max(grads["by_input"].values())
        rows.append((name, res, floor, kern.get("name", "-"), check))
        resq = {r["impl"]: r["median_ms_queued"] for r in mine if "median_ms_queued" in r}
        if "cula" in resq:
            queued_rows.append((name, resq, floor, kern.get("name", "-"), {}))
    return rows, queued_rows


def merge_reports(out_dir, inputs, order=None, writers=None):
    """One results file from several runs of the same suite on one GPU (each of a few rows, say when a
    single call cannot hold the whole grid): the per-configuration records of every input, a later
    input's rows replacing an earlier one's of the same name, the tables and geometric means rebuilt
    from them (each ratio stays within its own run), meta["runs"] saying what was merged. order: config
    names in the order the rows should appear (others after them). writers: a suite's own report writer
    by op name, called as writer(out_dir, op, title, meta, rows, records, queued_rows) in place of
    write_report (bench train's, which adds its backward-alone table)."""
    runs, by_name, meta = [], {}, None
    for path in inputs:
        with open(path) as f:
            data = json.load(f)
        m = data["meta"]
        meta = meta or dict(m)
        if m.get("gpu") != meta.get("gpu"):
            raise ValueError(f"merge_reports: {path} is of {m.get('gpu')}, expected {meta.get('gpu')}")
        recs = [r for r in data["records"] if isinstance(r.get("config"), dict)]
        names = list(dict.fromkeys(r["config"]["name"] for r in recs))
        # a merged input keeps its own runs (each row credited to the run it came from)
        given = m.get("runs") or [dict(file=os.path.basename(os.path.dirname(os.path.abspath(path))) + "/" +
                                       os.path.basename(path), date=m.get("date"), rows=names)]
        for run in given:
            runs.append(dict(run, rows=[n for n in run["rows"] if n in names]))
            for n in runs[-1]["rows"]:
                by_name[n] = ([r for r in recs if r["config"]["name"] == n], len(runs) - 1)
    if not by_name:
        raise ValueError("merge_reports: no configuration records in the inputs")
    runs = [dict(run, rows=[n for n in run["rows"] if by_name[n][1] == i]) for i, run in enumerate(runs)]
    runs = [run for run in runs if run["rows"]]
    order = list(dict.fromkeys(order or []))
    names = [n for n in order if n in by_name] + [n for n in by_name if n not in order]
    records = [r for n in names for r in by_name[n][0]]
    rows, queued_rows = rows_of_records(records, names)
    peers = list(dict.fromkeys(p for _, res, *_ in rows for p in res if p != "cula"))
    op = records[0]["op"]
    title = meta.pop("title", op)
    meta["runs"] = runs
    writer = (writers or {}).get(op)
    if writer is not None:
        return writer(out_dir, op, title, meta, rows, records, queued_rows)
    return write_report(out_dir, op, title, meta, rows, records, peers, quiet=True, queued_rows=queued_rows or None)


def _table(op, rows, peers, records, suffix, with_checks):
    """Markdown lines of one timing method's table and geometric means; appends the geometric-mean
    records (impl geomean_<peer>_over_cula<suffix>) to records."""
    lines = ["| config | floor | cula | " + " | ".join(peers) + " | " + " | ".join(f"{p}/cula" for p in peers) +
             (" | cula kernel | rel. diff vs FLA |" if with_checks else " |"),
             "|---" * (3 + 2 * len(peers) + (2 if with_checks else 0)) + "|"]
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
        rel = f"{check['rel_vs_fla']:.1e}" if "rel_vs_fla" in check else "-"  # "-": no FLA gradients to compare
        lines.append(f"| {name} | {floor:.3f} | {res['cula']:.3f} | " + " | ".join(cells) + " | " + " | ".join(ratios) +
                     (f" | {kernel} | {rel} |" if with_checks else " |"))
    lines.append("")
    for p in peers:
        if geo[p]:
            gm = geomean(geo[p])
            lines.append(f"- geometric mean {p}/cula: {gm:.2f}x (worst {min(geo[p]):.2f}x)")
            records.append(dict(op=op, config="grid", impl=f"geomean_{p}_over_cula{suffix}", ratio=round(gm, 3),
                                worst=round(min(geo[p]), 3)))
    return lines


def write_report(out_dir, op, title, meta, rows, records, peers, quiet=False, queued_rows=None):
    """rows: (config name, {impl: ms}, floor ms, cula kernel, {"rel_vs_fla": x}); queued_rows, when
    given: the same for the queued timing (meta["queued_method"] says how). Appends the
    geometric-mean records (to a copy of records), writes <op>.json, <op>.md and <op>.png; returns the
    Markdown lines (printed unless quiet)."""
    records = list(records)
    lines = [f"# {title} ({meta['gpu']})", "", f"Single calls: {meta['method']}. Copy bandwidth "
             f"{meta['copy_gb_per_s']:.0f} GB/s. Times in ms; ratios are peer time / cula time (> 1: cula faster).", ""]
    lines += _table(op, rows, peers, records, "", True)
    if queued_rows:
        lines += ["", "## Queued calls (the GPU's time per call)", "", f"{meta['queued_method']}.", ""]
        lines += _table(op, queued_rows, peers, records, "_queued", False)
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(meta, title=title)
    with open(os.path.join(out_dir, f"{op}.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    with open(os.path.join(out_dir, f"{op}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(os.path.join(out_dir, f"{op}.png"), f"{title} ({meta['gpu']})", *series_from_records(records))  # as replot
    if not quiet:
        print("\n".join(lines))
    return lines
