"""``cula bench train``: training steps (forward + backward through autograd, and the backward alone)
of cula's FLA drop-ins side by side with FLA's Triton kernels (FLA_FLASH_KDA=0) called with the same
arguments, and torch SDPA (causal softmax attention, forward + backward) as the baseline; the peak
memory of one step beside each time. A configuration FLA refuses is recorded with its refusal.

Rows: KDA with Kimi-Linear's gate (-e^{A_log} softplus(g + dt_bias), no lower bound, q/k L2 norm and
beta sigmoid in kernel): the anchor shape B=1 T=4096 H=16, B=1 T=8192 H=32 and 64, B=2 T=4096 H=32,
grouped value heads and a varlen batch; GDN (q/k L2 norm in kernel): 16 q/k heads and 32 value
heads over 32k tokens, B=1 T=8192 H=32, B=2 T=4096 H=32 and a varlen batch; GLA (per-channel
log-sigmoid gate), simple GLA (per-head log-sigmoid gate) and Lightning (FLA's per-layer decay,
layer 0 of 24): B=1 T=8192 H=32, B=2 T=4096 H=32 and a varlen batch. bf16, K = V = 128, and FLA's
default GatedDeltaNet layer (head_dim 256, expand_v 2: K = 256, V = 512, 6 heads).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import namedtuple

from .common import QUEUED_METHOD, REPS, causal_sdpa, time_interleaved, write_report
from .coverage import VARLEN, _fns, _inputs, _kda_gate
from .decode import _version, cuda_device
from .. import _lib
from ..cli.demo import Progress

# one row: T is the sum of seqlens where given; K and V the head sizes
Row = namedtuple("Row", "name family B T H HV seqlens K V", defaults=(128, 128))
CONFIGS = [Row(*c) for c in [
    ("KDA 1x4096 H16", "kda", 1, 4096, 16, 16, None),
    ("KDA 1x8192 H32", "kda", 1, 8192, 32, 32, None),
    ("KDA 2x4096 H32", "kda", 2, 4096, 32, 32, None),
    ("KDA 1x8192 H64", "kda", 1, 8192, 64, 64, None),
    ("KDA GVA 1x8192 H16/HV32", "kda", 1, 8192, 16, 32, None),
    ("KDA varlen6 H32", "kda", 1, None, 32, 32, VARLEN),
    ("GDN 1x32768 H16/HV32", "gdn", 1, 32768, 16, 32, None),
    ("GDN 1x8192 H32", "gdn", 1, 8192, 32, 32, None),
    ("GDN 2x4096 H32", "gdn", 2, 4096, 32, 32, None),
    ("GDN varlen6 H16/HV32", "gdn", 1, None, 16, 32, VARLEN),
    ("FLA-default GDN K=256 V=512 1x8192 H6", "gdn", 1, 8192, 6, 6, None, 256, 512),
    ("GLA 1x8192 H32", "gla", 1, 8192, 32, 32, None),
    ("GLA 2x4096 H32", "gla", 2, 4096, 32, 32, None),
    ("GLA varlen6 H32", "gla", 1, None, 32, 32, VARLEN),
    ("simple GLA 1x8192 H32", "simple_gla", 1, 8192, 32, 32, None),
    ("simple GLA 2x4096 H32", "simple_gla", 2, 4096, 32, 32, None),
    ("simple GLA varlen6 H32", "simple_gla", 1, None, 32, 32, VARLEN),
    ("Lightning 1x8192 H32", "lightning", 1, 8192, 32, 32, None),
    ("Lightning 2x4096 H32", "lightning", 2, 4096, 32, 32, None),
    ("Lightning varlen6 H32", "lightning", 1, None, 32, 32, VARLEN),
]]
FAMILIES = ("kda", "gdn", "gla", "simple_gla", "lightning")
LIGHTNING_LAYER = (0, 24)  # (layer_idx, num_layers): FLA's decay of the first of 24 layers
TRAIN_REPS = 10


def _train_fns(family):
    """(cula's drop-in, FLA's function) of a family's chunked form."""
    if family in ("kda", "gdn"):
        return _fns(family)
    if family == "gla":
        from fla.ops.gla import chunk_gla as fla_fn

        from ..gla import chunk_gla as cula_fn
    elif family == "simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla as fla_fn

        from ..simple_gla import chunk_simple_gla as cula_fn
    else:
        from fla.ops.lightning_attn import chunk_lightning_attn as fla_fn

        from ..lightning_attn import chunk_lightning_attn as cula_fn
    return cula_fn, fla_fn


