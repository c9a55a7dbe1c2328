"""The random problems of the tests, drawn in one place: every datum from the test's seeded rng
(conftest's fixture), so that a printed seed replays the test.

- family_arrays: float32 numpy inputs of any family (q, k, v, the gate or decay, beta, A_log,
  dt_bias), for the host tests and, converted, the device ones;
- draw_chunk_config / chunk_inputs: a random configuration of everything the chunked forward
  takes and its torch inputs (the GPU chunk, random-call and backward tests).
"""

import numpy as np

try:
    import torch
except ImportError:  # the host tests use family_arrays only
    torch = None


def family_arrays(rng, family, B, T, H, HV, K, V, *, gate_in_kernel=False, beta_sigmoid=False, l2norm=False,
                  no_A_log=False):
    """The inputs of one family as float32 arrays (B, T, H heads of q/k, HV of v). k is scaled by
    K^-1/2 without the L2 norm, so the delta rule stays contractive. The gate: a raw gate (standard
    normal) with gate_in_kernel, else a log-decay in [-0.5, -0.01); Lightning: a decay rate per
    head. beta: a logit with beta_sigmoid, else in [0.05, 0.95)."""
    f = np.float32
    d = dict(q=rng.standard_normal((B, T, H, K)).astype(f),
             k=(rng.standard_normal((B, T, H, K)) / (1.0 if l2norm else np.sqrt(K))).astype(f),
             v=rng.standard_normal((B, T, HV, V)).astype(f))
    if family in ("kda", "gla", "gdn", "simple_gla"):
        shape = (B, T, HV, K) if family in ("kda", "gla") else (B, T, HV)
        d["g"] = (rng.standard_normal(shape) if gate_in_kernel else -rng.uniform(0.01, 0.5, shape)).astype(f)
    else:
        d["decay"] = rng.uniform(0.01, 0.5, H).astype(f)
    if family in ("kda", "gdn"):
        d["beta"] = (rng.standard_normal((B, T, HV)) if beta_sigmoid else rng.uniform(0.05, 0.95, (B, T, HV))).astype(f)
    if gate_in_kernel:
        d["A_log"] = None if no_A_log else rng.uniform(-1, 0.5, HV).astype(f)
        d["dt_bias"] = (rng.standard_normal(HV * K if family == "kda" else HV) * 0.5).astype(f)
    return d


def state_shape(N, HV, K, V, layout):
    return (N, HV, V, K) if layout == "k_last" else (N, HV, K, V)


def offsets(seqlens, dtype=np.int64):
    """cu_seqlens of the given sequence lengths (numpy)."""
    return np.cumsum([0] + list(seqlens)).astype(dtype)


FAMILIES = ("kda", "gdn", "gla", "simple_gla", "lightning")


def draw_chunk_config(rng, family="kda"):
    """One random configuration of everything the kernel takes."""
    K = int(rng.choice([64, 128, 256], p=[0.4, 0.4, 0.2]))
    varlen = bool(rng.random() < 0.4)
    seqlens = [int(x) for x in rng.choice([0, 1, 63, 64, 65, 130, 200], size=int(rng.integers(2, 5)))]
    if sum(seqlens) == 0:
        seqlens.append(64)  # at least one token, so there is something to dispatch
    return dict(
        family=family, gin=bool(rng.random() < 0.5), K=K, V=int(rng.choice([64, 128, 256])), H=int(rng.choice([1, 2])), group=int(rng.choice([1, 2])),
        seqlens=seqlens if varlen else None,
        B=int(rng.integers(1, 3)), T=int(rng.choice([1, 17, 64, 100, 192, 257])),
        layout=str(rng.choice(["k_last", "k_first"])), sdt=rng.choice([torch.float32, torch.bfloat16]),
        gdt=rng.choice([torch.float32, torch.bfloat16]), l2=bool(rng.random() < 0.8), bsig=bool(rng.random() < 0.7),
        lb=float(rng.choice([-5.0, -2.0, -0.5, -10.0])), h0=bool(rng.random() < 0.7),
        kgate=str(rng.choice(["bounded", "softplus", "log_decay"])),
        # input dtype: the tensor-core engines take all three (fp32 through a bf16 copy, fp16 too in the
        # fused engine)
        idt=rng.choice([torch.bfloat16, torch.float16, torch.float32]),
        inter=bool(rng.random() < 0.4),  # with varlen: device offsets, the count from their host copy
    )


