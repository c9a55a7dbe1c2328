"""cula.dist (Level 2) in real process groups: 2 and 4 processes on host tensors with gloo (every
machine), and on CUDA tensors with NCCL when the machine has 2 or more GPUs. Every rank checks its
shard against the whole problem computed in one process: context parallelism within float32
tolerance (the ranks' states are folded in a different order of operations), tensor parallelism
bit for bit. Wrong sizes and offsets that differ between ranks raise on every rank."""

import contextlib
import json
import os
import sys
import tempfile
import traceback
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
import torch.distributed as torch_dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import cula  # noqa: E402
from cula import dist  # noqa: E402
from cula._front import chunk  # noqa: E402
from cula.kda import chunk_kda as kda_dropin  # noqa: E402

TOL = 2e-5  # float32 on the host, against the single-process result
TOL_CUDA = 5e-3  # SPEC §5: bf16 inputs and outputs against the float64 reference
# CUDA gradients against the float64 reference: FLA's own backward tolerances (test_gpu_backward's
# per-gradient table), and 1e-2 for the bf16 gradients of bf16 leaves (one more rounding)
GRAD_TOL_CUDA = {"q": 1e-2, "k": 1e-2, "v": 1e-2, "h0": 8e-3, "g": 2e-2, "beta": 2e-2, "A_log": 3e-3, "dt_bias": 8e-3}
# NVLink multicast stays off on the GPU machines (NCCL's NVLS, symmetric memory, NVSHMEM)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _spawn(fn, world, backend, seed, *args):
    os.environ.update(NCCL_ENV)
    # the rendezvous through a fresh file (a free TCP port picked here could be taken before rank 0
    # binds it)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_worker, args=(world, backend, store, seed, fn, args), nprocs=world, join=True)


def _worker(rank, world, backend, store, seed, fn, args):
    os.environ.update(NCCL_ENV)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch_dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, "cuda" if backend == "nccl" else "cpu", np.random.default_rng(seed), *args)
        torch_dist.barrier()  # no rank tears its connections down while another still reads from them
    except BaseException:
        # A failing rank leaves at once: tearing NCCL down waits for the collectives the other ranks
        # still wait in, so the failure would never be reported. mp.spawn ends the others.
        traceback.print_exc()
        _leave(1)
    torch_dist.destroy_process_group()
    _leave()


