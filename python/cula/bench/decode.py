"""``cula bench decode``: KDA decode side by side with FLA's fused_recurrent_kda in one process,
eager and CUDA-graph replay, against the measured device copy bandwidth.

T = 1 token per sequence, K = V = 128, in-kernel gate with lower bound -5, q/k L2 norm, beta
sigmoid, a state pool in K-last layout indexed by a random permutation. Bytes that must move per
step: the states read and written (2 N H K V x state size) plus q, k, v, g, beta and o. Inputs
rotate over enough pools that the working set is several times the L2 cache.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from .. import _lib
from ..cli.demo import Progress

HEADS = (32, 64)
SEQS = (1, 8, 64, 256, 1024)
STATE_DTYPES = ("float32", "bfloat16")
K = V = 128
GRAPH_CALLS = 20  # calls captured in the replayed graph (per-call time = replay time / GRAPH_CALLS)


def _median_time_ms(torch, fn, n_calls, reps=25):
    """Median over `reps` of the mean time of `n_calls` back-to-back calls (CUDA events)."""
    fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(n_calls):
            fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n_calls)
    return statistics.median(times)


def copy_bandwidth(torch):
    n = 1 << 28  # 1 GiB of float32
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = _median_time_ms(torch, lambda i: dst.copy_(src), 5, reps=10)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def cuda_device(torch):
    """The CUDA device, its properties and its measured copy bandwidth (GB/s, read + write), said
    once at the start of a GPU benchmark."""
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    bw = copy_bandwidth(torch)
    print(f"{props.name}: copy bandwidth {bw:.0f} GB/s (read + write)")
    return dev, props, bw


def bench_decode(out_dir: str, gpu_name: str | None = None) -> int:
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    import torch

    from .. import ops

    fla_fn = None
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fn
    except Exception as e:  # FLA absent: cula alone, said in the output
        print(f"FLA not importable ({e}); measuring cula only")
    dev, props, bw = cuda_device(torch)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    records = []
    configs = [(h, n, sd) for sd in STATE_DTYPES for h in HEADS for n in SEQS]
    prog = Progress(len(configs), "bench decode")
    for H, N, sd in configs:
        sdt = getattr(torch, sd)
        state_bytes = N * H * K * V * sdt.itemsize
        rot = max(1, min(8, (4 * l2) // max(state_bytes, 1) + 1))
        pools = [torch.randn(N, H, V, K, device=dev).to(sdt) for _ in range(rot)]
        idxs = [torch.randperm(N, device=dev).to(torch.int32) for _ in range(rot)]
        q = [torch.randn(N, 1, H, K, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
        k = [torch.randn(N, 1, H, K, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
        v = [torch.randn(N, 1, H, V, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
        g = [torch.randn(N, 1, H, K, device=dev) for _ in range(rot)]
        beta = [torch.randn(N, 1, H, device=dev) for _ in range(rot)]
        A_log = torch.rand(H, device=dev) - 0.5
        dt_bias = torch.randn(H * K, device=dev) * 0.1
        outs = [torch.empty(N, 1, H, V, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
        cu = torch.arange(N + 1, device=dev, dtype=torch.int32)
        bytes_moved = 2 * state_bytes + N * H * (3 * K * 2 + K * 4 + 4 + V * 2)

        def run_cula(i):
            j = i % rot
            ops.decode(q[j], k[j], v[j], pools[j], mode="kda", g=g[j], beta=beta[j], state_indices=idxs[j],
                       A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, out=outs[j])

        def run_fla(i):
            j = i % rot
            fla_fn(q=q[j].view(1, N, H, K), k=k[j].view(1, N, H, K), v=v[j].view(1, N, H, V), g=g[j].view(1, N, H, K),
                   beta=beta[j].view(1, N, H), A_log=A_log, dt_bias=dt_bias, initial_state=pools[j],
                   inplace_final_state=True, ssm_state_indices=idxs[j], cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True,
                   out=outs[j].view(1, N, H, V))

        impls = [("cula", run_cula)] + ([("fla_triton", run_fla)] if fla_fn else [])
        config = dict(T=1, N=N, H=H, K=K, V=V, state_dtype=sd, gate="in_kernel_lower_bound", layout="k_last")
        res = {}
        for name, fn in impls:
            eager = _median_time_ms(torch, fn, 20)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for j in range(rot):
                    fn(j)
            torch.cuda.current_stream().wait_stream(stream)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):  # decode steps back to back in one graph, as a model's layers are
                for j in range(GRAPH_CALLS):
                    fn(j)
            graph = _median_time_ms(torch, lambda i: gr.replay(), 1) / GRAPH_CALLS
            for mode, ms in (("eager", eager), ("graph", graph)):
                gbs = bytes_moved / (ms * 1e-3) / 1e9
                res[(name, mode)] = ms
                records.append(dict(op="decode_kda", config=config, impl=name, mode=mode, median_ms=round(ms, 5),
                                    gb_per_s=round(gbs, 1), pct_copy_bw=round(100 * gbs / bw, 1)))
        if fla_fn:
            for mode in ("eager", "graph"):
                records.append(dict(op="decode_kda", config=config, impl="ratio_fla_over_cula", mode=mode,
                                    ratio=round(res[("fla_triton", mode)] / res[("cula", mode)], 3)))
        prog.step(f"H={H} N={N} {sd}")
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(gpu=gpu_name or props.name, copy_gb_per_s=round(bw, 1), torch=torch.__version__,
                fla=_version("fla-core"), date=time.strftime("%Y-%m-%d"), binding=_lib.binding(),
                method="eager: median over 25 timings of the mean of 20 back-to-back calls; graph: "
                       f"{GRAPH_CALLS} calls captured in one CUDA graph (rotating inputs), median over 25 replays of "
                       f"the replay time / {GRAPH_CALLS}; CUDA events")
    with open(os.path.join(out_dir, "decode.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    lines = write_decode_markdown(out_dir, meta, records)
    print("\n".join(lines))
    return 0


def write_decode_markdown(out_dir, meta, records):
    """decode.md from the records of decode.json (configurations in the order measured): cula's
    eager and graph times, GB/s and % of the copy bandwidth, FLA's beside them and the FLA / cula
    ratio of both modes (> 1: cula faster). Returns the lines."""
    lines = [f"# KDA decode, T=1, K=V=128, in-kernel gate (lb -5), K-last pool ({meta['gpu']})", "",
             f"Copy bandwidth {meta['copy_gb_per_s']:.0f} GB/s; {meta['method']}; FLA {meta['fla']} with FLA_FLASH_KDA=0.",
             "", "| state | H | N | cula eager ms | cula graph ms | cula GB/s (graph) | % copy bw | FLA eager ms | "
             "FLA graph ms | FLA GB/s | FLA/cula (eager) | FLA/cula (graph) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda c: (c["state_dtype"], c["H"], c["N"])  # noqa: E731
    by_config = {}
    for x in records:
        by_config.setdefault(key(x["config"]), {})[(x["impl"], x["mode"])] = x
    for (sd, H, N), r in by_config.items():
        c_e, c_g = r[("cula", "eager")], r[("cula", "graph")]
        if ("fla_triton", "graph") in r:
            f_e, f_g = r[("fla_triton", "eager")], r[("fla_triton", "graph")]
            fl = (f"{f_e['median_ms']:.4f} | {f_g['median_ms']:.4f} | {f_g['gb_per_s']:.0f} | "
                  f"{r[('ratio_fla_over_cula', 'eager')]['ratio']:.2f}x | {r[('ratio_fla_over_cula', 'graph')]['ratio']:.2f}x")
        else:
            fl = "- | - | - | - | -"
        lines.append(f"| {sd} | {H} | {N} | {c_e['median_ms']:.4f} | {c_g['median_ms']:.4f} | {c_g['gb_per_s']:.0f} | "
                     f"{c_g['pct_copy_bw']:.0f}% | {fl} |")
    with open(os.path.join(out_dir, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def _version(dist):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "absent"