def _family_gates(rng, c, d, kw, B, T, HV):
    """The gate arguments of the families other than KDA: raw log-decays reach -30 per token (GDN,
    simple GLA: exact per-pair exponents; GLA: factors <= 1 and steep diagonal blocks per element,
    so none needs a bound), in-kernel gates use A_log, dt_bias."""
    fam = c["family"]
    for n in ("g", "A_log", "dt_bias"):
        d.pop(n)
    for n in ("use_gate_in_kernel", "lower_bound", "safe_gate"):
        kw.pop(n)
    if fam != "gdn":  # no beta; the q/k L2 norm applies to every family (SPEC §2)
        d.pop("beta")
        kw.pop("use_beta_sigmoid_in_kernel")
    if fam == "lightning":
        d["decay"] = torch.from_numpy(rng.uniform(0.0, 4.0, c["H"]).astype(np.float32))
        return
    if fam == "gdn" and c["gin"]:
        d["g"] = torch.from_numpy(rng.standard_normal((B, T, HV)).astype(np.float32)).to(c["gdt"])
        d["A_log"] = torch.from_numpy(rng.uniform(-1, 1.5, HV).astype(np.float32))
        d["dt_bias"] = torch.from_numpy(rng.standard_normal(HV).astype(np.float32))
        kw["use_gate_in_kernel"] = True
        return
    shape = (B, T, HV, c["K"]) if fam == "gla" else (B, T, HV)
    g = -rng.exponential(rng.choice([0.05, 0.5, 3.0]), shape)
    g[rng.random(shape) < 0.02] = -30.0
    d["g"] = torch.from_numpy(g.astype(np.float32)).to(c["gdt"])


def chunk_inputs(rng, c):
    H, HV, K, V = c["H"], c["H"] * c["group"], c["K"], c["V"]
    if c["seqlens"] is not None:
        B, T, N = 1, int(sum(c["seqlens"])), len(c["seqlens"])
    else:
        B, T, N = c["B"], c["T"], c["B"]
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    kscale = 1.0 if c["l2"] else K ** -0.5  # keep the delta rule contractive without normalisation
    idt = c.get("idt", torch.bfloat16)
    d = dict(q=t(B, T, H, K).to(idt), k=(t(B, T, H, K) * kscale).to(idt), v=t(B, T, HV, V).to(idt),
             g=t(B, T, HV, K).to(c["gdt"]),
             beta=t(B, T, HV) if c["bsig"] else torch.from_numpy(rng.uniform(0.05, 1.0, (B, T, HV)).astype(np.float32)),
             A_log=torch.from_numpy(rng.uniform(-1, 0.5, HV).astype(np.float32)), dt_bias=t(HV * K) * 0.5)
    if c["h0"]:
        shape = (N, HV, V, K) if c["layout"] == "k_last" else (N, HV, K, V)
        d["initial_state"] = (t(*shape) * 0.3).to(c["sdt"])
    cu = torch.tensor(np.cumsum([0] + c["seqlens"]), dtype=torch.int32) if c["seqlens"] is not None else None
    kw = dict(use_qk_l2norm_in_kernel=c["l2"], use_gate_in_kernel=True, lower_bound=c["lb"], safe_gate=True,
              use_beta_sigmoid_in_kernel=c["bsig"], output_final_state=True, state_layout=c["layout"],
              return_intermediate_states=c["inter"])
    if c.get("family", "kda") != "kda":
        _family_gates(rng, c, d, kw, B, T, HV)
    else:
        _kda_gates(rng, c, d, kw, B, T, HV)
    return d, cu, kw


def _kda_gates(rng, c, d, kw, B, T, HV):
    """KDA's gate forms: bounded (lower_bound, safe_gate), softplus without a bound (e^{A_log} up to
    20, so some 16-token blocks fall by hundreds), or a precomputed log-decay reaching -30 per token."""
    form = c.get("kgate", "bounded")
    if form == "bounded" and c["lb"] < -5.0:  # safe_gate takes lower bounds in [-5, 0)
        kw["safe_gate"] = False
    if form == "softplus":
        kw.update(lower_bound=None, safe_gate=False)
        d["A_log"] = torch.from_numpy(rng.uniform(-1, 3.0, HV).astype(np.float32))
    elif form == "log_decay":
        for n in ("A_log", "dt_bias"):
            d.pop(n)
        kw.update(use_gate_in_kernel=False, lower_bound=None, safe_gate=False)
        shape = (B, T, HV, c["K"])
        g = -rng.exponential(rng.choice([0.05, 0.5, 3.0]), shape)
        g[rng.random(shape) < 0.02] = -30.0
        d["g"] = torch.from_numpy(g.astype(np.float32)).to(c["gdt"])
