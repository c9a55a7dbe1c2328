"""Where the prep + scan engine loses precision on fp16 inputs: a float64 model of its roundings for
GDN without decay, FLA's `test_gdn.py::test_chunk` case (B4-T1024-H4-D128, scale 0.1, no decay,
fp16, keys L2-normalised by the test), the one case of FLA's op tests cula fails (final state 7.2e-3
against FLA's 5e-3, measured on the H100).

The model follows the engine's algebra (csrc/cuda/prefill/chunk_prep_scan/DESIGN.md): per chunk of
64 tokens Minv (diagonal 16 x 16 blocks as bf16 hi + lo, the rest bf16), Kt = Minv^T Kd and
W' = -beta k stored bf16, Y = beta v + W' S rounded to bf16 with S a bf16 operand, S += Kt^T Y in
float32. Each rounding can be switched between bf16, fp16 and none, and the final state's error is
FLA's ratio (rms of the difference over rms of the float64 recurrence on the same fp16 inputs).

Run: python3 tools/analysis/gdn_fp16_rounding.py. It is a model, not the kernel: it predicts
5.5e-3 where the kernel measured 7.2e-3, so read it for which roundings matter, not for the
absolute values.
"""

import numpy as np

T, D, C, SCALE = 1024, 128, 64, 0.1


def bf16(x):
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def f16(x):
    return np.asarray(x, dtype=np.float16).astype(np.float64)


def f32(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def exact(x):
    return np.asarray(x, dtype=np.float64)


def problem(seed):
    rng = np.random.default_rng(seed)
    norm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True))  # noqa: E731
    k = f16(norm(f16(rng.random((T, D)))))
    v = f16(rng.random((T, D)))
    beta = 1 / (1 + np.exp(-rng.random(T)))
    return k, v, beta


def recurrence(k, v, beta):
    S = np.zeros((D, D))
    for t in range(T):
        S = S + np.outer(k[t], beta[t] * (v[t] - k[t] @ S))
    return S


def engine(k, v, beta, k_kk=bf16, k_kt=bf16, k_w=bf16, v_in=bf16, mid=bf16):
    """The final state with k rounded as the tiles hold it where it enters A_kk (k_kk), Kt (k_kt)
    and W' (k_w), v where it enters Y (v_in), and the stored intermediates by mid."""
    S = np.zeros((D, D))
    for c0 in range(0, T, C):
        K, V, b = k[c0:c0 + C], v_in(v[c0:c0 + C]), beta[c0:c0 + C]
        M = np.eye(C) + np.tril(b[:, None] * f32(k_kk(K) @ k_kk(K).T), -1)
        Minv = f32(np.linalg.inv(M))
        Mst = mid(Minv)
        for i in range(0, C, 16):
            blk = Minv[i:i + 16, i:i + 16]
            hi = mid(blk)
            Mst[i:i + 16, i:i + 16] = hi + mid(blk - hi)
        Kt = mid(Mst.T @ k_kt(K))
        W = mid(-b[:, None] * k_w(K))
        Y = mid(b[:, None] * V + W @ mid(S))
        S = S + Kt.T @ Y
    return S


def main():
    variants = [
        ("as built: fp16 inputs as bf16 tiles", {}),
        ("fp16 inputs kept exact, bf16 intermediates", dict(k_kk=exact, k_kt=exact, k_w=exact, v_in=exact)),
        ("v exact in Y only", dict(v_in=exact)),
        ("k exact in Kt only", dict(k_kt=exact)),
        ("v exact in Y and k exact in Kt (hi + lo)", dict(v_in=exact, k_kt=exact)),
        ("every rounding fp16 (FLA's Triton kernels)", dict(k_kk=exact, k_kt=exact, k_w=exact, v_in=exact, mid=f16)),
    ]
    for seed in (42, 1, 2):
        k, v, beta = problem(seed)
        ref = recurrence(k, v, beta)
        ratio = lambda S: float(np.sqrt(((S - ref) ** 2).mean() / (ref ** 2).mean()))  # noqa: E731
        print(f"seed {seed}")
        for name, kw in variants:
            print(f"  {name:46s} {ratio(engine(k, v, beta, **kw)):.2e}")


if __name__ == "__main__":
    main()
