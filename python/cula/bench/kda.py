"""``cula bench kda``: the KDA chunked forward side by side in one process with every peer present:
FLA's Triton chunk_kda (FLA_FLASH_KDA=0, checked), FlashKDA when importable, torch SDPA (causal
softmax attention, the baseline) and the floor (the bytes that must move, at the measured copy
bandwidth).

bf16 q/k/v, bf16 raw gate with the gate computed in kernel (A_log, dt_bias, lower bound -5),
q/k L2 norm, beta sigmoid, K = V = 128, no initial state. Each implementation's single calls are
timed with CUDA events (median of 30 after warm-up), cula, FLA and FlashKDA taking turns call by
call on alternating input sets, and torch SDPA after them in a block of its own. A second pass times
queued calls (triton.testing.do_bench's method: L2 flushed before each call, no synchronization
between calls), which is the GPU's time per call with the host's time hidden. Rows that the
front's segment planner cuts (``_segments.plan``: few sequences and heads, long sequences) add
``cula_segments``: the same call in the planned parallel segments (``cula/_segments.py``), which is
what FLA's drop-ins and Level 1 run there; shown as a peer (a ratio below 1: the segments are
faster than the engine's uncut call, which Level 0 runs).
"""

from __future__ import annotations

import itertools
import json
import os
import time

from .common import PEERS_AND_BASELINE_METHOD, QUEUED_METHOD, causal_sdpa, measure_config, rows_of_records, write_report
from .decode import _version, cuda_device
from .. import _lib
from ..cli.demo import Progress

K = V = 128
LOWER_BOUND = -5.0
CONFIGS = [
    # (name, B, T, H, seqlens)
    ("1x4096 H64", 1, 4096, 64, None),
    ("1x8192 H64", 1, 8192, 64, None),
    ("1x16384 H64", 1, 16384, 64, None),
    ("1x32768 H64", 1, 32768, 64, None),
    ("2x8192 H64", 2, 8192, 64, None),
    ("8x4096 H32", 8, 4096, 32, None),
    ("1x8192 H96", 1, 8192, 96, None),
    ("1x8192 H16", 1, 8192, 16, None),
    ("1x8192 H32", 1, 8192, 32, None),
    ("varlen6 H64", 1, None, 64, [1300, 547, 2048, 963, 271, 3063]),
    ("varlen 8x1024 H64", 1, None, 64, [1024] * 8),
    ("varlen [512,7680] H64", 1, None, 64, [512, 7680]),
    # serving prefill: many short sequences, and a mix with many below one chunk (64 tokens)
    ("varlen 64x512 H32", 1, None, 32, [512] * 64),
    ("varlen 96 short H32", 1, None, 32, [1, 7, 16, 33, 48, 63, 100, 250] * 12),
    # few heads, long sequences (B x H too small to fill the GPU)
    ("1x65536 H16", 1, 65536, 16, None),
    ("1x32768 H4", 1, 32768, 4, None),
]
def _peers():
    """FLA's Triton chunk_kda (with FlashKDA dispatch off) and FlashKDA, each when importable."""
    os.environ["FLA_FLASH_KDA"] = "0"
    fla_fn = flash_fn = None
    try:
        from fla.ops.kda import chunk_kda as fla_fn
    except Exception as e:
        print(f"FLA not importable ({e})")
    try:  # FLA would hand chunk_kda to FlashKDA when that is installed: check the switch took
        from fla.ops.kda.backends.flash_kda import FlashKDABackend

        if FlashKDABackend().is_enabled():
            raise RuntimeError("FLA's FlashKDA dispatch is still enabled; FLA_FLASH_KDA=0 did not take")
    except ImportError:
        pass
    try:
        import flash_kda

        flash_fn = flash_kda.fwd
    except Exception as e:
        print(f"FlashKDA not importable ({e})")
    return fla_fn, flash_fn


def _flashkda_version():
    """FlashKDA's package version, or where the importable module came from when it was built in place
    (no package metadata)."""
    v = _version("flash_kda")
    if v != "absent":
        return v
    import flash_kda

    return f"built from source, no package metadata ({os.path.dirname(flash_kda.__file__)})"


def _done_rows(out_dir, gpu, method):
    """Records, table rows and queued-timing rows of the configurations already in
    out_dir/kda_fwd.json (same GPU and timing method), for a resumed run; the report puts them in
    grid order and recomputes the geometric means."""
    path = os.path.join(out_dir, "kda_fwd.json")
    if not os.path.exists(path):
        return [], [], []
    with open(path) as f:
        data = json.load(f)
    meta = data.get("meta", {})
    if meta.get("gpu") != gpu or meta.get("method") != method:  # rows of one file share one method
        return [], [], []
    records = [r for r in data["records"] if isinstance(r.get("config"), dict)]
    return (records, *rows_of_records(records))


def _segment_len(B, T, H, seqlens, sms):
    """The segment length of the cula_segments row: the planner's for this call (None: the front
    does not cut it, and the row is not run)."""
    from .._segments import plan

    return None if seqlens else plan(B, T, H, K, V, sms)


