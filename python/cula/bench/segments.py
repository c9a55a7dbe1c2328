"""``cula bench segments``: few heads, long sequences: the chunked forward uncut (one chain of chunks
per (sequence, head, value slice)), cut into parallel segments of several lengths
(``cula/_segments.py``, CULA_SEGMENT_TOKENS), and FLA's Triton kernel with the same arguments, in
one process: whether and where the segments pay.

KDA as Kimi-Linear runs it (bf16, gate in kernel with lower bound -5, q/k L2 norm, beta sigmoid),
GDN as Qwen3-Next (fp32 log-sigmoid gate, q/k L2 norm; value heads twice the q/k heads), GLA with a
per-channel log-sigmoid gate / 16, simple GLA with a log-sigmoid gate per head, Lightning as layer 3 of 8;
K = V = 128. Few heads per GPU is what tensor parallelism leaves:
Kimi-Linear's 32 heads over 8 GPUs are 4, Qwen3-Next's 16/32 are 2/4. Times: queued GPU time
(triton.testing.do_bench's method, the lead number) and single synchronized calls.
"""

from __future__ import annotations

import json
import os
import time

from .common import PEERS_AND_BASELINE_METHOD, QUEUED_METHOD, time_interleaved
from .decode import _version, cuda_device
from .. import _lib
from ..cli.demo import Progress

K = V = 128
LOWER_BOUND = -5.0
# segment lengths tried (CULA_BENCH_SEGMENTS=L1,L2,... replaces them)
SEGMENTS = tuple(int(x) for x in os.environ.get("CULA_BENCH_SEGMENTS", "1024,2048,4096,8192,16384").split(","))
CONFIGS = [
    # (family, B, T, H, HV)
    ("kda", 1, 32768, 4, 4),
    ("kda", 1, 131072, 4, 4),
    ("kda", 1, 16384, 4, 4),  # below the planner's 32768 tokens
    ("kda", 1, 32768, 8, 8),  # the planner's smallest cut: 4 segments fill the SMs
    ("kda", 2, 16384, 8, 8),
    ("kda", 1, 8192, 4, 4),  # the planner's shortest cut: 4 segments of 2048 tokens
    ("kda", 1, 8192, 16, 16),
    ("kda", 1, 65536, 16, 16),
    ("kda", 1, 32768, 32, 32),
    ("gdn", 1, 8192, 2, 4),
    ("gdn", 1, 16384, 2, 4),
    ("gdn", 1, 32768, 2, 4),
    ("gdn", 1, 131072, 2, 4),
    ("gdn", 1, 65536, 16, 32),
    ("gla", 1, 16384, 4, 4),  # below the planner's 32768 tokens
    ("gla", 1, 32768, 4, 4),
    ("gla", 1, 131072, 4, 4),
    ("gla", 1, 65536, 16, 16),
    ("simple_gla", 1, 32768, 4, 4),
    ("simple_gla", 1, 131072, 4, 4),
    ("lightning", 1, 32768, 4, 4),
]
_FLA = {"kda": ("kda", "chunk_kda"), "gdn": ("gated_delta_rule", "chunk_gated_delta_rule"), "gla": ("gla", "chunk_gla"),
        "simple_gla": ("simple_gla", "chunk_simple_gla"), "lightning": ("lightning_attn", "chunk_lightning_attn")}
LIGHTNING_LAYER, LIGHTNING_LAYERS = 3, 8  # (as `cula bench lightning`)


def config_name(family, B, T, H, HV):
    heads = f"H{H}" if H == HV else f"H{H}/HV{HV}"
    return f"{family} {B}x{T} {heads}"