def _leave(status=0):
    """A rank that succeeded exits without the interpreter's shutdown: gloo's worker threads may still be
    freeing the last collective's tensors, which takes the GIL, and taking it while the interpreter
    finalises aborts the process (pytorch/pytorch#179291; seen here once in about 20 runs)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _problem(rng, family, B, T, H, HV, K, V, device, N=None):
    """Inputs of the whole problem (the same on every rank: drawn from the shared seed). The decays
    are slow (log-decays near -0.01 per token), so that the state crossing a rank boundary weighs
    in every output and gradient."""
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":  # the CUDA kernels' smallest head sizes
        K, V = max(K, 64), max(V, 64)
    d = dict(q=t(B, T, H, K), k=t(B, T, H, K), v=t(B, T, HV, V))
    kw = dict(use_qk_l2norm_in_kernel=True)
    if family == "kda":
        d.update(g=t(B, T, HV, K), beta=t(B, T, HV))
        kw.update(use_gate_in_kernel=True, A_log=t(HV) * 0.5, dt_bias=t(HV * K) * 0.5, lower_bound=-0.05,
                  safe_gate=True, use_beta_sigmoid_in_kernel=True)
    elif family == "gdn":
        d.update(g=-0.02 * torch.nn.functional.softplus(t(B, T, HV)), beta=torch.sigmoid(t(B, T, HV)))
    elif family == "gla":
        d["g"] = -0.02 * torch.nn.functional.softplus(t(B, T, HV, K))
    elif family == "simple_gla":
        d["g"] = -0.02 * torch.nn.functional.softplus(t(B, T, HV))
    else:
        kw["decay"] = torch.from_numpy(rng.uniform(0, 0.02, H).astype(np.float32))
    d = {n: x.to(device, dt if n in "qkv" else torch.float32) for n, x in d.items()}
    kw = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    h0 = (t(N or B, HV, V, K) * 0.3).to(device)
    return d, kw, h0


def _whole(family, d, kw, h0, cu=None):
    """The whole problem in one process, through the path the ranks take (autograd included)."""
    decay = kw.pop("decay", None)
    o, s = chunk(family, d["q"], d["k"], d["v"], d.get("g"), d.get("beta"), decay, initial_state=h0,
                 output_final_state=True, cu_seqlens=cu, state_layout="k_last", state_dtype="float32", **kw)
    if decay is not None:
        kw["decay"] = decay
    return o, s


def _reference(family, d, kw, h0, cu=None):
    """What a split computation is held to: on the host, the whole problem in one process (_whole);
    for CUDA tensors, the whole problem in float64 on the host (SPEC §5's reference), through casts
    that autograd follows back to the CUDA leaves, so the gradients are the reference's too. (A
    second bf16 run is no reference: its own rounding would count against the split one.)"""
    if d["q"].device.type != "cuda":
        return _whole(family, d, kw, h0, cu)
    dev = d["q"].device
    host = lambda x: x.to("cpu", torch.float64) if isinstance(x, torch.Tensor) else x  # noqa: E731
    o, s = _whole(family, {n: host(x) for n, x in d.items()}, {n: host(x) for n, x in kw.items()}, host(h0),
                  None if cu is None else cu.cpu())
    return o.to(dev), s.to(dev)


def _grad_tol(device, name):
    return GRAD_TOL_CUDA[name] if device == "cuda" else TOL


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _cp_dense(rank, world, device, rng, family, exchange="auto", shares=None):
    d, kw, h0 = _problem(rng, family, 2, 150, 2, 4, 32, 32, device)  # GVA: two value heads per q/k head
    kw["scale"] = 0.3
    o_ref, s_ref = _reference(family, d, kw, h0)
    local = {n: dist.split_tokens_for_sp(x, world, rank, shares=shares) for n, x in d.items()}
    decay = kw.pop("decay", None)
    with torch.no_grad():
        o, s = dist.chunk_cp(family, local["q"], local["k"], local["v"], local.get("g"), local.get("beta"), decay,
                             initial_state=h0, sp_size=world, sp_rank=rank, exchange=exchange, **kw)
    assert dist.last_exchange()["exchange"] == (exchange if exchange != "auto" else "all_gather")
    tol = TOL_CUDA if device == "cuda" else TOL
    assert _rel(o, dist.split_tokens_for_sp(o_ref, world, rank, shares=shares)) < tol, (rank, family, _rel(o, dist.split_tokens_for_sp(o_ref, world, rank, shares=shares)))
    assert _rel(s, s_ref) < tol, (rank, family, _rel(s, s_ref), float(s_ref.abs().max()))


def _cp_varlen(rank, world, device, rng, family, exchange="auto", shares=None):
    seqlens = [5, 0, 70, 3, 90, 0, 12]
    T = sum(seqlens)
    cu = torch.tensor(np.cumsum([0] + seqlens), dtype=torch.int32, device=device)
    d, kw, h0 = _problem(rng, family, 1, T, 2, 2, 32, 32, device, N=len(seqlens))
    o_ref, s_ref = _reference(family, d, kw, h0, cu)
    local = {n: dist.split_tokens_for_sp(x, world, rank, shares=shares) for n, x in d.items()}
    decay = kw.pop("decay", None)
    with torch.no_grad():
        o, s = dist.chunk_cp(family, local["q"], local["k"], local["v"], local.get("g"), local.get("beta"), decay,
                             initial_state=h0, cu_seqlens=cu, exchange=exchange, **kw)
    tol = TOL_CUDA if device == "cuda" else TOL
    assert _rel(o, dist.split_tokens_for_sp(o_ref, world, rank, shares=shares)) < tol, rank
    assert _rel(s, s_ref) < tol, rank
    local_cu, span = dist.split_cu_seqlens_for_sp(cu, rank, world, shares=shares)
    assert int(local_cu[-1]) == int(span[1] - span[0]) == local["q"].shape[1]
    if family == "kda":  # FLA's cp_context through the drop-in: this rank's offsets, chain flags, no states
        pieces = dist._pieces([int(x) for x in cu.tolist()], int(span[0]), int(span[1]), rank, world)
        ctx = SimpleNamespace(group=None, cu_seqlens=local_cu, layout="contiguous",
                              is_first_rank=not pieces[0][3], is_last_rank=not pieces[-1][4])
        o_ref0, _ = _reference(family, d, dict(kw, decay=decay) if decay is not None else dict(kw), None, cu)
        with torch.no_grad():
            o_fla = kda_dropin(local["q"], local["k"], local["v"], local["g"], local["beta"], cp_context=ctx, **kw)[0]
        assert _rel(o_fla, dist.split_tokens_for_sp(o_ref0, world, rank, shares=shares)) < tol, rank


@contextlib.contextmanager
def _counted_gathers():
    """The validation collectives (cula.dist._gathered_rows) made inside the block, one entry each."""
    gathers, gathered_rows = [], dist._gathered_rows
    dist._gathered_rows = lambda *a: gathers.append(1) or gathered_rows(*a)
    try:
        yield gathers
    finally:
        dist._gathered_rows = gathered_rows


def _heads(rank, world, device, rng, family):
    """Head parallelism over a token split (and chunk_sp's choice): exact, with autograd."""
    seqlens = [5, 0, 70, 3, 90, 0, 12]
    cu = torch.tensor(np.cumsum([0] + seqlens), dtype=torch.int32, device=device)
    d, kw, h0 = _problem(rng, family, 1, sum(seqlens), 4, 4, 32, 32, device, N=len(seqlens))
    leaves = {n: x.clone().requires_grad_() for n, x in d.items()}
    o_ref, s_ref = _whole(family, leaves, dict(kw), h0, cu)
    w = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(3)).to(device)
    grads_ref = torch.autograd.grad((o_ref.float() * w).sum(), list(leaves.values()))
    mine = {n: dist.split_tokens_for_sp(x, world, rank).detach().clone().requires_grad_() for n, x in d.items()}
    decay = kw.pop("decay", None)
    with _counted_gathers() as gathers:  # one validation collective for chunk_sp's choice and chunk_heads
        o, s = dist.chunk_sp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                             initial_state=h0, cu_seqlens=cu, **kw)
    assert dist.last_plan()["mode"] == "heads" and len(gathers) == 1, (dist.last_plan(), gathers)
    same = torch.equal if device == "cpu" else (lambda a, b: _rel(a, b) < TOL_CUDA)
    assert same(o, dist.split_tokens_for_sp(o_ref, world, rank)), rank
    assert same(s, s_ref), rank
    grads = torch.autograd.grad((o.float() * dist.split_tokens_for_sp(w, world, rank)).sum(), list(mine.values()))
    for n, g, gr in zip(mine, grads, grads_ref):
        assert same(g, dist.split_tokens_for_sp(gr, world, rank)), (rank, n)
    if world > 1:  # 3 heads do not divide over the ranks: the planner takes context parallelism
        d3, kw3, _ = _problem(rng, "gdn", 1, 40, 3, 3, 32, 32, device)
        loc3 = {n: dist.split_tokens_for_sp(x, world, rank) for n, x in d3.items()}
        with torch.no_grad():
            dist.chunk_sp("gdn", loc3["q"], loc3["k"], loc3["v"], loc3["g"], loc3["beta"], **kw3)
        assert dist.last_plan()["mode"] == "cp", dist.last_plan()
    with torch.no_grad():  # deterministic: the segment grid of chunk_cp even where the heads divide
        det = dist.chunk_sp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                            initial_state=h0, cu_seqlens=cu, deterministic=True, segment_len=45, **kw)[0]
        assert dist.last_plan() == {"mode": "cp", "reason": "deterministic=True: chunk_cp's segment grid"}
        o64 = o_ref if device == "cpu" else _reference(family, d, dict(kw, decay=decay) if decay is not None else kw,
                                                       h0, cu)[0]  # (the float64 reference: SPEC §5)
        assert _rel(det, dist.split_tokens_for_sp(o64, world, rank)) < (TOL if device == "cpu" else TOL_CUDA), \
            (family, _rel(det, dist.split_tokens_for_sp(o64, world, rank)))
        with pytest.raises(cula.CulaError, match="argument 'deterministic'"):
            dist.chunk_sp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                          initial_state=h0, cu_seqlens=cu, mode="heads", deterministic=True, **kw)


