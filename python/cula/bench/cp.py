"""`cula bench cp`: context parallelism over the GPUs of one machine against FLA's KCP and against one
GPU: KDA and GDN (and simple GLA, the path without the delta rule, where FLA's KCP has no peer),
forward and forward + backward, one packed sequence split over the ranks.

Every rank is a process (torch.multiprocessing, NCCL with NVLink multicast off). Per configuration
and implementation: warm-up steps, then steps each between two barriers, timed by CUDA events on
every rank; a step's time is the slowest rank's (all-reduced max), the result is the median over
steps. "one_gpu" runs the whole sequence on rank 0 alone (the others wait at the barrier);
"cula_cp_scan" is chunk_cp with the log-depth scan exchange in place of the all-gather (the
planner's two choices, measured side by side); "cula_cp_shares" is chunk_cp on the uneven split of
``dist.cp_shares`` (delta-rule families: the first rank, which runs no summary columns, takes
(V + K) / V times the others' tokens); "cula_cp_det" is chunk_cp's deterministic mode
(segments of SEGMENT tokens). The
implementations take turns step by step. --device cpu runs cula's rows on gloo host ranks with small
shapes (a check of the harness, not a measurement).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

# (name, family, T total, H, HV)
CONFIGS = [
    ("kda 1x65536 H16", "kda", 65536, 16, 16),
    ("kda 1x131072 H16", "kda", 131072, 16, 16),
    ("gdn 1x32768 H64", "gdn", 32768, 64, 64),
    ("gdn 1x131072 H16 HV32", "gdn", 131072, 16, 32),
    ("simple_gla 1x131072 H16", "simple_gla", 131072, 16, 16),  # no delta rule: the diagonal path
    # the long contexts (4 GPUs: 3.3x one GPU asked at 256k, H16)
    ("kda 1x262144 H16", "kda", 262144, 16, 16),
    ("gdn 1x262144 H16", "gdn", 262144, 16, 16),
    ("kda 1x1048576 H16", "kda", 1048576, 16, 16),
]
SMOKE_CONFIGS = [("kda 1x192 H2", "kda", 192, 2, 2), ("gdn 1x160 H2 HV4", "gdn", 160, 2, 4),
                 ("simple_gla 1x160 H2", "simple_gla", 160, 2, 2)]
K = V = 128
REPS, WARMUP = 15, 3
SEGMENT, SEGMENT_SMOKE = 4096, 16  # deterministic mode's segment grid (every rank's slice a multiple of it)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _inputs(torch, family, T, H, HV, Kd, Vd, dev, dt, seed):
    """The whole sequence's inputs (the same on every rank: one seed), bf16 q/k/v on the GPU; q/k L2
    norm in the kernel; KDA with its gate (lower bound -5) and beta sigmoid in the kernel, GDN with a
    log-space scalar gate."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(q=r(1, T, H, Kd), k=r(1, T, H, Kd), v=r(1, T, HV, Vd), beta=r(1, T, HV))
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if family == "kda":
        x["g"] = r(1, T, HV, Kd)
        kw.update(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True, A_log=r(HV).to(dev) * 0.5,
                  dt_bias=(r(HV * Kd) * 0.5).to(dev))
    elif family == "simple_gla":  # a scalar log-gate, no beta
        del x["beta"]
        x["g"] = -torch.nn.functional.softplus(r(1, T, HV))
        kw = dict(use_qk_l2norm_in_kernel=True)
    else:  # beta as a probability: FLA's GDN has no in-kernel sigmoid
        x["g"] = -torch.nn.functional.softplus(r(1, T, HV))
        x["beta"] = torch.sigmoid(x["beta"])
        kw = dict(use_qk_l2norm_in_kernel=True)
    x = {n: t.to(dev, dt if n in "qkv" else torch.float32) for n, t in x.items()}
    return x, kw