def _inputs(torch, family, B, T, H, HV, dev):
    import torch.nn.functional as F

    bf = torch.bfloat16
    x = dict(q=torch.randn(B, T, H, K, device=dev, dtype=bf), k=torch.randn(B, T, H, K, device=dev, dtype=bf),
             v=torch.randn(B, T, HV, V, device=dev, dtype=bf))
    if family == "kda":
        x["g"] = torch.randn(B, T, HV, K, device=dev, dtype=bf)
        x["beta"] = torch.randn(B, T, HV, device=dev, dtype=bf)
        kw = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, A_log=torch.rand(HV, device=dev) - 0.5,
                  dt_bias=torch.randn(HV * K, device=dev) * 0.1)
    elif family == "gdn":
        x["g"] = F.logsigmoid(torch.randn(B, T, HV, device=dev))
        x["beta"] = torch.rand(B, T, HV, device=dev, dtype=bf)
        kw = dict(use_qk_l2norm_in_kernel=True)
    elif family == "gla":
        x["g"] = F.logsigmoid(torch.randn(B, T, HV, K, device=dev)) / 16
        x["beta"] = None
        kw = {}
    elif family == "simple_gla":
        x["g"] = F.logsigmoid(torch.randn(B, T, HV, device=dev))
        x["beta"] = None
        kw = {}
    else:  # lightning: a constant decay per head, the drop-in's for layer 3 of 8
        from ..lightning_attn import lightning_decay

        x["g"] = x["beta"] = None
        x["decay"] = lightning_decay(H, LIGHTNING_LAYER, LIGHTNING_LAYERS, like=x["q"])
        kw = {}
    return x, dict(kw, scale=K ** -0.5)


def bench_segments(out_dir: str, gpu_name: str | None = None, configs=None) -> int:
    os.environ["FLA_FLASH_KDA"] = "0"
    import importlib

    import torch

    from .. import _segments, ops

    dev, props, bw = cuda_device(torch)
    configs = configs or CONFIGS
    records = []
    prog = Progress(len(configs), "bench segments")
    for family, B, T, H, HV in configs:
        name = config_name(family, B, T, H, HV)
        sets = [_inputs(torch, family, B, T, H, HV, dev) for _ in range(2)]
        kw = sets[0][1]  # options, and A_log / dt_bias for KDA: the same keywords for cula and FLA

        def uncut(i, s=sets):
            x = s[i % 2][0]
            return ops.chunk_fwd(family, x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("decay"), output_final_state=True,
                                 **kw)[0]

        def cut_at(L, sets=sets):
            def run(i, s=sets):
                x = s[i % 2][0]
                return _segments.forward(family, x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("decay"), seg_len=L,
                                         output_final_state=True, **kw)[0]
            return run

        impls = [("uncut", uncut)]
        impls += [(f"seg{L}", cut_at(L)) for L in SEGMENTS if L < T]
        Lp = _segments.plan(B, T, HV, K, V, props.multi_processor_count) if family in _segments.ENGINE_FAMILIES else None
        if Lp:  # the engine's segments against the same cut as two engine calls (cula/_segments.py)
            def two_calls(i, s=sets, L=Lp):
                x = s[i % 2][0]
                return _segments.forward(family, x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("decay"), seg_len=L,
                                         output_final_state=True, engine=False, **kw)[0]
            impls.append(("two_calls", two_calls))
        try:
            module, fname = _FLA[family]
            fla_fn = getattr(importlib.import_module(f"fla.ops.{module}"), fname)

            def fla(i, s=sets):
                x = s[i % 2][0]
                if family == "lightning":
                    args = (x["q"], x["k"], x["v"], LIGHTNING_LAYER, LIGHTNING_LAYERS)
                else:
                    args = (x["q"], x["k"], x["v"], x["g"]) + ((x["beta"],) if x["beta"] is not None else ())
                return fla_fn(*args, output_final_state=True, **kw)[0]
            impls.append(("fla_triton", fla))
        except Exception as e:  # noqa: BLE001 (a peer that cannot run is reported, not fatal)
            print(f"{name}: FLA not run ({e})")
        ref = uncut(0).float()
        diffs = {}
        with torch.inference_mode():
            for n, fn in impls:
                if n != "uncut":
                    got = fn(0).float()
                    diffs[n] = float((got - ref).norm() / ref.norm())
            queued = time_interleaved(torch, impls, queued=True)
            single = time_interleaved(torch, impls)
        records.append(dict(config=dict(name=name, family=family, B=B, T=T, H=H, HV=HV, K=K, V=V),
                            queued_ms=queued, single_ms=single, rel_diff_vs_uncut=diffs))
        prog.step(f"{name}: uncut {queued['uncut']:.3f} ms queued")
        del sets
        torch.cuda.empty_cache()
        _write(out_dir, gpu_name or props.name, bw, torch, records)
    return 0


