"""``cula demo``: every family on the best backend present, checked against the float64
reference, then linear attention's linear cost against softmax attention's quadratic cost."""

from __future__ import annotations

import sys
import time

import numpy as np

from .. import ops


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = total, 0, label
        self._draw()

    def step(self, what: str = "") -> None:
        self.done += 1
        self._draw(what)

    def _draw(self, what: str = "") -> None:
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {what:<28}")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _inputs(rng, family, B, T, H, K, V):
    f32 = np.float32
    q = rng.standard_normal((B, T, H, K), dtype=f32)
    k = rng.standard_normal((B, T, H, K), dtype=f32)
    v = rng.standard_normal((B, T, H, V), dtype=f32)
    kw = dict(use_qk_l2norm_in_kernel=True)
    if family == "kda":
        kw.update(g=rng.standard_normal((B, T, H, K), dtype=f32), beta=rng.standard_normal((B, T, H), dtype=f32),
                  A_log=rng.uniform(-1, 0.5, H).astype(f32), dt_bias=rng.standard_normal(H * K, dtype=f32) * 0.5,
                  use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    elif family == "gdn":
        kw.update(g=rng.standard_normal((B, T, H), dtype=f32), beta=rng.standard_normal((B, T, H), dtype=f32),
                  A_log=rng.uniform(-1, 0.5, H).astype(f32), dt_bias=rng.standard_normal(H, dtype=f32) * 0.5,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    elif family == "gla":
        kw.update(g=-rng.uniform(0.001, 0.3, (B, T, H, K)).astype(f32))
    elif family == "simple_gla":
        kw.update(g=-rng.uniform(0.001, 0.3, (B, T, H)).astype(f32))
    else:
        kw.update(decay=rng.uniform(0.01, 0.5, H).astype(f32))
    return q, k, v, kw


def _run(family, q, k, v, kw, backend):
    return ops.chunk_fwd(family, q, k, v, output_final_state=True, backend=backend, **kw)


def _softmax_causal(q, k, v, block=1024):
    """Causal softmax attention in float32 (numpy), blocked over queries: the O(T^2) baseline."""
    B, T, H, K = q.shape
    scale = K ** -0.5
    out = np.empty_like(v)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, :, h], v[b, :, h]
            for s in range(0, T, block):
                e = min(T, s + block)
                scores = (q[b, s:e, h] * scale) @ kh[:e].T
                scores[np.triu_indices(e - s, k=s + 1, m=e)] = -np.inf
                scores -= scores.max(axis=1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= scores.sum(axis=1, keepdims=True)
                out[b, s:e, h] = scores @ vh[:e]
    return out


def _gpu_torch():
    """torch with a CUDA device that cula sees, or None (then the demo runs on the host)."""
    try:
        import torch

        from .. import _lib

        if torch.cuda.is_available() and _lib.LIB.cula_cuda_device_count() > 0:
            return torch
    except Exception:  # no torch, or a broken CUDA setup: the host path still runs
        pass
    return None


def _to_device(torch, q, k, v, kw):
    """q, k, v in bf16 and the rest in float32 on the GPU; kw's non-array options untouched."""
    cast = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    dev_kw = {n: (cast(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    return cast(q).bfloat16(), cast(k).bfloat16(), cast(v).bfloat16(), dev_kw


def _host(x):
    return x.float().cpu().numpy() if hasattr(x, "cpu") else x


def _softmax_causal_gpu(torch, q, k, v):
    f = torch.nn.functional.scaled_dot_product_attention
    return f(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


def _time(fn, reps=1, torch=None):
    """Median wall time of reps synchronized calls, in seconds."""
    times = []
    for _ in range(reps):
        if torch:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def growth_exponent(lengths, times):
    """The least-squares slope of log(time) against log(T): time ~ T^slope over the sizes given."""
    x, y = np.log(np.asarray(lengths, dtype=np.float64)), np.log(np.asarray(times, dtype=np.float64))
    return float(np.polyfit(x, y, 1)[0])


def run_demo(quick: bool = False) -> int:
    rng = np.random.default_rng()
    torch = _gpu_torch()
    device = "cuda" if torch else "cpu"
    backend = ops.backend_for("chunk_fwd", device)
    T, H, K = (256, 2, 64) if quick else (2048, 8, 128)
    where = "CUDA tensors, bf16 q/k/v" if torch else "host tensors"
    print(f"cula demo: chunked forward on backend '{backend}' ({where}), B=1 T={T} H={H} K=V={K}")
    families = ["kda", "gdn", "gla", "simple_gla", "lightning"]
    prog = Progress(len(families), "checking")
    rows, ok = [], True
    for fam in families:
        q, k, v, kw = _inputs(rng, fam, 1, T, H, K, K)
        if torch:
            dq, dk, dv, dkw = _to_device(torch, q, k, v, kw)
            q, k, v = _host(dq), _host(dk), _host(dv)  # the reference sees the same bf16-rounded values
        else:
            dq, dk, dv, dkw = q, k, v, kw
        t_fast = _time(lambda: _run(fam, dq, dk, dv, dkw, backend), torch=torch)
        t0 = time.perf_counter()
        o_ref, s_ref = _run(fam, q, k, v, kw, "reference")
        t_ref = time.perf_counter() - t0
        o, s = (_host(x) for x in _run(fam, dq, dk, dv, dkw, backend))
        err_o = float(np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref))
        err_s = float(np.linalg.norm(s - s_ref) / np.linalg.norm(s_ref))
        good = err_o <= 5e-3 and err_s <= 5e-3 and np.isfinite(o).all()
        ok &= good
        rows.append((fam, t_fast * 1e3, t_ref * 1e3, err_o, err_s, "ok" if good else "MISMATCH"))
        prog.step(fam)
    print(f"\n{'family':<11}{'cula ms':>10}{'reference ms':>14}{'rel err o':>12}{'rel err state':>15}  check")
    for fam, tf, tr, eo, es, verdict in rows:
        print(f"{fam:<11}{tf:>10.1f}{tr:>14.1f}{eo:>12.2e}{es:>15.2e}  {verdict}")

    if torch:
        lengths = [1024, 2048, 4096, 8192, 16384, 32768]
        Hs, softmax_name = 16, "torch SDPA, bf16, GPU"
    else:
        lengths = [256, 512, 1024] if quick else [512, 1024, 2048, 4096, 8192]
        Hs, softmax_name = 2, "numpy float32"
    print(f"\nlinear (KDA, cula '{backend}') vs softmax attention (causal, {softmax_name}), B=1 H={Hs} K=V={K}")
    prog = Progress(len(lengths), "timing  ")
    table = []
    for T_ in lengths:
        q, k, v, kw = _inputs(rng, "kda", 1, T_, Hs, K, K)
        if torch:
            q, k, v, kw = _to_device(torch, q, k, v, kw)
            softmax = lambda: _softmax_causal_gpu(torch, q, k, v)  # noqa: E731
        else:
            softmax = lambda: _softmax_causal(q, k, v)  # noqa: E731
        _run("kda", q, k, v, kw, backend)  # warm-up
        softmax()
        t_lin = _time(lambda: _run("kda", q, k, v, kw, backend), reps=5, torch=torch)
        t_sm = _time(softmax, reps=5 if torch else 3, torch=torch)
        table.append((T_, t_lin * 1e3, t_sm * 1e3))
        prog.step(f"T={T_}")
    print(f"\n{'T':>7}{'linear ms':>12}{'softmax ms':>13}{'softmax/linear':>16}{'linear x':>10}{'softmax x':>11}")
    for i, (T_, tl, ts) in enumerate(table):
        gl = f"{tl / table[i - 1][1]:.1f}" if i else "-"
        gs = f"{ts / table[i - 1][2]:.1f}" if i else "-"
        print(f"{T_:>7}{tl:>12.2f}{ts:>13.2f}{ts / tl:>16.2f}{gl:>10}{gs:>11}")
    # Fit over the larger half of the sizes, where fixed per-call costs no longer dominate.
    half = table[len(table) // 2 - 1:] if len(table) >= 4 else table
    a_lin = growth_exponent([r[0] for r in half], [r[1] for r in half])
    a_sm = growth_exponent([r[0] for r in half], [r[2] for r in half])
    print(f"(medians of repeats; fitted over T = {half[0][0]}..{half[-1][0]}: linear attention's time grows as T^{a_lin:.2f}, "
          f"x{2 ** a_lin:.1f} per doubling; softmax attention's as T^{a_sm:.2f}, x{2 ** a_sm:.1f} per doubling; "
          f"the costs are O(T) and O(T^2))")
    cross = next((T_ for T_, tl, ts in table if ts > tl), None)
    if cross:
        print(f"linear attention is faster from T = {cross} on in this run")
    print("\nresult:", "all families match the float64 reference" if ok else "MISMATCH against the reference")
    return 0 if ok else 1