def _heads_all(rank, world, device, rng):
    _each(_heads, FAMILIES)(rank, world, device, rng)


def _cp_errors(rank, world, device, rng):
    d, kw, h0 = _problem(rng, "gdn", 1, 40, 1, 1, 16, 16, device)
    local = {n: dist.split_tokens_for_sp(x, world, rank) for n, x in d.items()}
    with torch.no_grad():
        with pytest.raises(cula.CulaError, match="argument 'sp_size'"):
            dist.chunk_cp("gdn", local["q"], local["k"], local["v"], local["g"], local["beta"], sp_size=world + 1)
        cu = torch.tensor([0, 10 + rank, 40], dtype=torch.int32, device=device)  # differs between ranks
        with pytest.raises(cula.CulaError, match="argument 'cu_seqlens': expected the same global offsets"):
            dist.chunk_cp("gdn", local["q"], local["k"], local["v"], local["g"], local["beta"], cu_seqlens=cu)
    T = local["q"].shape[1]
    ctx = SimpleNamespace(group=None, cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=device),
                          layout="zigzag", is_first_rank=rank == 0, is_last_rank=rank == world - 1)
    with pytest.raises(NotImplementedError, match="layout 'zigzag'"):  # FLA's cp_context: the contiguous layout
        dist.chunk_fla_cp("gdn", local["q"], local["k"], local["v"], local["g"], local["beta"], cp_context=ctx)
    ctx.layout = "contiguous"
    with pytest.raises(cula.CulaError, match="initial and final states are not supported"):  # as in FLA
        dist.chunk_fla_cp("gdn", local["q"], local["k"], local["v"], local["g"], local["beta"], cp_context=ctx,
                          output_final_state=True)


def _grad_problem(rng, family, device, seqlens, T):
    """_problem for the gradient tests: packed sequences of the given lengths (or 2 rows of T tokens),
    A_log / dt_bias apart from the other keywords, and the weights of the output and final-state
    terms of the loss."""
    if seqlens is not None:
        cu = torch.tensor(np.cumsum([0] + seqlens), dtype=torch.int32, device=device)
        d, kw, h0 = _problem(rng, family, 1, sum(seqlens), 2, 2, 32, 32, device, N=len(seqlens))
    else:
        cu = None
        d, kw, h0 = _problem(rng, family, 2, T, 2, 4 if family in ("kda", "gdn") else 2, 32, 32, device)
    params = {n: kw.pop(n) for n in ("A_log", "dt_bias") if n in kw}
    w_o = torch.from_numpy(rng.standard_normal(tuple(d["v"].shape)).astype(np.float32)).to(device)
    # representable in the inputs' dtype: the split call's o is rounded to it, and so is the gradient
    # it passes back, while the float64 reference's o takes w_o as it is
    w_o = w_o.to(d["v"].dtype).float()
    w_s = torch.from_numpy(rng.standard_normal(tuple(h0.shape)).astype(np.float32)).to(device)
    return cu, d, kw, h0, params, w_o, w_s


def _cp_grad(rank, world, device, rng, family, varlen, exchange="auto"):
    """chunk_cp's backward against autograd through the whole problem in one process: every input's
    gradient (the token slices on their rank; A_log, dt_bias and the initial states summed over the
    ranks), with the final states in the loss on rank 0 only."""
    cu, d, kw, h0, params, w_o, w_s = _grad_problem(rng, family, device, [5, 0, 70, 3, 90, 0, 12] if varlen else None,
                                                    150)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in {**d, **params, "h0": h0}.items()}
    o_ref, s_ref = _reference(family, {n: leaves[n] for n in d}, {**kw, **{n: leaves[n] for n in params}},
                              leaves["h0"], cu)
    ((o_ref.float() * w_o).sum() + (s_ref * w_s).sum()).backward()

    mine = {n: dist.split_tokens_for_sp(x.detach(), world, rank).clone().requires_grad_() for n, x in d.items()}
    whole = {n: x.detach().clone().requires_grad_() for n, x in {**params, "h0": h0}.items()}
    decay = kw.pop("decay", None)
    o, s = dist.chunk_cp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                         initial_state=whole["h0"], cu_seqlens=cu, exchange=exchange, **kw,
                         **{n: whole[n] for n in params})
    loss = (o.float() * dist.split_tokens_for_sp(w_o, world, rank)).sum()
    if rank == 0:
        loss = loss + (s * w_s).sum()
    loss.backward()
    for n, x in mine.items():
        want = dist.split_tokens_for_sp(leaves[n].grad, world, rank)
        assert _rel(x.grad, want) < _grad_tol(device, n), (rank, family, varlen, n, _rel(x.grad, want))
    for n, x in whole.items():
        got = x.grad.clone()
        torch_dist.all_reduce(got)
        assert _rel(got, leaves[n].grad) < _grad_tol(device, n), (rank, family, varlen, n, _rel(got, leaves[n].grad))


