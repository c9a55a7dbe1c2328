"""``cula bench coverage``: the configurations real models run, each side by side in one process with
FLA's Triton kernel called with the same arguments as cula's drop-in (FLA_FLASH_KDA=0), and torch
SDPA (causal softmax attention, the baseline). A drop-in promises never to be slower than FLA on a
configuration FLA runs; this grid is that promise's check, so it holds the model configurations
(not only the ones that suit cula), including those that still leave the tensor-core kernels.

Rows: Kimi-Linear KDA (FLA's KimiDeltaAttention gate: -e^{A_log} softplus(g + dt_bias) with no lower
bound, A_log = log U(1, 16) and dt_bias at the layer's initialisation, q/k L2 norm and beta sigmoid in
kernel), dense, with grouped value heads, and varlen; KDA with lower bound -5 (safe gate); KDA at
K = V = 64; Qwen3-Next GDN (16 q/k heads, 32 value heads, K = V = 128); GDN with V = 2K = 256
(a GatedDeltaNet layer with head_dim 128 and FLA's expand_v = 2); FLA's default GatedDeltaNet layer
(head_dim 256, expand_v 2: K = 256, V = 512, 6 heads); fp16 and fp32 inputs (simple GLA too, whose
scalar log-decay is a log-sigmoid); simple GLA with K = 256 (FLA's tests use it). bf16 unless the row
says fp16 or fp32.
Timing as ``cula bench kda``: single synchronized calls, then queued calls (the GPU's time per call).
Then decode with each of these (DECODE_CONFIGS: one token for each of N sequences through FLA's public
fused_recurrent functions, and float32 fused_recurrent rows of T tokens), written to
decode_coverage.{json,md}.
"""

from __future__ import annotations

import itertools
import math
import os
import time

from .common import PEERS_AND_BASELINE_METHOD, QUEUED_METHOD, causal_sdpa, measure_config, write_report
from .decode import _version, cuda_device
from .. import _lib
from ..cli.demo import Progress

VARLEN = [1300, 547, 2048, 963, 271, 3063]
# (name, family, B, T, H, HV, K, V, seqlens, dtype, gate): gate "softplus" (Kimi-Linear), "bounded"
# (lower bound -5) for KDA; GDN's gate is always the log-sigmoid of a random projection
CONFIGS = [
    ("Kimi-Linear KDA 1x8192 H32", "kda", 1, 8192, 32, 32, 128, 128, None, "bfloat16", "softplus"),
    ("Kimi-Linear KDA GVA 1x8192 H16/HV32", "kda", 1, 8192, 16, 32, 128, 128, None, "bfloat16", "softplus"),
    ("Kimi-Linear KDA 2x4096 H32", "kda", 2, 4096, 32, 32, 128, 128, None, "bfloat16", "softplus"),
    ("Kimi-Linear KDA varlen6 H32", "kda", 1, None, 32, 32, 128, 128, VARLEN, "bfloat16", "softplus"),
    ("KDA lower bound -5 1x8192 H32", "kda", 1, 8192, 32, 32, 128, 128, None, "bfloat16", "bounded"),
    ("KDA K=V=64 1x8192 H32", "kda", 1, 8192, 32, 32, 64, 64, None, "bfloat16", "softplus"),
    ("KDA fp16 1x8192 H32", "kda", 1, 8192, 32, 32, 128, 128, None, "float16", "softplus"),
    ("Qwen3-Next GDN 1x8192 H16/HV32", "gdn", 1, 8192, 16, 32, 128, 128, None, "bfloat16", None),
    ("Qwen3-Next GDN varlen6 H16/HV32", "gdn", 1, None, 16, 32, 128, 128, VARLEN, "bfloat16", None),
    ("GDN K=128 V=256 1x8192 H16", "gdn", 1, 8192, 16, 16, 128, 256, None, "bfloat16", None),
    ("GDN K=128 V=256 2x4096 H16", "gdn", 2, 4096, 16, 16, 128, 256, None, "bfloat16", None),
    ("FLA-default GDN K=256 V=512 1x8192 H6", "gdn", 1, 8192, 6, 6, 256, 512, None, "bfloat16", None),
    ("GDN fp16 1x8192 H16/HV32", "gdn", 1, 8192, 16, 32, 128, 128, None, "float16", None),
    ("Kimi-Linear KDA fp32 1x8192 H32", "kda", 1, 8192, 32, 32, 128, 128, None, "float32", "softplus"),
    ("Qwen3-Next GDN fp32 1x8192 H16/HV32", "gdn", 1, 8192, 16, 32, 128, 128, None, "float32", None),
    ("Simple GLA fp16 1x8192 H32", "simple_gla", 1, 8192, 32, 32, 128, 128, None, "float16", None),
    ("Simple GLA fp32 1x8192 H32", "simple_gla", 1, 8192, 32, 32, 128, 128, None, "float32", None),
    # K = 256 (FLA's tests use it): the fused engine's own K = 256 kernel
    ("Simple GLA K=256 1x8192 H16", "simple_gla", 1, 8192, 16, 16, 256, 128, None, "bfloat16", None),
    ("Simple GLA K=256 2x4096 H32", "simple_gla", 2, 4096, 32, 32, 256, 128, None, "bfloat16", None),
]