def _worker(rank, world, backend, store, out_dir, configs, families, with_fla, steps):
    import torch
    import torch.distributed as td

    os.environ.update(NCCL_ENV)
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    td.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    from .. import dist
    from .._front import chunk

    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    Kd = Vd = K if cuda else 32
    records = []
    try:
        for name, family, T, H, HV in configs:
            if family not in families:
                continue
            x, kw = _inputs(torch, family, T, H, HV, Kd, Vd, dev, dt, seed=1234)
            cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
            mine = {n: dist.split_tokens_for_sp(t, world, rank).contiguous() for n, t in x.items()}
            do_whole = torch.randn_like(x["v"])
            do_mine = dist.split_tokens_for_sp(do_whole, world, rank).contiguous()

            def cula_cp(grad, exchange="auto", split=(mine, do_mine)):
                inp = {n: t.detach().requires_grad_(grad) for n, t in split[0].items()}
                with torch.set_grad_enabled(grad):
                    o, _ = dist.chunk_cp(family, inp["q"], inp["k"], inp["v"], inp["g"], inp.get("beta"),
                                         cu_seqlens=cu, output_final_state=False, exchange=exchange, **kw)
                    if grad:
                        torch.autograd.grad(o, list(inp.values()), split[1])

            # the first rank, which runs no summary columns, with cp_shares' larger part of the tokens
            shares = dist.cp_shares(family, Kd, Vd, world)
            mine_s = {n: dist.split_tokens_for_sp(t, world, rank, shares=shares).contiguous() for n, t in x.items()}
            do_mine_s = dist.split_tokens_for_sp(do_whole, world, rank, shares=shares).contiguous()

            def cula_cp_shares(grad):
                cula_cp(grad, split=(mine_s, do_mine_s))

            def cula_cp_scan(grad):  # the log-depth exchange in place of the all-gather (the planner's choice)
                cula_cp(grad, exchange="scan")

            def one_gpu(grad):
                if rank != 0:
                    return
                inp = {n: t.detach().requires_grad_(grad) for n, t in x.items()}
                with torch.set_grad_enabled(grad):
                    o = chunk(family, inp["q"], inp["k"], inp["v"], inp["g"], inp.get("beta"), cu_seqlens=cu,
                              **kw)[0]
                    if grad:
                        torch.autograd.grad(o, list(inp.values()), do_whole)

            def cula_cp_det(grad):  # deterministic mode: bitwise the same on any number of ranks
                inp = {n: t.detach().requires_grad_(grad) for n, t in mine.items()}
                with torch.set_grad_enabled(grad):
                    o, _ = dist.chunk_cp(family, inp["q"], inp["k"], inp["v"], inp["g"], inp.get("beta"),
                                         cu_seqlens=cu, output_final_state=False, deterministic=True,
                                         segment_len=segment, **kw)
                    if grad:
                        torch.autograd.grad(o, list(inp.values()), do_mine)

            impls = [("cula_cp", cula_cp), ("cula_cp_scan", cula_cp_scan), ("one_gpu", one_gpu)]
            if len(set(shares)) > 1:
                impls.insert(1, ("cula_cp_shares", cula_cp_shares))
            segment = SEGMENT if cuda else SEGMENT_SMOKE
            if all(dist.split_tokens_for_sp(x["q"], world, r).shape[1] % segment == 0 for r in range(world)):
                impls.insert(1, ("cula_cp_det", cula_cp_det))
            if with_fla:
                fla_ctx, fla_fn = _fla(torch, family, cu, td)
                if fla_fn is not None:
                    def fla_kcp(grad, ctx=fla_ctx, fn=fla_fn):
                        inp = {n: t.detach().requires_grad_(grad) for n, t in mine.items()}
                        with torch.set_grad_enabled(grad):
                            o = fn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], cu_seqlens=ctx.cu_seqlens,
                                   cp_context=ctx, **kw)[0]
                            if grad:
                                torch.autograd.grad(o, list(inp.values()), do_mine)
                    impls.append(("fla_kcp", fla_kcp))
            for grad in (step == "forward + backward" for step in steps):
                times = _time(torch, td, impls, grad, cuda)
                for impl, ms in times.items():
                    records.append(dict(op="cp", config=dict(name=name, family=family, T=T, H=H, HV=HV, K=Kd, V=Vd,
                                                             world=world), impl=impl,
                                        step="forward + backward" if grad else "forward", median_ms=ms))
                if rank == 0:
                    print(name, "fwd+bwd" if grad else "fwd", {n: round(t, 3) for n, t in times.items()}, flush=True)
            if rank == 0:  # after every configuration: a run cut off keeps the rows it finished
                _write(torch, out_dir, world, records, cuda, show=False)
        if rank == 0:
            _write(torch, out_dir, world, records, cuda)
        td.barrier()
    finally:
        td.destroy_process_group()
    # gloo's worker threads may still be freeing the last collective's tensors, which takes the GIL; taking
    # it while the interpreter finalises aborts the process (pytorch/pytorch#179291), so a rank that
    # succeeded exits without the shutdown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fla(torch, family, cu, td):
    """FLA's context (build_cp_context over the global offsets) and its chunk function, or (None, None)."""
    if family not in ("kda", "gdn"):  # FLA's KCP covers KDA and GDN
        return None, None
    try:
        from fla.ops.cp import build_cp_context
        if family == "kda":
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        return build_cp_context(cu, group=td.group.WORLD), fn
    except Exception as e:  # noqa: BLE001  (recorded in the output instead)
        print(f"FLA's KCP unavailable: {type(e).__name__}: {e}", flush=True)
        return None, None