def _cp_whole_sequences(rank, world, device, rng, family, seqlens=(5, 0, 70, 3, 90, 0, 12)):
    """A packed batch split on sequence boundaries (split_sequences_for_sp): chunk_cp runs Level 1 per
    rank with no exchange; outputs, final states and every gradient as the one-process run (bitwise
    on the host), the initial states' and parameters' gradients summed over the ranks."""
    seqlens = list(seqlens)
    cu, d, kw, h0, params, w_o, w_s = _grad_problem(rng, family, device, seqlens, None)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in {**d, **params, "h0": h0}.items()}
    o_ref, s_ref = _reference(family, {n: leaves[n] for n in d}, {**kw, **{n: leaves[n] for n in params}},
                              leaves["h0"], cu)
    ((o_ref.float() * w_o).sum() + (s_ref * w_s).sum()).backward()

    local_cu, span = dist.split_sequences_for_sp(cu, world, rank)
    start, end = int(span[0]), int(span[1])
    bounds = [int(x) for x in cu.tolist()]
    assert start in bounds and end in bounds and int(local_cu[-1]) == end - start, (rank, start, end)
    mine = {n: x.detach()[:, start:end].clone().requires_grad_() for n, x in d.items()}
    whole = {n: x.detach().clone().requires_grad_() for n, x in {**params, "h0": h0}.items()}
    decay = kw.pop("decay", None)
    o, s = dist.chunk_cp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                         initial_state=whole["h0"], cu_seqlens=cu, **kw, **{n: whole[n] for n in params})
    assert dist.last_exchange()["exchange"] == "none", dist.last_exchange()
    same = (lambda a, b: torch.equal(a, b)) if device == "cpu" else (lambda a, b: _rel(a, b) < TOL_CUDA)
    assert same(o, o_ref[:, start:end]), (rank, family)
    assert same(s, s_ref), (rank, family)
    loss = (o.float() * w_o[:, start:end]).sum()
    if rank == 0:
        loss = loss + (s * w_s).sum()
    loss.backward()
    for n, x in mine.items():
        want = leaves[n].grad[:, start:end]
        assert _rel(x.grad, want) < _grad_tol(device, n), (rank, family, n, _rel(x.grad, want))
    for n, x in whole.items():  # (a rank holding no sequence reads no initial state)
        got = x.grad.clone() if x.grad is not None or n != "h0" else torch.zeros_like(x)
        torch_dist.all_reduce(got)
        assert _rel(got, leaves[n].grad) < _grad_tol(device, n), (rank, family, n, _rel(got, leaves[n].grad))
    with torch.no_grad():  # without final states: no collective after the validation
        o2, s2 = dist.chunk_cp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                               initial_state=h0, cu_seqlens=cu, output_final_state=False, **kw, **params)
    assert s2 is None and same(o2, o.detach())
    # chunk_sp sees the split on sequence boundaries and takes chunk_cp (no exchange), with one
    # validation collective for both (chunk_cp takes chunk_sp's)
    with _counted_gathers() as gathers, torch.no_grad():
        o3, _ = dist.chunk_sp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                              initial_state=h0, cu_seqlens=cu, **kw, **params)
    assert dist.last_plan()["mode"] == "cp" and dist.last_exchange()["exchange"] == "none", dist.last_plan()
    assert len(gathers) == 1, gathers
    assert same(o3, o.detach())


def _cp_whole_sequences_all(rank, world, device, rng):
    _each(_cp_whole_sequences, ("kda", "gdn", "simple_gla", "lightning"))(rank, world, device, rng)
    for family in ("kda", "simple_gla"):  # a long sequence and a short one: ranks left empty at 4
        _cp_whole_sequences(rank, world, device, rng, family, seqlens=(150, 2))


def _fla_cp_grad(rank, world, device, rng, family):
    """FLA's cp_context through the drop-in (chunk_kda / chunk_gated_delta_rule) under autograd: each
    rank's offsets and chain flags, no states; every input's gradient against autograd through the
    whole problem in one process (A_log and dt_bias summed over the ranks)."""
    from cula.gated_delta_rule import chunk_gated_delta_rule as gdn_dropin

    seqlens = [5, 0, 70, 3, 90, 0, 12]
    cu, d, kw, _, params, w_o, _ = _grad_problem(rng, family, device, seqlens, None)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in {**d, **params}.items()}
    o_ref, _ = _reference(family, {n: leaves[n] for n in d}, {**kw, **{n: leaves[n] for n in params}}, None, cu)
    (o_ref.float() * w_o).sum().backward()

    local_cu, span = dist.split_cu_seqlens_for_sp(cu, rank, world)
    pieces = dist._pieces([int(x) for x in cu.tolist()], int(span[0]), int(span[1]), rank, world)
    ctx = SimpleNamespace(group=None, cu_seqlens=local_cu, layout="contiguous",
                          is_first_rank=not pieces[0][3], is_last_rank=not pieces[-1][4])
    mine = {n: dist.split_tokens_for_sp(x.detach(), world, rank).clone().requires_grad_() for n, x in d.items()}
    whole = {n: x.detach().clone().requires_grad_() for n, x in params.items()}
    fn = kda_dropin if family == "kda" else gdn_dropin
    o = fn(mine["q"], mine["k"], mine["v"], mine["g"], mine["beta"], cp_context=ctx, **kw, **whole)[0]
    (o.float() * dist.split_tokens_for_sp(w_o, world, rank)).sum().backward()
    for n, x in mine.items():
        want = dist.split_tokens_for_sp(leaves[n].grad, world, rank)
        assert _rel(x.grad, want) < _grad_tol(device, n), (rank, family, n, _rel(x.grad, want))
    for n, x in whole.items():
        got = x.grad.clone()
        torch_dist.all_reduce(got)
        assert _rel(got, leaves[n].grad) < _grad_tol(device, n), (rank, family, n, _rel(got, leaves[n].grad))


def _fla_cp_grad_all(rank, world, device, rng):
    _each(_fla_cp_grad, ("kda", "gdn"))(rank, world, device, rng)


def _cp_grad_all(rank, world, device, rng):
    _each(lambda *a: _cp_grad(*a, varlen=False), FAMILIES)(rank, world, device, rng)
    _each(lambda *a: _cp_grad(*a, varlen=True), ("kda", "gdn", "lightning"))(rank, world, device, rng)