# Decode (one token per sequence, the state of every sequence read and written): the same model
# configurations through FLA's public fused_recurrent functions, as FLA's layers call them at
# inference (q [N, T, H, K], initial_state [N, HV, K, V] float32, output_final_state=True); T = 1,
# and a few rows of T tokens per sequence (fused_recurrent over a short prefill: float32 inputs,
# which FLA computes in float32 and cula on its float32 recurrent kernel).
# (name, family, N, T, H, HV, K, V, dtype, gate)
DECODE_CONFIGS = [
    ("Kimi-Linear KDA decode N64 H32", "kda", 64, 1, 32, 32, 128, 128, "bfloat16", "softplus"),
    ("Kimi-Linear KDA decode N256 H32", "kda", 256, 1, 32, 32, 128, 128, "bfloat16", "softplus"),
    ("Kimi-Linear KDA GVA decode N256 H16/HV32", "kda", 256, 1, 16, 32, 128, 128, "bfloat16", "softplus"),
    ("KDA lower bound -5 decode N256 H32", "kda", 256, 1, 32, 32, 128, 128, "bfloat16", "bounded"),
    ("KDA K=V=64 decode N256 H32", "kda", 256, 1, 32, 32, 64, 64, "bfloat16", "softplus"),
    ("KDA fp16 decode N256 H32", "kda", 256, 1, 32, 32, 128, 128, "float16", "softplus"),
    ("Qwen3-Next GDN decode N64 H16/HV32", "gdn", 64, 1, 16, 32, 128, 128, "bfloat16", None),
    ("Qwen3-Next GDN decode N256 H16/HV32", "gdn", 256, 1, 16, 32, 128, 128, "bfloat16", None),
    ("GDN K=128 V=256 decode N256 H16", "gdn", 256, 1, 16, 16, 128, 256, "bfloat16", None),
    ("FLA-default GDN K=256 V=512 decode N256 H6", "gdn", 256, 1, 6, 6, 256, 512, "bfloat16", None),
    ("GDN fp16 decode N256 H16/HV32", "gdn", 256, 1, 16, 32, 128, 128, "float16", None),
    ("GDN fp32 fused_recurrent 2x1024 H4/HV8", "gdn", 2, 1024, 4, 8, 128, 128, "float32", None),
    ("Qwen3-Next GDN fp32 fused_recurrent 1x8192 H16/HV32", "gdn", 1, 8192, 16, 32, 128, 128, "float32", None),
    ("Kimi-Linear KDA fp32 fused_recurrent 2x1024 H32", "kda", 2, 1024, 32, 32, 128, 128, "float32", "softplus"),
]


def _decode_fns(family):
    if family == "kda":
        from fla.ops.kda import fused_recurrent_kda as fla_fn

        from ..kda import fused_recurrent_kda as cula_fn
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn

        from ..gated_delta_rule import fused_recurrent_gated_delta_rule as cula_fn
    return cula_fn, fla_fn


def _fns(family):
    if family == "kda":
        from fla.ops.kda import chunk_kda as fla_fn

        from ..kda import chunk_kda as cula_fn
    elif family == "simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla as fla_fn

        from ..simple_gla import chunk_simple_gla as cula_fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn

        from ..gated_delta_rule import chunk_gated_delta_rule as cula_fn
    return cula_fn, fla_fn


def _inputs(torch, family, B, T, H, HV, K, V, dtype, dev):
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    x = dict(q=torch.randn(B, T, H, K, device=dev, dtype=dt), k=torch.randn(B, T, H, K, device=dev, dtype=dt),
             v=torch.randn(B, T, HV, V, device=dev, dtype=dt))
    if family == "kda":
        x["g"] = torch.randn(B, T, HV, K, device=dev, dtype=dt)
        x["beta"] = torch.randn(B, T, HV, device=dev, dtype=dt)
    else:
        x["g"] = F.logsigmoid(torch.randn(B, T, HV, device=dev))
        if family == "gdn":
            x["beta"] = torch.rand(B, T, HV, device=dev, dtype=dt)
    return x