def _time(torch, td, impls, grad, cuda):
    """Median over REPS of each step's slowest-rank time (ms), the implementations taking turns."""
    for _ in range(WARMUP):
        for _, fn in impls:
            fn(grad)
    steps = {name: [] for name, _ in impls}
    for _ in range(REPS):
        for name, fn in impls:
            td.barrier()
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(grad)
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b)
            else:
                t0 = time.perf_counter()
                fn(grad)
                ms = (time.perf_counter() - t0) * 1e3
            t = torch.tensor([ms], dtype=torch.float64, device="cuda" if cuda else "cpu")
            td.all_reduce(t, op=td.ReduceOp.MAX)
            steps[name].append(float(t.item()))
    return {name: statistics.median(v) for name, v in steps.items()}


def exchange_bytes(config):
    """Bytes one rank contributes to the summary exchange of a layer: the map of the piece leaving
    it, A [HV, V, K] and M [HV, K, K] in float32 per packed row (one here), whatever the tokens."""
    HV, K, V = config["HV"], config["K"], config["V"]
    return 4 * HV * K * (V + K)


def table(records, world, method, gpu):
    """The markdown of `cula bench cp`'s records: per configuration and step the implementations'
    times, the ratios, the scaling efficiency one_gpu / (world x cula_cp) and the bytes exchanged."""
    rows, configs = {}, {}
    for r in records:
        key = (r["config"]["name"], r["step"])
        rows.setdefault(key, {})[r["impl"]] = r["median_ms"]
        configs[key] = r["config"]
    lines = [f"# Context parallelism on {world} x {gpu}", "", f"{method}. Times in ms; scaling efficiency: one_gpu / "
             f"({world} x cula_cp) (1.0 = linear); exchanged: the summary each rank contributes per layer (float32 "
             "A [HV, V, K] and M [HV, K, K]), independent of the tokens; an all-gather delivers the other ranks' to each.",
             "",
             "| config | step | cula_cp | cula_cp scan exchange | cula_cp cp_shares split | cula_cp deterministic | fla_kcp "
             "| one_gpu | fla_kcp/cula_cp | one_gpu/cula_cp | scaling efficiency | exchanged per rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, step), t in rows.items():
        c = t.get("cula_cp")
        f = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
        ratio = lambda x: f"{x / c:.2f}x" if x is not None and c else "-"  # noqa: E731
        one = t.get("one_gpu")
        eff = f"{one / (world * c):.2f}" if one is not None and c else "-"
        mib = f"{exchange_bytes(configs[(name, step)]) / 2**20:.2f} MiB"
        lines.append(f"| {name} | {step} | {f(c)} | {f(t.get('cula_cp_scan'))} | {f(t.get('cula_cp_shares'))} | "
                     f"{f(t.get('cula_cp_det'))} | "
                     f"{f(t.get('fla_kcp'))} | {f(one)} | {ratio(t.get('fla_kcp'))} | {ratio(one)} | {eff} | {mib} |")
    return "\n".join(lines) + "\n"


def _write(torch, out_dir, world, records, cuda, show=True):
    gpu = torch.cuda.get_device_name(0) if cuda else "host (gloo), harness check"
    meta = dict(gpu=gpu, world=world, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                method=f"median over {REPS} steps after {WARMUP} warm-up steps of the slowest rank's time per step "
                       "(CUDA events between barriers, all-reduced max); the implementations take turns step by step; "
                       "one_gpu: the whole sequence on one GPU")
    text = table(records, world, meta["method"], gpu)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"cp_x{world}")
    with open(stem + ".json", "w") as fh:
        json.dump(dict(meta=meta, records=records), fh, indent=1)
    with open(stem + ".md", "w") as fh:
        fh.write(text)
    if show:
        print(text)


def bench_cp(out_dir: str, world: int | None = None, device: str = "cuda", families=("kda", "gdn", "simple_gla"),
             configs=None, steps=("forward", "forward + backward")) -> int:
    """Runs the suite over `world` ranks (default: every visible GPU; --device cpu: 2 gloo ranks);
    steps: "forward" and/or "forward + backward"."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    os.environ.update(NCCL_ENV)
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    if device == "cuda":
        world = world or torch.cuda.device_count()
        if world < 2:
            raise SystemExit("bench cp: needs 2 or more GPUs (or --device cpu for the harness check)")
        backend, configs, with_fla = "nccl", configs or CONFIGS, True
    else:
        world, backend, configs, with_fla = world or 2, "gloo", configs or SMOKE_CONFIGS, False
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, backend, os.path.join(tmp, "store"), out_dir, configs, families, with_fla, steps),
                 nprocs=world, join=True)
    return 0