def _call(family, fn, x, kw):
    """o of one call with FLA's argument list for the family."""
    if family in ("kda", "gdn"):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)[0]
    if family == "lightning":
        return fn(x["q"], x["k"], x["v"], *LIGHTNING_LAYER, **kw)[0]
    return fn(x["q"], x["k"], x["v"], x["g"], **kw)[0]


def _wrt_names(x, kw):
    """The names of the differentiable inputs of a call: the tensors of x, then A_log and dt_bias
    where given."""
    return [n for n in ("q", "k", "v", "g", "beta") if n in x] + [n for n in ("A_log", "dt_bias") if n in kw]


def _wrt(x, kw):
    """The differentiable inputs of a call, in _wrt_names' order."""
    return [x[n] if n in x else kw[n] for n in _wrt_names(x, kw)]


def _leaves(torch, family, B, T, H, HV, dev, gate_kw, K=128, V=128):
    import torch.nn.functional as F

    if family in ("kda", "gdn"):
        x = _inputs(torch, family, B, T, H, HV, K, V, "bfloat16", dev)
    else:
        x = {n: torch.randn(B, T, H, K if n != "v" else V, device=dev, dtype=torch.bfloat16) for n in "qkv"}
        if family == "gla":  # FLA's tests' gate: log-sigmoid / 16
            x["g"] = (F.logsigmoid(torch.randn(B, T, H, K, device=dev)) / 16).to(torch.bfloat16)
        elif family == "simple_gla":
            x["g"] = F.logsigmoid(torch.randn(B, T, H, device=dev)) / 16
    for t in x.values():
        t.requires_grad_()
    for n in ("A_log", "dt_bias"):
        if n in gate_kw:
            gate_kw[n] = gate_kw[n].clone().requires_grad_()
    return x


def _grad_rel_diffs(names, got, ref):
    """Relative difference (Frobenius norms, float32) of each gradient in got from ref, by input name."""
    return {n: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
            for n, a, b in zip(names, got, ref)}


def _workspace_peak_mib(dev, reset):
    """cula's workspace pool high-water mark on the device, in MiB (0 for a library without it)."""
    f = getattr(_lib.LIB, "cula_workspace_peak_bytes", None)
    return 0.0 if f is None else f(dev.index or 0, 1 if reset else 0) / 2 ** 20


def _backward_kernel(family, inputs):
    """The rows that run cula's forward and backward of one set of inputs (autograd runs the backward
    on a thread of its own, where cula.last_kernel does not look)."""
    from .. import ops

    x, kw, do = inputs
    opts = {n: v for n, v in kw.items() if n != "scale" or v is not None}
    if family == "lightning":
        from ..lightning_attn import lightning_decay

        opts["decay"] = lightning_decay(x["q"].shape[2], *LIGHTNING_LAYER, like=x["q"])
    try:
        fwd = ops.explain("chunk_fwd", family, x["q"], x["k"], x["v"], x.get("g"), x.get("beta"), **opts).kernel
        bwd = ops.explain("chunk_bwd", family, x["q"], x["k"], x["v"], x.get("g"), x.get("beta"), do, **opts).kernel
    except Exception as e:  # recorded, not fatal: the timing stands
        return f"? ({type(e).__name__})"
    return f"{fwd} / {bwd}"