def _write(out_dir, gpu, bw, torch, records, note=""):
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(gpu=gpu, copy_gb_per_s=round(bw, 1), torch=torch.__version__, fla=_version("fla-core"),
                date=time.strftime("%Y-%m-%d"), binding=_lib.binding(), method=PEERS_AND_BASELINE_METHOD,
                queued_method=QUEUED_METHOD, segments=list(SEGMENTS),
                sms=torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    with open(os.path.join(out_dir, "segments.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    write_table(out_dir, meta, records, note)


def write_table(out_dir, meta, records, note=""):
    """segments.md from the results (meta and records as segments.json holds them)."""
    from .._segments import DIAGONAL, PLAN_FAMILIES, plan

    segs = [f"seg{L}" for L in meta["segments"]]
    cols = ["uncut"] + segs + ["two_calls", "fla_triton"]

    def planned(c):  # the call the front makes with CULA_SEGMENT_TOKENS unset: "uncut" or "seg<L>"
        L = plan(c["B"], c["T"], c["HV"], c["K"], c["V"], meta["sms"], delta=c["family"] not in DIAGONAL) \
            if c["family"] in PLAN_FAMILIES else None
        return f"seg{L}" if L else "uncut"

    lines = [f"# Few heads, long sequences: the chunked forward uncut and in parallel segments ({meta['gpu']})", "",
             f"Times in ms. Queued calls: {meta['queued_method']}. Single calls: {meta['method']}. `segL`: "
             "`_segments.forward` with segments of L tokens (CULA_SEGMENT_TOKENS=L). Best segments: the fastest "
             "segment length's time over the uncut time (below 1: the segments pay). FLA: FLA's time over the "
             "uncut time. Planned: the call the front makes with CULA_SEGMENT_TOKENS unset (`_segments.plan`: KDA, GDN "
             "and GLA), and FLA's time over its time. KDA and GDN take the chunk engine's own segments (`segment_len`: "
             "the prep once, a summary pass of states only, the fold on the device); `two_calls`: the planned cut as "
             "two engine calls and a fold in torch, as GLA runs it (`_segments.forward(..., engine=False)`; measured "
             "where the planner cuts).", ""]
    for key, title in (("queued_ms", "Queued calls (GPU time)"), ("single_ms", "Single synchronized calls")):
        lines += [f"## {title}", "", "| config | " + " | ".join(cols) + " | best segments / uncut | FLA / uncut | "
                  "planned | FLA / planned |", "|---" * (len(cols) + 5) + "|"]
        for r in records:
            t = r[key]
            cells = [f"{t[c]:.3f}" if c in t else "-" for c in cols]
            best = min((t[c] for c in segs if c in t), default=None)
            ratio = f"{best / t['uncut']:.2f}" if best else "-"
            fla = f"{t['fla_triton'] / t['uncut']:.2f}x" if "fla_triton" in t else "-"
            pl = planned(r["config"])
            fla_pl = f"{t['fla_triton'] / t[pl]:.2f}x" if "fla_triton" in t and pl in t else "-"
            lines.append(f"| {r['config']['name']} | " + " | ".join(cells) + f" | {ratio} | {fla} | {pl} | {fla_pl} |")
        lines.append("")
    worst = max((v for r in records for c, v in r["rel_diff_vs_uncut"].items() if c.startswith("seg")), default=0.0)
    lines.append(f"Largest relative difference of a segmented output from the uncut one: {worst:.1e} (the gates "
                 "forget the state entering a segment within a few tokens, and o is bf16).")
    if note:
        lines += ["", note]
    with open(os.path.join(out_dir, "segments.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