def _cp_deterministic(rank, world, device, rng, family, varlen, singles, lengths=None):
    """chunk_cp(deterministic=True): outputs, final states and every gradient bitwise equal to the
    same call made on one rank (a group of one) over the whole problem, for 2 and 4 ranks; and
    within float32 tolerance of the whole problem without segments. A_log, dt_bias and the initial
    states' gradients, summed over the ranks as for any weight, are exact (one rank holds each).
    lengths: every rank's number of tokens (default: split_tokens_for_sp's even split)."""
    seg = 32  # 256 tokens: 128 or 64 per rank, on the grid of 32
    cu, d, kw, h0, params, w_o, w_s = _grad_problem(rng, family, device, [5, 0, 70, 3, 90, 0, 88] if varlen else None,
                                                    256)
    decay = kw.pop("decay", None)
    start = sum(lengths[:rank]) if lengths else 0
    part = ((lambda x: x[:, start:start + lengths[rank]]) if lengths else
            (lambda x: dist.split_tokens_for_sp(x, world, rank)))

    def run(inputs, group, with_state_loss, w):
        leaves = {n: x.detach().clone().requires_grad_() for n, x in inputs.items()}
        whole = {n: x.detach().clone().requires_grad_() for n, x in {**params, "h0": h0}.items()}
        o, s = dist.chunk_cp(family, leaves["q"], leaves["k"], leaves["v"], leaves.get("g"), leaves.get("beta"), decay,
                             sp_group=group, initial_state=whole["h0"], cu_seqlens=cu, deterministic=True,
                             segment_len=seg, **kw, **{n: whole[n] for n in params})
        loss = (o.float() * w).sum() + ((s * w_s).sum() if with_state_loss else 0)
        loss.backward()
        return o.detach(), s.detach(), {n: x.grad for n, x in leaves.items()}, {n: x.grad for n, x in whole.items()}

    o1, s1, g1, p1 = run(d, singles[rank], True, w_o)
    mine = {n: part(x) for n, x in d.items()}
    o, s, g, p = run(mine, None, rank == 0, part(w_o))
    assert torch.equal(o, part(o1)), (rank, family, varlen)
    assert torch.equal(s, s1), (rank, family, varlen)
    for n in g:
        assert torch.equal(g[n], part(g1[n])), (rank, family, varlen, n)
    for n in p:
        summed = p[n].clone()
        torch_dist.all_reduce(summed)
        assert torch.equal(summed, p1[n]), (rank, family, varlen, n)
    # the same function as without segments
    leaves = {n: x.detach().clone().requires_grad_() for n, x in {**d, **params, "h0": h0}.items()}
    o_ref, s_ref = _reference(family, {n: leaves[n] for n in d},
                              {**kw, "decay": decay, **{n: leaves[n] for n in params}}, leaves["h0"], cu)
    ((o_ref.float() * w_o).sum() + (s_ref * w_s).sum()).backward()
    tol = TOL_CUDA if device == "cuda" else TOL
    assert _rel(o1, o_ref) < tol and _rel(s1, s_ref) < tol, (family, varlen, _rel(o1, o_ref), _rel(s1, s_ref))
    for n in g1:
        assert _rel(g1[n], leaves[n].grad) < _grad_tol(device, n), (family, varlen, n, _rel(g1[n], leaves[n].grad))
    for n in p1:
        assert _rel(p1[n], leaves[n].grad) < _grad_tol(device, n), (family, varlen, n, _rel(p1[n], leaves[n].grad))
    # a rank starting off the grid (128 or 64 tokens each, segment_len 48) is refused on every rank
    with pytest.raises(cula.CulaError, match="argument 'segment_len'"):
        with torch.no_grad():
            dist.chunk_cp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                          initial_state=h0, cu_seqlens=cu, deterministic=True, segment_len=48, **kw,
                          **params)


def _cp_deterministic_all(rank, world, device, rng):
    singles = [torch_dist.new_group([r]) for r in range(world)]  # every rank takes part in every new_group
    for family in ("kda", "gdn", "lightning"):
        for varlen in (False, True):
            _cp_deterministic(rank, world, device, rng, family, varlen, singles)
    if world == 4:  # uneven slices on the grid, one of them empty
        for varlen in (False, True):
            _cp_deterministic(rank, world, device, rng, "kda", varlen, singles, lengths=[64, 0, 128, 64])


def _tp(rank, world, device, rng, family):
    d, kw, h0 = _problem(rng, family, 2, 90, 4, 8 if family == "kda" else 4, 32, 32, device)
    leaves = {n: x.clone().requires_grad_() for n, x in d.items()}
    o_ref, s_ref = _whole(family, leaves, dict(kw), h0)
    w = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(5)).to(device)
    grads_ref = torch.autograd.grad((o_ref.float() * w).sum(), list(leaves.values()))
    mine = {n: dist.shard_heads(x, world, rank).detach().clone().requires_grad_() for n, x in d.items()}
    decay = kw.pop("decay", None)
    o, s = dist.chunk_tp(family, mine["q"], mine["k"], mine["v"], mine.get("g"), mine.get("beta"), decay,
                         initial_state=dist.shard_heads(h0, world, rank, dim=1).contiguous(), output_final_state=True,
                         tp_size=world, tp_rank=rank, **kw)  # A_log, dt_bias, decay given whole
    assert torch.equal(o, dist.shard_heads(o_ref, world, rank)), rank
    assert torch.equal(s, dist.shard_heads(s_ref, world, rank, dim=1)), rank
    grads = torch.autograd.grad((o.float() * dist.shard_heads(w, world, rank)).sum(), list(mine.values()))
    for n, g, gr in zip(mine, grads, grads_ref):
        assert torch.equal(g, dist.shard_heads(gr, world, rank)), (rank, n)


