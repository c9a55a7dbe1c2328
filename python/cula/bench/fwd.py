"""``cula bench gdn|gla|simple_gla|lightning``: a chunked forward side by side in one process with
FLA's Triton kernel of the same name (called with the same arguments as cula's drop-in), torch
SDPA (causal softmax attention, the baseline) and the floor (the bytes that must move, at the
measured copy bandwidth).

bf16 q/k/v, K = V = 128, no initial state. GDN: fp32 log-sigmoid gate, beta in (0, 1), q/k L2
norm in kernel (as Qwen3-Next calls it); GLA: per-channel log-sigmoid gate / 16; simple GLA:
scalar log-sigmoid gate; Lightning: layer 3 of 8 (FLA's per-head decay rates). Each
implementation's single calls are timed with CUDA events (median of 30 after warm-up), the
linear-attention implementations taking turns call by call on alternating input sets, and torch
SDPA after them in a block of its own (its full-power calls would slow whichever call came next).
A second pass times queued calls (triton.testing.do_bench's method), the GPU's time per call.
"""

from __future__ import annotations

import importlib
import itertools
import os
import time

from .common import PEERS_AND_BASELINE_METHOD, QUEUED_METHOD, causal_sdpa, measure_config, write_report
from .decode import _version, cuda_device
from .. import _lib
from ..cli.demo import Progress

K = V = 128
CONFIGS = [
    # (name, B, T, H, seqlens)
    ("1x8192 H64", 1, 8192, 64, None),
    ("2x8192 H32", 2, 8192, 32, None),
    ("1x32768 H32", 1, 32768, 32, None),
    ("4x4096 H64", 4, 4096, 64, None),
    ("varlen6 H64", 1, None, 64, [1300, 547, 2048, 963, 271, 3063]),
]
FAMILIES = {
    # family: (module under fla.ops and cula, function, description)
    "gdn": ("gated_delta_rule", "chunk_gated_delta_rule", "Gated DeltaNet chunked forward, bf16, K=V=128, l2norm"),
    "gla": ("gla", "chunk_gla", "GLA chunked forward, bf16, K=V=128"),
    "simple_gla": ("simple_gla", "chunk_simple_gla", "simple GLA chunked forward, bf16, K=V=128"),
    "lightning": ("lightning_attn", "chunk_lightning_attn", "Lightning attention chunked forward, bf16, K=V=128, "
                  "layer 3 of 8"),
}
LAYER, LAYERS = 3, 8


def _inputs(torch, family, B, T, H, dev):
    import torch.nn.functional as F

    x = dict(q=torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16),
             k=torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16),
             v=torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16))
    if family == "gdn":
        x["g"] = F.logsigmoid(torch.randn(B, T, H, device=dev))
        x["beta"] = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16)
    elif family == "gla":
        x["g"] = F.logsigmoid(torch.randn(B, T, H, K, device=dev)) / 16
    elif family == "simple_gla":
        x["g"] = F.logsigmoid(torch.randn(B, T, H, device=dev))
    return x


def _args(family, x):
    """Positional arguments of the FLA function (and of cula's drop-in)."""
    if family == "gdn":
        return (x["q"], x["k"], x["v"], x["g"], x["beta"])
    if family == "lightning":
        return (x["q"], x["k"], x["v"], LAYER, LAYERS)
    return (x["q"], x["k"], x["v"], x["g"])


def bench_fwd(family: str, out_dir: str, gpu_name: str | None = None, configs=None) -> int:
    os.environ["FLA_FLASH_KDA"] = "0"
    import torch

    module, fname, title = FAMILIES[family]
    cula_fn = getattr(importlib.import_module(f"cula.{module}"), fname)
    try:
        fla_fn = getattr(importlib.import_module(f"fla.ops.{module}"), fname)
    except Exception as e:
        print(f"FLA not importable ({e})")
        fla_fn = None
    op = f"{family}_fwd"
    dev, props, bw = cuda_device(torch)
    configs = configs or CONFIGS
    records, rows, queued_rows = [], [], []
    prog = Progress(len(configs), f"bench {family}")
    for name, B, T, H, seqlens in configs:
        if seqlens:
            T = sum(seqlens)
        scale = K ** -0.5
        sets = [_inputs(torch, family, B, T, H, dev) for _ in range(2)]
        cu64 = torch.tensor([0] + list(itertools.accumulate(seqlens)), device=dev,
                            dtype=torch.int64) if seqlens else None
        kw = dict(scale=scale, cu_seqlens=cu64)
        if family == "gdn":
            kw["use_qk_l2norm_in_kernel"] = True

        def run_cula(i, s=sets):
            return cula_fn(*_args(family, s[i % 2]), **kw)

        def run_fla(i, s=sets):
            return fla_fn(*_args(family, s[i % 2]), **kw)

        def run_sdpa(i, s=sets):
            causal_sdpa(s[i % 2], seqlens)

        impls = [("cula", run_cula)] + ([("fla_triton", run_fla)] if fla_fn else [])
        config = dict(name=name, B=B, T=T, H=H, K=K, V=V, seqlens=seqlens, dtype="bfloat16", family=family)
        gate_bytes = {"gdn": 4 + 2, "gla": 4 * K, "simple_gla": 4, "lightning": 0}[family]
        nbytes = B * T * H * (3 * K * 2 + gate_bytes + V * 2)
        floor = nbytes / (bw * 1e9) * 1e3
        res, resq, kernel = measure_config(
            torch, op, name, config, impls, ("torch_sdpa", run_sdpa), floor,
            "q, k, v (bf16), gate and beta read, o written, at the copy bandwidth", records, rows, queued_rows,
            cula_out=lambda: run_cula(0)[0], fla_out=(lambda: run_fla(0)[0]) if fla_fn else None)
        prog.step(f"{name}: cula {res['cula']:.3f} ms (queued {resq['cula']:.3f})")
        del sets
        torch.cuda.empty_cache()
    meta = dict(gpu=gpu_name or props.name, copy_gb_per_s=round(bw, 1), torch=torch.__version__,
                fla=_version("fla-core"), date=time.strftime("%Y-%m-%d"), binding=_lib.binding(),
                method=PEERS_AND_BASELINE_METHOD + "; cula's FLA drop-in and FLA called with the same arguments, "
                "under torch.inference_mode", queued_method=QUEUED_METHOD)
    peers = [p for p in ("fla_triton", "torch_sdpa") if any(p in r[1] for r in rows)]
    write_report(out_dir, op, title, meta, rows, records, peers, queued_rows=queued_rows)
    return 0