def _kda_gate(torch, gate, HV, K, dev):
    """The gate arguments: KimiDeltaAttention's initialisation (A_log = log U(1, 16), dt_bias the
    inverse softplus of dt = e^{U(log 1e-3, log 0.1)}) with no lower bound, or its safe gate (A_log 0,
    lower bound -5)."""
    dt = torch.exp(torch.rand(HV * K, device=dev) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    kw = dict(use_gate_in_kernel=True, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if gate == "bounded":
        return dict(kw, A_log=torch.zeros(HV, device=dev), safe_gate=True, lower_bound=-5.0)
    return dict(kw, A_log=torch.log(torch.empty(HV, device=dev).uniform_(1, 16)))


def bench_coverage(out_dir: str, gpu_name: str | None = None, configs=None, decode_configs=None) -> int:
    """The forward grid (configs, default CONFIGS) to fwd_coverage.*, then the decode grid
    (decode_configs, default DECODE_CONFIGS) to decode_coverage.*; an empty list skips its grid."""
    os.environ["FLA_FLASH_KDA"] = "0"
    import torch

    dev, props, bw = cuda_device(torch)
    configs = CONFIGS if configs is None else configs
    decode_configs = DECODE_CONFIGS if decode_configs is None else decode_configs
    if configs:
        _forward_grid(torch, dev, props, bw, out_dir, gpu_name, configs)
    if decode_configs:
        _decode_grid(torch, dev, props, bw, out_dir, gpu_name, decode_configs)
    return 0


def _decode_grid(torch, dev, props, bw, out_dir, gpu_name, configs):
    op = "decode_coverage"
    title = ("Model configurations, decode (one token per sequence; the fused_recurrent rows T tokens): cula's "
             "drop-ins against FLA Triton")
    meta = dict(gpu=gpu_name or props.name, copy_gb_per_s=round(bw, 1), torch=torch.__version__,
                fla=_version("fla-core"), date=time.strftime("%Y-%m-%d"), binding=_lib.binding(),
                method=PEERS_AND_BASELINE_METHOD.split(", torch SDPA")[0] + "; FLA's public fused_recurrent function "
                "and cula's drop-in called with the same arguments (q [N, T, H, K], float32 states [N, HV, K, V] in, "
                "final states out), under torch.inference_mode", queued_method=QUEUED_METHOD.split(", torch SDPA")[0])
    records, rows, queued_rows = [], [], []
    prog = Progress(len(configs), "bench coverage (decode)")
    for name, family, N, T, H, HV, K, V, dtype, gate in configs:
        cula_fn, fla_fn = _decode_fns(family)
        sets = []
        for _ in range(2):
            x = _inputs(torch, family, N, T, H, HV, K, V, dtype, dev)
            x["initial_state"] = torch.randn(N, HV, K, V, device=dev) * 0.1
            sets.append(x)
        kw = dict(scale=K ** -0.5, output_final_state=True)
        kw.update(_kda_gate(torch, gate, HV, K, dev) if family == "kda" else dict(use_qk_l2norm_in_kernel=True))
        if family == "kda":
            kw.pop("safe_gate", None)  # (a chunked-kernel option; the recurrent functions take lower_bound alone)

        def call(fn, i, s=sets, kw=kw):
            x = s[i % 2]
            if family == "kda":
                return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], **kw)
            return fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"], **kw)

        config = dict(name=name, family=family, N=N, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, gate=gate,
                      state_dtype="float32")
        impls = [("cula", lambda i: call(cula_fn, i))]
        fla_error = None
        try:
            with torch.inference_mode():
                call(fla_fn, 0)
            impls.append(("fla_triton", lambda i: call(fla_fn, i)))
        except Exception as e:  # a configuration FLA refuses is recorded as its refusal
            fla_error = f"{type(e).__name__}: {e}"[:300]
            records.append(dict(op=op, config=config, impl="fla_triton", refused=fla_error))
        isz = 2 if dtype != "float32" else 4
        nbytes = 2 * N * HV * K * V * 4 + N * T * (H * 2 * K * isz + HV * (2 * V * isz + (K * isz if family == "kda" else 4) + isz))
        floor = nbytes / (bw * 1e9) * 1e3
        res, resq, kernel = measure_config(
            torch, op, name, config, impls, None, floor,
            "the states read and written (float32), q, k, v, gate and beta read, o written, at the copy bandwidth",
            records, rows, queued_rows, cula_out=lambda: call(cula_fn, 0)[0],
            fla_out=None if fla_error else (lambda: call(fla_fn, 0)[0]), peers=("fla_triton",), ratio_queued=True)
        prog.step(f"{name}: cula {res['cula']:.3f} ms (queued {resq['cula']:.3f}) on {kernel}")
        del sets
        torch.cuda.empty_cache()
        write_report(out_dir, op, title, meta, rows, records, ["fla_triton"], quiet=True, queued_rows=queued_rows)
    write_report(out_dir, op, title, meta, rows, records, ["fla_triton"], queued_rows=queued_rows)