def _tp_cp(rank, world, device, rng):
    """A 2 x 2 grid: heads over one axis, tokens over the other."""
    tp_groups = [torch_dist.new_group([0, 1]), torch_dist.new_group([2, 3])]
    sp_groups = [torch_dist.new_group([0, 2]), torch_dist.new_group([1, 3])]
    tp_rank, sp_rank = rank % 2, rank // 2
    d, kw, h0 = _problem(rng, "kda", 1, 120, 2, 4, 32, 32, device)
    o_ref, s_ref = _reference("kda", d, dict(kw), h0)
    mine = {n: dist.split_tokens_for_sp(dist.shard_heads(x, 2, tp_rank), 2, sp_rank) for n, x in d.items()}
    with torch.no_grad():
        o, s = dist.cula_kda_tp_cp(mine["q"], mine["k"], mine["v"], mine["g"], mine["beta"],
                                   tp_group=tp_groups[rank // 2], sp_group=sp_groups[rank % 2],
                                   initial_state=dist.shard_heads(h0, 2, tp_rank, dim=1).contiguous(), **kw)
    tol = TOL_CUDA if device == "cuda" else TOL
    assert _rel(o, dist.split_tokens_for_sp(dist.shard_heads(o_ref, 2, tp_rank), 2, sp_rank)) < tol, rank
    assert _rel(s, dist.shard_heads(s_ref, 2, tp_rank, dim=1)) < tol, rank


FAMILIES = ("kda", "gdn", "gla", "simple_gla", "lightning")


def _backends():
    out = ["gloo"]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2 and cula.backend_for("chunk_fwd", "cuda") != "none":
        out.append("nccl")
    return out


def _world(backend, world):
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {world} GPUs, this machine has {torch.cuda.device_count()}")
    return world


def _each(check, families):
    """check for every family in one group of processes (starting the processes is most of the time)."""
    def run(rank, world, device, rng):
        for family in families:
            check(rank, world, device, rng, family)
    return run


def _cp_dense_all(rank, world, device, rng):
    _each(_cp_dense, FAMILIES)(rank, world, device, rng)


def _cp_varlen_all(rank, world, device, rng):
    _each(_cp_varlen, ("kda", "gla", "lightning"))(rank, world, device, rng)


def _cp_scan_all(rank, world, device, rng):
    """The log-depth scan exchange in place of the all-gather: forward dense and packed, backward."""
    for family in ("kda", "gla"):
        _cp_dense(rank, world, device, rng, family, exchange="scan")
        _cp_varlen(rank, world, device, rng, family, exchange="scan")
    for family, varlen in (("kda", True), ("gdn", False), ("simple_gla", True)):
        _cp_grad(rank, world, device, rng, family, varlen, exchange="scan")
    with pytest.raises(cula.CulaError, match="argument 'exchange'"):
        d, kw, _ = _problem(rng, "gdn", 1, 64, 2, 2, 32, 32, device)
        local = {n: dist.split_tokens_for_sp(x, world, rank) for n, x in d.items()}
        with torch.no_grad():
            dist.chunk_cp("gdn", local["q"], local["k"], local["v"], local["g"], local["beta"], exchange="ring", **kw)


def _cp_shares_all(rank, world, device, rng):
    """Uneven token splits: cp_shares' (the first rank, which runs no summary columns, twice the
    others' tokens at K = V) and arbitrary weights, dense and packed."""
    assert dist.cp_shares("kda", 32, 32, world) == [2.0] + [1.0] * (world - 1)
    assert dist.cp_shares("gla", 32, 32, world) == [1.0] * world
    uneven = dist.split_tokens_for_sp(torch.empty(1, 150), world, 0, shares=dist.cp_shares("kda", 32, 32, world))
    assert uneven.shape[1] == round(150 * 2 / (world + 1)) > dist.split_tokens_for_sp(torch.empty(1, 150), world, 0).shape[1]
    for family in ("kda", "gdn"):
        _cp_dense(rank, world, device, rng, family, shares=dist.cp_shares(family, 32, 32, world))
    _cp_varlen(rank, world, device, rng, "kda", shares=[3.0] + [1.0] * (world - 1))
    _cp_varlen(rank, world, device, rng, "gla", shares=[1.0] * (world - 1) + [2.5])


def _tp_all(rank, world, device, rng):
    _each(_tp, ("kda", "gdn", "lightning"))(rank, world, device, rng)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_dense_matches_one_process(rng, backend, world):
    """Every family, every sequence of the batch across every rank."""
    _spawn(_cp_dense_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_varlen_with_sequences_across_ranks(rng, backend, world):
    """Packed sequences (empty ones too) cut by the rank boundaries, one across three ranks."""
    _spawn(_cp_varlen_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_on_whole_sequences_runs_level1_without_exchange(rng, backend, world):
    _spawn(_cp_whole_sequences_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_with_uneven_token_shares_matches_one_process(rng, backend, world):
    _spawn(_cp_shares_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


def test_token_shares_split_in_proportion():
    """split_tokens_for_sp / split_cu_seqlens_for_sp with shares: every token once, in rank order,
    in proportion to the weights (the remainder by largest fraction), bad weights refused."""
    x = torch.arange(1000).view(1, 1000)
    for shares in ([2.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.5, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]):
        parts = [dist.split_tokens_for_sp(x, len(shares), r, shares=shares) for r in range(len(shares))]
        assert torch.equal(torch.cat(parts, dim=1), x)
        for p, w in zip(parts, shares):
            assert abs(p.shape[1] - 1000 * w / sum(shares)) < 1
    assert [dist.split_tokens_for_sp(x, 3, r, shares=[1, 1, 1]).shape[1] for r in range(3)] == \
        [dist.split_tokens_for_sp(x, 3, r).shape[1] for r in range(3)]
    cu = torch.tensor([0, 5, 5, 75, 78, 168, 168, 180], dtype=torch.int32)
    local, span = dist.split_cu_seqlens_for_sp(cu, 0, 4, shares=dist.cp_shares("gdn", 128, 128, 4))
    assert span.tolist() == [0, 72] and local.tolist() == [0, 5, 5, 72]
    for bad in ([1.0, 0.0], [1.0, -2.0], [1.0], [1.0, float("inf")]):
        with pytest.raises(cula.CulaError, match="argument 'shares'"):
            dist.split_tokens_for_sp(x, 2, 0, shares=bad)
    with pytest.raises(cula.CulaError, match="argument 'sp_rank'"):
        dist.split_tokens_for_sp(x, 2, 2)


def test_split_sequences_for_sp_cuts_at_the_sequence_boundaries_nearest_the_even_split():
    cu = torch.tensor([0, 5, 5, 75, 78, 168, 168, 180], dtype=torch.int32)
    spans = [[int(x) for x in dist.split_sequences_for_sp(cu, 4, r)[1]] for r in range(4)]
    assert spans == [[0, 75], [75, 78], [78, 168], [168, 180]]
    local, span = dist.split_sequences_for_sp(cu, 2, 1)
    assert span.tolist() == [78, 180] and local.tolist() == [0, 90, 90, 102] and local.dtype == torch.int32
    local, span = dist.split_sequences_for_sp(torch.tensor([0, 100], dtype=torch.int32), 3, 2)  # one sequence
    assert span.tolist() == [100, 100] and local.tolist() == [0]
    with pytest.raises(cula.CulaError, match="argument 'cu_seqlens'"):
        dist.split_sequences_for_sp(torch.tensor([0, 9, 4]), 2, 0)
    with pytest.raises(cula.CulaError, match="argument 'sp_rank'"):
        dist.split_sequences_for_sp(cu, 2, 2)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [2, 4])
def test_fla_cp_context_trains_through_the_drop_ins(rng, backend, world):
    """FLA's cp_context in chunk_kda and chunk_gated_delta_rule with gradients: packed sequences, one
    across three ranks at 4, empty ones; against one process."""
    _spawn(_fla_cp_grad_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [3, 5])
def test_log_depth_scan_exchange_matches_one_process(rng, backend, world):
    """exchange="scan" (point-to-point rounds; 3 and 5 ranks leave a round half used): forward and
    backward as with the all-gather, dense and packed (a sequence across three ranks)."""
    _spawn(_cp_scan_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


def test_exchange_planner():
    from cula import _cp_exchange

    assert _cp_exchange.choose(2, "auto")[0] == "all_gather"
    assert _cp_exchange.choose(8, "auto")[0] == "all_gather"
    assert _cp_exchange.choose(16, "auto")[0] == "scan"
    assert _cp_exchange.choose(16, "all_gather")[0] == "all_gather"
    with pytest.raises(cula.CulaError, match="argument 'exchange': expected one of"):
        _cp_exchange.choose(4, "ring")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [2, 4])
def test_head_parallel_sequence_split_is_exact_with_gradients(rng, backend, world):
    """chunk_sp's head mode (all-to-all): every family, packed sequences, bit for bit on the host."""
    _spawn(_heads_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_backward_matches_one_process(rng, backend, world):
    """chunk_cp under autograd: every family dense, three packed with sequences across ranks."""
    _spawn(_cp_grad_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world", [2, 4])
def test_deterministic_context_parallel_is_bitwise_the_same_on_any_number_of_ranks(rng, backend, world):
    _spawn(_cp_deterministic_all, _world(backend, world), backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
def test_context_parallel_refuses_bad_groups_offsets_and_gradients(rng, backend):
    _spawn(_cp_errors, 2, backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
def test_tensor_parallel_is_bit_exact_with_gradients(rng, backend):
    _spawn(_tp_all, 2, backend, int(rng.integers(1 << 31)))


@pytest.mark.parametrize("backend", _backends())
def test_tensor_and_context_parallel_grid(rng, backend):
    _spawn(_tp_cp, _world(backend, 4), backend, int(rng.integers(1 << 31)))


def test_state_buffers_and_head_shards():
    buf = dist.alloc_state_buffer(3, 8, 64, 32, tp_size=2, device="cpu")
    assert buf.shape == (3, 4, 32, 64) and buf.dtype == torch.float32 and not buf.any()
    pool = dist.alloc_decode_state_pool(5, 8, 64, 32, tp_size=4, dtype=torch.bfloat16, device="cpu")
    assert pool.shape == (5, 2, 32, 64) and pool.dtype == torch.bfloat16
    with pytest.raises(cula.CulaError, match="argument 'tp_size'"):
        dist.alloc_state_buffer(1, 6, 64, 64, tp_size=4, device="cpu")
    x = torch.arange(2 * 7 * 4).reshape(2, 7, 4)
    assert [dist.split_tokens_for_sp(x, 3, r).shape[1] for r in range(3)] == [3, 2, 2]
    assert torch.equal(torch.cat([dist.split_tokens_for_sp(x, 3, r) for r in range(3)], dim=1), x)


def test_bench_cp_harness_runs_on_host_ranks(tmp_path):
    """`cula bench cp --device cpu`: the suite's harness (processes, barriers, slowest-rank times,
    forward and forward + backward, the report) on gloo host ranks, cula's rows only."""
    from cula.bench.cp import SMOKE_CONFIGS, bench_cp

    assert bench_cp(str(tmp_path), device="cpu", configs=SMOKE_CONFIGS[:1]) == 0
    records = json.load(open(tmp_path / "cp_x2.json"))["records"]
    got = {(r["impl"], r["step"]) for r in records}
    assert got == {(i, s) for i in ("cula_cp", "cula_cp_shares", "cula_cp_scan", "cula_cp_det", "one_gpu")
                   for s in ("forward", "forward + backward")}
    assert all(r["median_ms"] > 0 for r in records)
    assert "| kda 1x192 H2 | forward + backward |" in (tmp_path / "cp_x2.md").read_text()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA path (float32 recurrent kernels, offsets by a pinned copy) needs a GPU"))])
@pytest.mark.parametrize("family", ["kda", "gdn", "gla", "simple_gla", "lightning"])
def test_precise_maps_compose_their_sub_pieces(rng, family, device, monkeypatch):
    """_cp_summary.precise_maps with spans longer than its sub-pieces (16 tokens here): A and M of each
    span equal one call over the whole span (A: the end state from the given h0 or zero; M: the
    identity-extended block, or the diagonal of the decays), dense rows and an empty span; on the
    host and on a GPU (where the sub-pieces' offsets reach the device by one pinned copy)."""
    from cula import _cp_summary

    monkeypatch.setattr(_cp_summary, "SUB_SEGMENT", 16)
    K = 32 if device == "cpu" else 64  # (a head size the CUDA kernels are built for)
    d, kw, h0 = _problem(rng, family, 2, 90, 2, 2, K, K, device)
    decay = kw.pop("decay", None)
    spans = [(0, 0, 90), (1, 7, 60), (1, 60, 60)]
    h0s = [h0[0], None, h0[1]]
    A, M = _cp_summary.precise_maps(family, d["q"], d["k"], d["v"], d.get("g"), d.get("beta"), decay, spans, kw,
                                    h0=h0s)
    HV, V, K = h0.shape[1], h0.shape[2], h0.shape[3]
    for i, (b, lo, hi) in enumerate(spans):
        part = {n: x[b:b + 1, lo:hi] for n, x in d.items()}
        init = torch.zeros(1, HV, V + K, K, device=device)
        init[0, :, V:, :] = torch.eye(K, device=device)
        if h0s[i] is not None:
            init[0, :, :V, :] = h0s[i]
        vw = torch.cat([part["v"], part["v"].new_zeros(1, hi - lo, HV, K)], dim=-1)
        _, fw = cula.ops.chunk_fwd(family, part["q"], part["k"], vw, part.get("g"), part.get("beta"), decay,
                                   initial_state=init, output_final_state=True, state_layout="k_last",
                                   state_dtype="float32", **kw, **({"backend": "cuda_fp32"} if device == "cuda" else {}))
        assert _rel(A[i], fw[0, :, :V, :]) < TOL, (family, i, _rel(A[i], fw[0, :, :V, :]))
        assert _rel(M[i], fw[0, :, V:, :]) < TOL, (family, i, _rel(M[i], fw[0, :, V:, :]))


class _ThreadDist:
    """torch.distributed's calls that _cp_exchange makes, for ranks that are threads of one process:
    point-to-point messages through queues, all_gather through a barrier."""

    def __init__(self, world):
        import queue
        import threading

        self.world, self.local = world, threading.local()
        self.queues = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
        self.barrier, self.board = threading.Barrier(world), {}
        self.isend, self.irecv = "isend", "irecv"

    def get_world_size(self, group=None):
        return self.world

    def P2POp(self, op, tensor, peer, group=None):  # noqa: N802 (torch's name)
        return (op, tensor, peer)

    def batch_isend_irecv(self, ops):
        me = self.local.rank
        for op, t, peer in ops:
            if op == "isend":
                self.queues[(me, peer)].put(t.clone())
        for op, t, peer in ops:
            if op == "irecv":
                t.copy_(self.queues[(peer, me)].get(timeout=10))
        return []

    def all_gather(self, out, x, group=None):
        self.board[self.local.rank] = x.clone()
        self.barrier.wait()
        for r in range(self.world):
            out[r].copy_(self.board[r])
        self.barrier.wait()

    def get_global_rank(self, group, r):
        return r


@pytest.mark.parametrize("world", [1, 2, 3, 7, 8, 13])
@pytest.mark.parametrize("reverse", [False, True])
def test_exchange_scan_and_all_gather_compose_the_maps_in_order(world, reverse):
    """_cp_exchange on ranks that are threads: for every rank, the scan and the all-gather give the
    maps of the ranks before it (reverse: after it, the last first) composed in order at zero."""
    import threading

    from cula import _cp_exchange

    g = torch.Generator().manual_seed(world)
    P = [torch.randn(2, 1, 3, 3, generator=g, dtype=torch.float64) * 0.7 for _ in range(world)]
    Q = [torch.randn(2, 1, 4, 3, generator=g, dtype=torch.float64) for _ in range(world)]
    want = []
    for r in range(world):
        Z = torch.zeros_like(Q[0])
        for j in (range(world - 1, r, -1) if reverse else range(r)):
            Z = Z @ P[j] + Q[j]
        want.append(Z)
    for how in ("scan", "all_gather"):
        fake, got, errors = _ThreadDist(world), [None] * world, []

        def rank_main(r):
            fake.local.rank = r
            try:
                got[r] = _cp_exchange.incoming(fake, None, r, world, P[r], Q[r], how, reverse=reverse)
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        for r in range(world):
            assert torch.allclose(got[r], want[r], rtol=1e-12, atol=1e-12), (how, reverse, world, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor-core path of bmm_f32 needs a CUDA device")
def test_bmm_f32_on_cuda_keeps_float32_precision(rng):
    """The summaries' products (the carried-state correction, the diagonal maps) on bf16 tensor cores
    in two parts per float32 operand: within 1e-5 of float64 where one bf16 product is ~1e-3 off,
    for float32 x float32, bfloat16 x float32 and strided views like the callers'."""
    from cula._cp_summary import bmm_f32

    def rel(x, ref):
        return float((x.double() - ref).norm() / ref.norm())

    a = torch.from_numpy(rng.standard_normal((300, 6, 128)).astype(np.float32)).cuda()  # [L, HV, K] as Q~
    b = torch.from_numpy(rng.standard_normal((6, 96, 128)).astype(np.float32)).cuda()   # [HV, V, K]
    a_t, b_t = a.transpose(0, 1), b.transpose(1, 2)
    ref = torch.bmm(a_t.double(), b_t.double())
    assert rel(bmm_f32(a_t, b_t), ref) < 1e-5
    one_part = torch.bmm(a_t.bfloat16(), b_t.bfloat16(), out_dtype=torch.float32)
    assert rel(one_part, ref) > 1e-4, "the check cannot tell one bf16 product from the split"
    v = a_t.bfloat16()  # a bf16 operand is exact in one part
    assert rel(bmm_f32(v, b_t), torch.bmm(v.double(), b_t.double())) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CP rank's pass and correction run on a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_carried_state_correction_on_cuda_matches_one_pass_and_restores_tf32(rng, monkeypatch, dtype):
    """One rank's CP work on one GPU (a piece crossing in and out, the exchange replaced by a fixed
    incoming state X): its o equals the float64 reference from X within SPEC's tolerance (bf16 o: the
    correction's product in TF32; float32 o: in float32, the engine's inputs a bf16 copy either way);
    torch's TF32 flag is as the caller left it afterwards."""
    from cula import ops

    T, H, K, V = 300, 2, 128, 128
    q, k, v = (torch.from_numpy(rng.standard_normal((1, T, H, K)).astype(np.float32)).cuda().to(dtype)
               for _ in range(3))
    g = torch.from_numpy(-rng.uniform(0.01, 0.5, (1, T, H, K)).astype(np.float32)).cuda()
    beta = torch.from_numpy(rng.uniform(0.05, 0.95, (1, T, H)).astype(np.float32)).cuda()
    X = torch.from_numpy(rng.standard_normal((1, H, V, K)).astype(np.float32)).cuda() * 0.5
    monkeypatch.setattr(dist, "_incoming_states", lambda *a: X)
    opts = dict(use_qk_l2norm_in_kernel=True)
    before = torch.backends.cuda.matmul.allow_tf32
    o, _, _ = dist._cp_pieces("kda", q, k, v, g, beta, None, None, None, 1, [(0, 0, T, True, True)], True, None,
                              dict(opts), "all_gather")
    assert torch.backends.cuda.matmul.allow_tf32 == before
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    ref = ops.chunk_fwd("kda", q.double().cpu(), k.double().cpu(), v.double().cpu(), g.double().cpu(),
                        beta.double().cpu(), None, initial_state=X.double().cpu(), cu_seqlens=cu.cpu(),
                        state_layout="k_last", backend="reference", **opts)[0]
    assert o.dtype == dtype
    err = float((o.double().cpu() - ref).norm() / ref.norm())
    assert err < TOL_CUDA, err
