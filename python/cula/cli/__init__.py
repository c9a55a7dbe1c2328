"""Command line: ``cula info``, ``cula demo`` (the main job), ``cula bench cpu``."""

from __future__ import annotations

import argparse
import sys


def _info() -> int:
    from .. import _lib, ops

    lib = _lib.LIB
    print(f"cula {lib.cula_version().decode()} (C ABI {lib.cula_abi_version()})")
    print(f"library : {lib.path}")
    print(f"build   : {lib.cula_build_info().decode()}")
    n = lib.cula_cuda_device_count()
    print(f"GPUs    : {n}")
    buf = _lib.ctypes.create_string_buffer(256)
    for i in range(n):
        if lib.cula_cuda_device_info(i, buf, 256) == 0:
            print(f"  cuda:{i} {buf.value.decode()}")
    print("backends (what AUTO runs):")
    for op in ("chunk_fwd", "decode", "chunk_bwd", "kda_gate"):
        cuda = ops.backend_for(op, "cuda") if n else "-"
        print(f"  {op:10s} host: {ops.backend_for(op, 'cpu'):10s} cuda: {cuda}")
    return 0


def _config_order():
    """Every GPU suite's configuration names in its grid's order (merged tables keep that order)."""
    names = []
    for mod in ("kda", "coverage", "fwd", "train", "segments"):
        try:
            m = __import__(f"cula.bench.{mod}", fromlist=["CONFIGS"])
        except Exception:
            continue
        for c in getattr(m, "CONFIGS", []):
            names.append(m.config_name(*c) if hasattr(m, "config_name") else c[0])
        names += [c[0] for c in getattr(m, "DECODE_CONFIGS", [])]
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cula", description="cula: linear-attention kernels")
    sub = parser.add_subparsers(dest="cmd")
    sub.add_parser("info", help="build, backends and GPUs found")
    demo = sub.add_parser("demo", help="run every family on the best backend, check it, show linear vs softmax cost")
    demo.add_argument("--quick", action="store_true", help="smaller sizes (for tests)")
    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("suite", choices=["cpu", "decode", "kda", "gdn", "gla", "simple_gla", "lightning", "coverage",
                                          "train", "cp", "segments", "replot", "merge"],
                       help="cpu: fast CPU path vs the float64 reference; decode: CUDA decode vs FLA; kda: KDA chunked "
                       "forward vs FLA, FlashKDA and SDPA; gdn, gla, simple_gla, lightning: that family's chunked "
                       "forward vs FLA and SDPA; coverage: the configurations real models run (Kimi-Linear, Qwen3-Next, "
                       "FLA's default layers, fp16) vs FLA; train: KDA, GDN, GLA, simple GLA and Lightning forward + backward vs FLA and SDPA (GPU suites need "
                       "torch + a GPU); cp: context parallelism over the machine's GPUs vs FLA's KCP and one GPU (--world ranks; "
                       "--device cpu: a check of the harness on gloo host ranks); segments: few heads, long sequences, uncut vs "
                       "parallel segments vs FLA; replot: re-draw the PNG beside "
                       "every results JSON in --out (needs matplotlib); merge: one results file in --out from the "
                       "--inputs of several runs of one suite (later rows replace earlier ones of the same name)")
    bench.add_argument("--only", default=None, help="chunked-forward suites: comma-separated config names to run "
                       "(default: all)")
    bench.add_argument("--out", default=None, help="directory for the JSON and Markdown results "
                       "(default bench/results/cpu, or bench/results/<gpu> for GPU suites)")
    bench.add_argument("--resume", action="store_true", help="kda: keep the configurations already in --out's "
                       "kda_fwd.json (same GPU) and run only the others")
    bench.add_argument("--reps", type=int, default=5)
    bench.add_argument("--inputs", nargs="+", default=None, help="merge: the results JSON files to merge")
    bench.add_argument("--world", type=int, default=None, help="cp: the number of ranks (default: every GPU)")
    bench.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cp: cuda (NCCL) or cpu (gloo)")
    bench.add_argument("--forward-only", action="store_true", help="cp: the forward rows only (no backward)")
    args = parser.parse_args(argv)
    if args.cmd == "info":
        return _info()
    if args.cmd == "demo":
        from .demo import run_demo

        return run_demo(quick=args.quick)
    if args.cmd == "bench":
        only = set(args.only.split(",")) if args.only else None
        if args.suite == "replot":
            from ..bench.common import replot

            return replot(args.out or "bench/results/gpu")
        if args.suite == "merge":
            from ..bench.common import merge_reports

            if not args.inputs or not args.out:
                parser.error("bench merge: --inputs and --out are required")
            from ..bench.train import MERGE_WRITERS

            merge_reports(args.out, args.inputs, order=_config_order(), writers=MERGE_WRITERS)
            print(f"merged {len(args.inputs)} files into {args.out}")
            return 0
        if args.suite == "cpu":
            from ..bench.cpu import bench_cpu

            return bench_cpu(args.out or "bench/results/cpu", reps=args.reps)
        if args.suite == "kda":
            from ..bench.kda import CONFIGS, bench_kda

            return bench_kda(args.out or "bench/results/gpu", configs=[c for c in CONFIGS if not only or c[0] in only],
                             resume=args.resume)
        if args.suite == "coverage":
            from ..bench.coverage import CONFIGS, DECODE_CONFIGS, bench_coverage

            return bench_coverage(args.out or "bench/results/gpu",
                                  configs=[c for c in CONFIGS if not only or c[0] in only],
                                  decode_configs=[c for c in DECODE_CONFIGS if not only or c[0] in only])
        if args.suite == "train":
            from ..bench.train import CONFIGS, FAMILIES, bench_train

            configs = [c for c in CONFIGS if not only or c[0] in only]
            for family in FAMILIES:
                if any(c[1] == family for c in configs):
                    bench_train(args.out or "bench/results/gpu", family, configs=configs)
            return 0
        if args.suite == "cp":
            from ..bench.cp import CONFIGS, SMOKE_CONFIGS, bench_cp

            pool = CONFIGS if args.device == "cuda" else SMOKE_CONFIGS
            return bench_cp(args.out or "bench/results/gpu", world=args.world, device=args.device,
                            configs=[c for c in pool if not only or c[0] in only] or None,
                            steps=("forward",) if args.forward_only else ("forward", "forward + backward"))
        if args.suite == "segments":
            from ..bench.segments import CONFIGS, bench_segments, config_name

            return bench_segments(args.out or "bench/results/gpu",
                                  configs=[c for c in CONFIGS if not only or config_name(*c) in only])
        if args.suite in ("gdn", "gla", "simple_gla", "lightning"):
            from ..bench.fwd import CONFIGS, bench_fwd

            return bench_fwd(args.suite, args.out or "bench/results/gpu",
                             configs=[c for c in CONFIGS if not only or c[0] in only])
        from ..bench.decode import bench_decode

        return bench_decode(args.out or "bench/results/gpu")
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