def bench_train(out_dir: str, family: str, gpu_name: str | None = None, configs=None) -> int:
    os.environ["FLA_FLASH_KDA"] = "0"
    import torch

    dev, props, bw = cuda_device(torch)
    configs = [Row(*c) for c in (configs or CONFIGS) if c[1] == family]
    op = f"{family}_train"
    title = _title(family)
    method = (f"median of {TRAIN_REPS} forward + backward steps (torch.autograd.grad of o against a fixed random "
              "gradient, every differentiable input), single synchronized calls, the implementations taking turns "
              "call by call, torch SDPA (causal, forward + backward) in a block of its own; rel. diff vs FLA: the "
              "largest relative difference (Frobenius norms) of a gradient from FLA's on the same step")
    meta = dict(gpu=gpu_name or props.name, copy_gb_per_s=round(bw, 1), torch=torch.__version__,
                fla=_version("fla-core"), date=time.strftime("%Y-%m-%d"), binding=_lib.binding(), method=method,
                queued_method=QUEUED_METHOD.replace(f"median of {REPS}", f"median of {TRAIN_REPS}"))
    records, rows, queued_rows = [], [], []
    prog = Progress(len(configs), f"bench train {family}")
    for name, fam, B, T, H, HV, seqlens, K, V in configs:
        if seqlens:
            T = sum(seqlens)
        cula_fn, fla_fn = _train_fns(fam)
        cu = torch.tensor([0] + list(itertools.accumulate(seqlens)), device=dev, dtype=torch.int32) if seqlens else None
        sets = []
        for _ in range(2):
            kw = dict(scale=K ** -0.5, cu_seqlens=cu)
            if fam == "kda":
                kw.update(_kda_gate(torch, "softplus", HV, K, dev))
            elif fam == "gdn":
                kw.update(use_qk_l2norm_in_kernel=True)
            x = _leaves(torch, fam, B, T, H, HV, dev, kw, K, V)
            do = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
            sets.append((x, kw, do))

        def step(fn, i, s=sets, fam=fam):
            x, kw, do = s[i % 2]
            return torch.autograd.grad(_call(fam, fn, x, kw), _wrt(x, kw), do)

        config = dict(name=name, family=fam, B=B, T=T, H=H, HV=HV, K=K, V=V, seqlens=seqlens, dtype="bfloat16")
        impls = [("cula", lambda i: step(cula_fn, i))]
        check = {}
        try:  # a configuration FLA refuses is recorded as its refusal
            fla_grads = step(fla_fn, 0)
            impls.append(("fla_triton", lambda i: step(fla_fn, i)))
        except Exception as e:
            records.append(dict(op=op, config=config, impl="fla_triton", refused=f"{type(e).__name__}: {e}"[:300]))
        else:  # the same function: every gradient of the same step against FLA's
            diffs = _grad_rel_diffs(_wrt_names(*sets[0][:2]), step(cula_fn, 0), fla_grads)
            fla_grads = None
            check = {"rel_vs_fla": max(diffs.values())}
            records.append(dict(op=op, config=config, impl="grad_rel_diff_vs_fla", by_input=diffs))
        sdpa_sets = None
        if H == HV:
            sdpa_sets = [{n: torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
                          for n in "qkv"} for _ in range(2)]

        def run_sdpa(i):
            x = sdpa_sets[i % 2]
            o = causal_sdpa(x, seqlens)
            if o is not None:
                torch.autograd.grad(o, [x[n] for n in "qkv"], torch.ones_like(o))

        res = time_interleaved(torch, impls, TRAIN_REPS)
        resq = time_interleaved(torch, impls, TRAIN_REPS, queued=True)
        if sdpa_sets is not None and not seqlens:
            res["torch_sdpa"] = time_interleaved(torch, [("torch_sdpa", run_sdpa)], TRAIN_REPS)["torch_sdpa"]
            resq["torch_sdpa"] = time_interleaved(torch, [("torch_sdpa", run_sdpa)], TRAIN_REPS,
                                                  queued=True)["torch_sdpa"]

        # the backward alone: forward graphs built once, torch.autograd.grad(retain_graph) timed
        graphs = {}
        for impl, fn in (("cula", cula_fn), ("fla_triton", fla_fn)):
            if impl not in res:
                continue
            graphs[impl] = []
            for x, kw, do in sets:
                graphs[impl].append((_call(fam, fn, x, kw), _wrt(x, kw), do))

        def bwd(impl):
            return lambda i: torch.autograd.grad(graphs[impl][i % 2][0], graphs[impl][i % 2][1], graphs[impl][i % 2][2],
                                                 retain_graph=True)

        res_bwd = time_interleaved(torch, [(impl, bwd(impl)) for impl in graphs], TRAIN_REPS, queued=True)
        graphs = None  # the retained forward graphs freed

        peak = {}
        for impl, fn in impls:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _workspace_peak_mib(dev, reset=True)
            fn(0)
            torch.cuda.synchronize()
            # torch's allocator and cula's own workspace pool, added (an upper bound for cula)
            peak[impl] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20 + _workspace_peak_mib(dev, reset=False)

        gate_bytes = {"kda": K * 2 + 2, "gdn": 4 + 2, "gla": K * 2, "simple_gla": 4, "lightning": 0}[fam]
        floor_bytes = B * T * (H * 2 * K * 2 + HV * (V * 2 * 2 + gate_bytes)) * 2  # inputs + o, then their gradients
        floor = floor_bytes / (bw * 1e9) * 1e3
        for impl in res:
            records.append(dict(op=op, config=config, impl=impl, median_ms=round(res[impl], 4),
                                median_ms_queued=round(resq[impl], 4), reps=TRAIN_REPS,
                                **({"backward_ms_queued": round(res_bwd[impl], 4)} if impl in res_bwd else {}),
                                **({"peak_mib": round(peak[impl], 1)} if impl in peak else {})))
        records.append(dict(op=op, config=config, impl="floor", median_ms=round(floor, 4),
                            note="inputs read and o written, then d_out read and the gradients written, at the copy "
                                 "bandwidth"))
        if "fla_triton" in res:
            records.append(dict(op=op, config=config, impl="ratio_fla_triton_over_cula",
                                ratio=round(res["fla_triton"] / res["cula"], 3),
                                ratio_queued=round(resq["fla_triton"] / resq["cula"], 3),
                                ratio_backward_queued=round(res_bwd["fla_triton"] / res_bwd["cula"], 3)))
        kernel = _backward_kernel(fam, sets[0])
        records.append(dict(op=op, config=config, impl="cula_kernel", name=kernel))
        rows.append((name, res, floor, kernel, check))
        queued_rows.append((name, resq, floor, "", {}))
        prog.step(f"{name}: cula {resq['cula']:.2f} ms queued, backward {res_bwd['cula']:.2f} ms")
        sets = sdpa_sets = None
        torch.cuda.empty_cache()
        _report(out_dir, op, title, meta, rows, records, queued_rows, quiet=True)  # a run cut short keeps it
    _report(out_dir, op, title, meta, rows, records, queued_rows, quiet=False)
    return 0