def _forward_grid(torch, dev, props, bw, out_dir, gpu_name, configs):
    op = "fwd_coverage"
    title = "Model configurations, chunked forward: cula's drop-ins against FLA Triton"
    meta = dict(gpu=gpu_name or props.name, copy_gb_per_s=round(bw, 1), torch=torch.__version__,
                fla=_version("fla-core"), date=time.strftime("%Y-%m-%d"), binding=_lib.binding(),
                method=PEERS_AND_BASELINE_METHOD + "; cula's FLA drop-in and FLA called with the same arguments, "
                "under torch.inference_mode", queued_method=QUEUED_METHOD)
    records, rows, queued_rows = [], [], []
    prog = Progress(len(configs), "bench coverage")
    for name, family, B, T, H, HV, K, V, seqlens, dtype, gate in configs:
        if seqlens:
            T = sum(seqlens)
        cula_fn, fla_fn = _fns(family)
        sets = [_inputs(torch, family, B, T, H, HV, K, V, dtype, dev) for _ in range(2)]
        cu = torch.tensor([0] + list(itertools.accumulate(seqlens)), device=dev, dtype=torch.int32) if seqlens else None
        kw = dict(scale=K ** -0.5, cu_seqlens=cu)
        if family == "kda":
            kw.update(_kda_gate(torch, gate, HV, K, dev))
        elif family == "gdn":
            kw.update(use_qk_l2norm_in_kernel=True)

        def call(fn, i, s=sets, kw=kw):
            x = s[i % 2]
            return fn(x["q"], x["k"], x["v"], x["g"], *([x["beta"]] if "beta" in x else []), **kw)

        def run_sdpa(i, s=sets):
            causal_sdpa({n: s[i % 2][n] for n in "qkv"} if H == HV and K == V else
                        {"q": s[i % 2]["v"], "k": s[i % 2]["v"], "v": s[i % 2]["v"]}, seqlens)

        config = dict(name=name, family=family, B=B, T=T, H=H, HV=HV, K=K, V=V, seqlens=seqlens, dtype=dtype,
                      gate=gate)
        impls = [("cula", lambda i: call(cula_fn, i))]
        fla_error = None
        try:  # a configuration FLA refuses is recorded as its refusal
            with torch.inference_mode():
                call(fla_fn, 0)
            impls.append(("fla_triton", lambda i: call(fla_fn, i)))
        except Exception as e:
            fla_error = f"{type(e).__name__}: {e}"[:300]
            records.append(dict(op=op, config=config, impl="fla_triton", refused=fla_error))
        isz = 2 if dtype != "float32" else 4
        gate_bytes = isz * K + isz if family == "kda" else 4 + (isz if family == "gdn" else 0)
        nbytes = B * T * (H * 2 * K * isz + HV * (V * isz * 2 + gate_bytes))
        floor = nbytes / (bw * 1e9) * 1e3
        res, resq, kernel = measure_config(
            torch, op, name, config, impls, ("torch_sdpa", run_sdpa), floor,
            "q, k, v, gate and beta read, o written, at the copy bandwidth", records, rows, queued_rows,
            cula_out=lambda: call(cula_fn, 0)[0], fla_out=None if fla_error else (lambda: call(fla_fn, 0)[0]),
            ratio_queued=True)
        prog.step(f"{name}: cula {res['cula']:.3f} ms (queued {resq['cula']:.3f}) on {kernel}")
        del sets
        torch.cuda.empty_cache()
        write_report(out_dir, op, title, meta, rows, records, ["fla_triton", "torch_sdpa"], quiet=True,
                     queued_rows=queued_rows)  # a run cut short keeps what it measured
    write_report(out_dir, op, title, meta, rows, records, ["fla_triton", "torch_sdpa"], queued_rows=queued_rows)
