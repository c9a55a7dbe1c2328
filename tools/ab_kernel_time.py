#!/usr/bin/env python3
"""Back-to-back time of cula's chunked forward (or backward) under two or more builds of libcula.so,
taken in turns: each round runs every library once, each in a fresh process (CULA_LIBRARY names it),
so the builds see the same machine state and a drift of the machine shows in every column. This is
how the kernel changes in the engines' design docs are measured ("kernel time back to back, N rounds
alternating"); the benchmarks against peers are `cula bench`.

    python3 tools/ab_kernel_time.py --lib old=exp/lib_old.so --lib new=build/libcula.so \\
        --family kda --config 1x8192:64 --config varlen:1024,1024,1024:64 --rounds 3

--op bwd times the backward op (cula.ops.chunk_bwd, gradient buffers reused across calls) on the
same inputs with a random d_out; Lightning takes FLA's decay of the first of 24 layers. --split adds
each kernel's time per call under torch's profiler (median over the rounds) for every build and
config, in tables after the main one and in the JSON.

A config is BxT:H or varlen:L1,L2,...:H (one packed sequence of those lengths), H/HV in place of H
for grouped value heads (KDA and GDN: H q/k heads, HV value heads). Inputs are bf16
torch tensors on the GPU with the benchmark's options (in-kernel gate with lower bound -5, l2norm,
beta sigmoid; --no-l2norm leaves q and k as drawn); --device cpu runs float32 host arrays on the CPU backend instead (small shapes;
for checking the tool itself). A library's time per config is the median over groups of --reps
back-to-back calls of the mean call time; the table gives each round's times and the ratio of
each library's median over the rounds to the first library's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

MARK = "AB_RESULT "


def parse_config(text):
    """'BxT:H' -> (B, T, H, H, None); 'BxT:H/HV' (HV value heads over H q/k heads) -> (B, T, H, HV, None);
    'varlen:L1,L2:H[/HV]' -> (1, sum, H, HV, [L1, L2])."""
    try:
        head, h = text.rsplit(":", 1)
        H, _, hv = h.partition("/")
        H = int(H)
        HV = int(hv) if hv else H
        if H < 1 or HV % H:
            raise ValueError
        if head.startswith("varlen:"):
            lens = [int(x) for x in head[len("varlen:"):].split(",")]
            if not lens or min(lens) < 0:
                raise ValueError
            return 1, sum(lens), H, HV, lens
        b, t = head.split("x")
        return int(b), int(t), H, HV, None
    except ValueError:
        raise SystemExit(f"argument --config: expected BxT:H[/HV] or varlen:L1,L2,...:H[/HV] (HV a multiple of H), "
                         f"got {text!r}") from None


def _child(args):
    import numpy as np

    from cula import _lib, ops

    cuda = args.device == "cuda"
    if cuda:
        import torch
    rng = np.random.default_rng(0)
    gen = torch.Generator(device="cuda").manual_seed(0) if cuda else None
    K = V = args.kv
    results, split = {}, {}
    for text in args.config:
        B, T, H, HV, lens = parse_config(text)
        g_shape = (B, T, HV, K) if args.family in ("kda", "gla") else (B, T, HV)
        gated = args.family != "lightning"

        def make(*shape, scale=1.0):
            if cuda:  # drawn on the GPU: numpy takes tens of seconds for the large configurations
                return (torch.randn(shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        sets = [dict(q=make(B, T, H, K), k=make(B, T, H, K), v=make(B, T, HV, V), g=make(*g_shape) if gated else None,
                     beta=make(B, T, HV), d_out=make(B, T, HV, V)) for _ in range(2)]
        for s in sets:
            if args.op == "bwd" and args.family in ("gla", "simple_gla"):  # a log-decay, not a raw draw
                s["g"] = -abs(s["g"]) * 0.1 if not cuda else (-s["g"].float().abs() * 0.1).to(s["g"].dtype)
            s["out"] = torch.empty(B, T, HV, V, device="cuda", dtype=torch.bfloat16) if cuda \
                else np.empty((B, T, HV, V), np.float32)
        decay = None
        if args.family == "lightning":
            from cula.lightning_attn import lightning_decay

            decay = lightning_decay(H, 0, 24, like=sets[0]["q"])
        A_log = (rng.random(HV) - 0.5).astype(np.float32)
        dt_bias = (rng.standard_normal((HV, K) if args.family == "kda" else (HV,)) * 0.1).astype(np.float32)
        cu = np.array([0] + list(itertools.accumulate(lens)), np.int64) if lens else None
        if cuda:
            A_log, dt_bias = torch.from_numpy(A_log).cuda(), torch.from_numpy(dt_bias).cuda()
            cu = torch.from_numpy(cu).cuda() if cu is not None else None
        kw = dict(scale=K ** -0.5, use_qk_l2norm_in_kernel=not args.no_l2norm, cu_seqlens=cu, out=None)
        if args.family in ("kda", "gdn"):
            kw.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias,
                      use_beta_sigmoid_in_kernel=True)

        if decay is not None:
            kw["decay"] = decay
        bkw = {n: a for n, a in kw.items() if n != "out"}  # the backward's options, formed outside the timed calls

        def run(i):
            x = sets[i % 2]
            beta = x["beta"] if args.family in ("kda", "gdn") else None
            if args.op == "fwd":
                ops.chunk_fwd(args.family, x["q"], x["k"], x["v"], x["g"], beta, **{**kw, "out": x["out"]})
            else:
                x["grads"] = ops.chunk_bwd(args.family, x["q"], x["k"], x["v"], x["g"], beta, x["d_out"],
                                           grads=x.get("grads"), **bkw)

        for i in range(3):
            run(i)
        means = []
        for _ in range(args.groups):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for i in range(args.reps):
                    run(i)
                b.record()
                torch.cuda.synchronize()
                means.append(a.elapsed_time(b) / args.reps)
            else:
                t0 = time.perf_counter()
                for i in range(args.reps):
                    run(i)
                means.append((time.perf_counter() - t0) * 1e3 / args.reps)
        results[text] = statistics.median(means)
        if args.split:
            split[text] = _kernel_split(run, cuda, args.split_calls)
    print(MARK + json.dumps(dict(kernel=ops.last_kernel(), library=str(_lib.LIB.path), ms=results, split=split)),
          flush=True)
    return 0


def _kernel_split(run, cuda, calls):
    """{kernel: ms per call} over `calls` calls: on the GPU each kernel's device time under torch's
    profiler, largest first, names cut to 120 characters; on the CPU backend (one host call, no
    kernels to tell apart) the op's row as last_kernel() names it, wall time."""
    from cula import ops

    if not cuda:
        t0 = time.perf_counter()
        for i in range(calls):
            run(i)
        return {f"{ops.last_kernel()} (host)": (time.perf_counter() - t0) * 1e3 / calls}
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            run(i)
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            rows[ev.key[:120]] = rows.get(ev.key[:120], 0.0) + ev.device_time_total / 1e3 / calls
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def run_rounds(args, libs):
    """{name: {config: [ms per round]}}, each library's last kernel name and the path it loaded, and
    with --split {name: {config: [{kernel: ms} per round]}}."""
    times = {name: {c: [] for c in args.config} for name, _ in libs}
    splits = {name: {c: [] for c in args.config} for name, _ in libs}
    kernels, loaded = {}, {}
    child_args = ["--family", args.family, "--op", args.op, "--device", args.device, "--kv", str(args.kv), "--reps", str(args.reps),
                  "--groups", str(args.groups)] + [x for c in args.config for x in ("--config", c)]
    if args.no_l2norm:
        child_args.append("--no-l2norm")
    if args.split:
        child_args += ["--split", "--split-calls", str(args.split_calls)]
    for r in range(args.rounds):
        for name, path in libs:
            env = dict(os.environ, CULA_LIBRARY=os.path.abspath(path), **args.lib_env.get(name, {}))
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"] + child_args, env=env,
                                  capture_output=True, text=True)
            line = next((l for l in proc.stdout.splitlines() if l.startswith(MARK)), None)
            if proc.returncode != 0 or line is None:
                raise SystemExit(f"library {name} ({path}), round {r + 1}: the timing process failed "
                                 f"(exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            res = json.loads(line[len(MARK):])
            kernels[name], loaded[name] = res["kernel"], res["library"]
            for c, ms in res["ms"].items():
                times[name][c].append(ms)
            for c, rows in res["split"].items():
                splits[name][c].append(rows)
            # each round as it ends, so a run cut short still shows what it measured
            print(f"round {r + 1} {name}: " + ", ".join(f"{c} {ms:.3f}" for c, ms in res["ms"].items()),
                  file=sys.stderr, flush=True)
    return times, kernels, loaded, splits


def split_table(args, libs, splits, config):
    """One config's kernels: each library's median ms per call over the rounds (0 where a build does
    not run that kernel), the rows in the first library's order, then the kernels only later ones run."""
    med = {}
    for n, _ in libs:
        names = {k for rows in splits[n][config] for k in rows}
        med[n] = {k: statistics.median(rows.get(k, 0.0) for rows in splits[n][config]) for k in names}
    order = []
    for n, _ in libs:
        order += [k for k in sorted(med[n], key=lambda k: -med[n][k]) if k not in order]
    lines = [f"| {args.family} {args.op} {config}: kernel | " + " | ".join(f"{n} (ms)" for n, _ in libs) + " |",
             "|---" * (len(libs) + 1) + "|"]
    for k in order:
        lines.append(f"| {k} | " + " | ".join(f"{med[n].get(k, 0.0):.3f}" for n, _ in libs) + " |")
    return lines


def table(args, libs, times):
    first = libs[0][0]
    lines = ["| config | " + " | ".join(f"{n} (ms per round)" for n, _ in libs) + " | "
             + " | ".join(f"{n}/{first}" for n, _ in libs[1:]) + " |",
             "|---" * (2 * len(libs)) + "|"]
    for c in args.config:
        base = statistics.median(times[first][c])
        cells = [" ".join(f"{x:.3f}" for x in times[n][c]) for n, _ in libs]
        ratios = [f"{statistics.median(times[n][c]) / base:.3f}" for n, _ in libs[1:]]
        lines.append(f"| {args.family} {args.op} {c} | " + " | ".join(cells + ratios) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", action="append", default=[], metavar="NAME=PATH", help="a build to time (two or more)")
    p.add_argument("--env", action="append", default=[], metavar="NAME:VAR=VALUE",
                   help="an environment variable for one build's processes (repeatable): one library under two "
                        "settings, e.g. --lib a=L --lib b=L --env b:CULA_BWD_LEAN=0")
    p.add_argument("--family", default="kda", choices=["kda", "gdn", "gla", "simple_gla", "lightning"])
    p.add_argument("--op", default="fwd", choices=["fwd", "bwd"], help="the chunked forward or the backward")
    p.add_argument("--config", action="append", default=None, help="BxT:H[/HV] or varlen:L1,L2,...:H[/HV] (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10, help="back-to-back calls per timed group")
    p.add_argument("--groups", type=int, default=5, help="timed groups per config (the median is kept)")
    p.add_argument("--kv", type=int, default=128, help="K = V")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--no-l2norm", action="store_true", help="q and k as drawn (no L2 norm in the kernel)")
    p.add_argument("--json", default=None, help="also write the times per round here")
    p.add_argument("--split", action="store_true", help="also each kernel's time per call (torch profiler), per build")
    p.add_argument("--split-calls", type=int, default=3, help="calls profiled per config for --split")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.config = args.config or ["1x8192:64", "varlen:" + ",".join(["1024"] * 8) + ":64", "2x8192:64"]
    for c in args.config:
        _, _, H, HV, _ = parse_config(c)
        if HV != H and args.family not in ("kda", "gdn"):
            raise SystemExit(f"argument --config: grouped value heads (H/HV) take the delta-rule families (kda, gdn), "
                             f"got {c!r} with --family {args.family}")
    for name, value in (("--rounds", args.rounds), ("--reps", args.reps), ("--groups", args.groups),
                        ("--split-calls", args.split_calls)):
        if value < 1:
            raise SystemExit(f"argument {name}: expected a positive count, got {value}")
    if args.child:
        return _child(args)
    libs = []
    for spec in args.lib:
        name, sep, path = spec.partition("=")
        if not sep or not name or not os.path.exists(path):
            raise SystemExit(f"argument --lib: expected NAME=PATH of an existing library, got {spec!r}")
        libs.append((name, path))
    if len(libs) < 2 or len({n for n, _ in libs}) != len(libs):
        raise SystemExit(f"argument --lib: expected two or more libraries with distinct names, got {len(libs)}")
    args.lib_env = {}
    for spec in args.env:
        name, sep, assign = spec.partition(":")
        var, eq, value = assign.partition("=")
        if not sep or not eq or not var or name not in {n for n, _ in libs}:
            raise SystemExit(f"argument --env: expected NAME:VAR=VALUE with NAME one of the --lib names, got {spec!r}")
        args.lib_env.setdefault(name, {})[var] = value
    times, kernels, loaded, splits = run_rounds(args, libs)
    print("\n".join(table(args, libs, times)))
    if args.split:
        for c in args.config:
            print("\n" + "\n".join(split_table(args, libs, splits, c)))
    print("kernels: " + ", ".join(f"{n} {k}" for n, k in kernels.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(family=args.family, op=args.op, device=args.device, rounds=args.rounds, reps=args.reps,
                           groups=args.groups, libs=dict(libs), env=args.lib_env, loaded=loaded, kernels=kernels, ms=times,
                           split=splits if args.split else None), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