def _title(family):
    label = {"simple_gla": "Simple GLA", "lightning": "Lightning"}.get(family, family.upper())
    return f"{label} training step (forward + backward): cula's drop-in against FLA Triton"


def merged_report(out_dir, op, title, meta, rows, records, queued_rows):
    """The report of merged training runs (common.merge_reports' writer for the *_train ops): the
    suite's own tables, the backward-alone and peak-memory one included, drawn from the records, under
    the suite's title (title: merge_reports' generic one, not used)."""
    family = op[: -len("_train")]
    return _report(out_dir, op, _title(family), meta, rows, records, queued_rows, quiet=True)


# merge_reports' writers of the training suites
MERGE_WRITERS = {f"{family}_train": merged_report for family in FAMILIES}


def _report(out_dir, op, title, meta, rows, records, queued_rows, quiet):
    """write_report's files, with the backward-alone and peak-memory table (from the records'
    backward_ms_queued and peak_mib) and FLA's refusals added."""
    peers = ["fla_triton", "torch_sdpa"]
    lines = write_report(out_dir, op, title, meta, rows, records, peers, quiet=True, queued_rows=queued_rows)
    lines += ["", "## Backward alone (queued) and peak memory of one step", "",
              "| config | cula bwd ms | FLA bwd ms | FLA/cula | cula peak MiB | FLA peak MiB |", "|---|---|---|---|---|---|"]
    by_name = {}
    for r in records:
        if isinstance(r.get("config"), dict) and "backward_ms_queued" in r:
            by_name.setdefault(r["config"]["name"], {})[r["impl"]] = r
    for name, mine in by_name.items():
        rb = {impl: r["backward_ms_queued"] for impl, r in mine.items()}
        pk = {impl: r["peak_mib"] for impl, r in mine.items() if "peak_mib" in r}
        fla = rb.get("fla_triton")
        fla_ms, ratio = ("-", "-") if fla is None else (f"{fla:.3f}", f"{fla / rb['cula']:.2f}x")
        fla_peak = f"{pk['fla_triton']:.0f}" if "fla_triton" in pk else "-"
        lines.append(f"| {name} | {rb['cula']:.3f} | {fla_ms} | {ratio} | {pk['cula']:.0f} | {fla_peak} |")
    refusals = [r for r in records if r.get("refused")]
    if refusals:
        lines += ["", "FLA refused: " + "; ".join(f"{r['config']['name']}: {r['refused']}" for r in refusals)]
    with open(os.path.join(out_dir, f"{op}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))