def bench_kda(out_dir: str, gpu_name: str | None = None, configs=None, resume=False) -> int:
    """Writes the results after every configuration; with resume, the configurations already in
    out_dir's kda_fwd.json (measured on this GPU) are kept and not run again."""
    import torch

    from .. import _segments, ops

    fla_fn, flash_fn = _peers()
    dev, props, bw = cuda_device(torch)
    configs = configs or CONFIGS
    gpu = gpu_name or props.name
    method = PEERS_AND_BASELINE_METHOD + "; FLA with FLA_FLASH_KDA=0, under torch.inference_mode"
    records, rows, queued_rows = _done_rows(out_dir, gpu, method) if resume else ([], [], [])
    done = {r[0] for r in rows}
    configs = [c for c in configs if c[0] not in done]
    meta = dict(gpu=gpu, copy_gb_per_s=round(bw, 1), torch=torch.__version__,
                fla=_version("fla-core"), flashkda=_flashkda_version() if flash_fn else None,
                date=time.strftime("%Y-%m-%d"), binding=_lib.binding(), method=method, queued_method=QUEUED_METHOD)
    prog = Progress(len(configs), "bench kda")
    for name, B, T, H, seqlens in configs:
        if seqlens:
            T = sum(seqlens)
        scale = K ** -0.5
        sets = []
        for _ in range(2):
            sets.append(dict(q=torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16),
                             k=torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16),
                             v=torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16),
                             g=torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16),
                             beta=torch.randn(B, T, H, device=dev, dtype=torch.bfloat16),
                             out=torch.empty(B, T, H, V, device=dev, dtype=torch.bfloat16)))
        A_log = torch.rand(H, device=dev) - 0.5
        dt_bias = torch.randn(H, K, device=dev) * 0.1
        cu64 = torch.tensor([0] + list(itertools.accumulate(seqlens)), device=dev,
                            dtype=torch.int64) if seqlens else None
        gate = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, A_log=A_log,
                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)

        def run_cula(i, s=sets):
            x = s[i % 2]
            ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, dt_bias=dt_bias, cu_seqlens=cu64,
                          out=x["out"], **gate)

        def run_fla(i, s=sets):
            x = s[i % 2]
            return fla_fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, dt_bias=dt_bias.view(-1),
                          cu_seqlens=cu64, **gate)

        def run_flash(i, s=sets):
            x = s[i % 2]
            flash_fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["out"], A_log, dt_bias, LOWER_BOUND,
                     cu_seqlens=cu64)

        def run_sdpa(i, s=sets):
            causal_sdpa(s[i % 2], seqlens)

        seg_len = _segment_len(B, T, H, seqlens, props.multi_processor_count)

        def run_segments(i, s=sets):  # few heads: parallel segments (_segments), the same arguments
            x = s[i % 2]
            return _segments.forward("kda", x["q"], x["k"], x["v"], x["g"], x["beta"], None, seg_len=seg_len,
                                     scale=scale, dt_bias=dt_bias, cu_seqlens=cu64, **gate)[0]

        impls = [("cula", run_cula)]
        if seg_len:
            impls.append(("cula_segments", run_segments))
        if fla_fn:
            impls.append(("fla_triton", run_fla))
        if flash_fn:
            impls.append(("flashkda", run_flash))
        config = dict(name=name, B=B, T=T, H=H, K=K, V=V, seqlens=seqlens, dtype="bfloat16", gate="in_kernel",
                      safe_gate=True, lower_bound=LOWER_BOUND, l2norm=True, beta_sigmoid=True)
        nbytes = B * T * H * (4 * K * 2 + 2 + V * 2)
        floor = nbytes / (bw * 1e9) * 1e3
        res, resq, kernel = measure_config(
            torch, "kda_fwd", name, config, impls, ("torch_sdpa", run_sdpa), floor,
            "q, k, v, g (bf16) and beta read, o written, at the copy bandwidth", records, rows, queued_rows,
            cula_out=lambda s=sets: (run_cula(0), s[0]["out"])[1], fla_out=(lambda: run_fla(0)[0]) if fla_fn else None,
            peers=("fla_triton", "flashkda", "torch_sdpa", "cula_segments"))
        prog.step(f"{name}: cula {res['cula']:.3f} ms (queued {resq['cula']:.3f})")
        del sets
        torch.cuda.empty_cache()
        _report(out_dir, meta, rows, records, queued_rows, quiet=True)  # a run cut short keeps what it measured
    _report(out_dir, meta, rows, records, queued_rows)
    return 0


def _grid_rank(name):
    """Position of a configuration in the grid (names outside it last)."""
    names = [c[0] for c in CONFIGS]
    return names.index(name) if name in names else len(names)


def _report(out_dir, meta, rows, records, queued_rows, quiet=False):
    rows = sorted(rows, key=lambda r: _grid_rank(r[0]))
    queued_rows = sorted(queued_rows, key=lambda r: _grid_rank(r[0]))
    records = sorted(records, key=lambda r: _grid_rank(r["config"]["name"]))
    peers = [p for p in ("fla_triton", "flashkda", "torch_sdpa") if any(p in r[1] for r in rows)]
    write_report(out_dir, "kda_fwd", f"KDA chunked forward, bf16, K=V=128, gate in kernel (lb {LOWER_BOUND}), l2norm, "
                 "beta sigmoid", meta, rows, records, peers, quiet=quiet, queued_rows=queued_rows)
