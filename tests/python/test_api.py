"""Level 0 behaviour: array kinds, decode semantics, backward, gate, CLI."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import rel

import cula


def test_version_and_backends():
    assert cula.__version__.count(".") == 2
    assert cula.backend_for("chunk_fwd", "cpu") == "cpu"
    assert cula.backend_for("chunk_bwd", "cpu") == "reference"


def test_the_float32_cuda_backend_names_its_device(rng):
    """backend="cuda_fp32" (the CUDA rows whose arithmetic is float32 throughout) is a CUDA backend:
    host tensors are refused naming the argument; an unknown backend lists the known ones."""
    q, k, v = (rng.standard_normal((1, 8, 2, 64)).astype(np.float32) for _ in range(3))
    g, beta = -rng.uniform(0.01, 0.3, (1, 8, 2, 64)).astype(np.float32), rng.uniform(0.1, 0.9, (1, 8, 2)).astype(np.float32)
    with pytest.raises(cula.CulaError, match="argument 'backend': expected a backend for host tensors, got CUDA_FP32"):
        cula.chunk_fwd("kda", q, k, v, g, beta, backend="cuda_fp32")
    with pytest.raises(cula.CulaError, match=r"argument 'backend': expected one of .*'cuda_fp32'"):
        cula.chunk_fwd("kda", q, k, v, g, beta, backend="cuda_f32")


def test_intermediate_states_are_states_before_each_chunk(rng):
    B, T, H, K, V = 1, 40, 1, 8, 4
    q, k = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = -rng.uniform(0.01, 0.3, (B, T, H, K)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    o, s, h = cula.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True,
                             return_intermediate_states=True, chunk_size=16, state_layout="k_first")
    assert h.shape == (1, 3, H, K, V)
    for c in range(3):
        t = 16 * c
        if t == 0:
            assert np.abs(h[0, 0]).max() == 0
            continue
        _, s_prefix = cula.chunk_kda(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], use_qk_l2norm_in_kernel=True,
                                     output_final_state=True, state_layout="k_first")
        assert rel(h[0, c], s_prefix[0]) < 1e-5


def test_decode_speculative_matches_sequential_tokens(rng):
    N, T, H, K, V, P = 3, 3, 2, 8, 4, 12
    q, k = (rng.standard_normal((N, T, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((N, T, H, V)).astype(np.float32)
    g = -rng.uniform(0.01, 0.3, (N, T, H, K)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (N, T, H)).astype(np.float32)
    pool = rng.standard_normal((P, H, V, K)).astype(np.float32)
    idx = rng.permutation(P)[: N * T].reshape(N, T).astype(np.int32)
    acc = np.array([0, 2, 3], np.int32)
    p1 = pool.copy()
    o, _ = cula.decode(q, k, v, p1, g=g, beta=beta, state_indices=idx, num_accepted_tokens=acc,
                       use_qk_l2norm_in_kernel=True)
    for n in range(N):
        start = idx[n, max(acc[n], 1) - 1]
        ref_pool = pool.copy()
        slot = np.array([start], np.int32)
        for t in range(T):
            ot, _ = cula.decode(q[n:n + 1, t:t + 1], k[n:n + 1, t:t + 1], v[n:n + 1, t:t + 1], ref_pool,
                                g=g[n:n + 1, t:t + 1], beta=beta[n:n + 1, t:t + 1], state_indices=slot,
                                use_qk_l2norm_in_kernel=True, backend="reference")
            assert rel(o[n, t], ot[0, 0]) < 1e-5
            assert rel(p1[idx[n, t]], ref_pool[slot[0]]) < 1e-5


def test_backward_shapes_and_finite(rng):
    B, T, H, K, V = 1, 12, 2, 8, 4
    q, k = (rng.standard_normal((B, T, H, K)) for _ in range(2))
    v, do = (rng.standard_normal((B, T, H, V)) for _ in range(2))
    g = rng.standard_normal((B, T, H))
    beta = rng.standard_normal((B, T, H))
    grads = cula.chunk_bwd("gdn", q, k, v, g, beta, do, use_gate_in_kernel=True, A_log=np.zeros(H),
                           dt_bias=np.zeros(H), use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
    assert set(grads) == {"dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"}
    for name, x in grads.items():
        assert np.isfinite(x).all(), name


def test_kda_gate_formula(rng):
    g = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    A = rng.uniform(-1, 0.5, 2).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    x = g.astype(np.float64) + bias.reshape(2, 8)
    out = cula.kda_gate(g, A, bias)
    ref = -np.exp(A.astype(np.float64))[:, None] * np.log1p(np.exp(x))
    assert rel(out, ref) < 1e-6
    out = cula.kda_gate(g, A, bias, lower_bound=-5.0)
    ref = -5.0 / (1 + np.exp(-np.exp(A.astype(np.float64))[:, None] * x))
    assert rel(out, ref) < 1e-6


def test_torch_tensors_round_trip(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    q, k = (torch.randn(1, 20, 2, 8, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 20, 2, 8, dtype=torch.bfloat16)
    g = -torch.rand(1, 20, 2, 8) * 0.3
    beta = torch.rand(1, 20, 2)
    o, s = cula.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o2, s2 = cula.chunk_kda(q.float().numpy(), k.float().numpy(), v.float().numpy(), g.numpy(), beta.numpy(),
                            use_qk_l2norm_in_kernel=True, output_final_state=True)
    assert rel(o.float().numpy(), o2) < 5e-3 and rel(s.numpy(), s2) < 1e-5


def _run_cli(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "cula", *args], capture_output=True, text=True, env=env, timeout=600)


def test_cli_info():
    r = _run_cli("info")
    assert r.returncode == 0, r.stderr
    assert "backends" in r.stdout and "chunk_fwd" in r.stdout


def test_cli_demo_quick():
    r = _run_cli("demo", "--quick")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all families match the float64 reference" in r.stdout
    assert "softmax" in r.stdout
    assert "grows as T^" in r.stdout  # what it measured, not a fixed sentence


def test_demo_growth_exponent_is_the_log_log_slope(rng):
    from cula.cli.demo import growth_exponent
    lengths = [512, 1024, 2048, 4096]
    c, a = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.5)
    times = [c * t ** a for t in lengths]
    assert abs(growth_exponent(lengths, times) - a) < 1e-9


def test_last_kernel_names_the_row_that_ran(rng):
    B, T, H, K = 1, 40, 2, 32
    q, k, v = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(3))
    g = -rng.uniform(0.01, 0.3, (B, T, H, K)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    cula.chunk_kda(q, k, v, g, beta)
    assert cula.last_kernel() == "cpu"
    cula.chunk_kda(*(x.astype(np.float64) for x in (q, k, v, g, beta)))
    assert cula.last_kernel() == "reference"  # float64 in: float64 arithmetic
    cula.chunk_kda(*(x.astype(np.float64) for x in (q, k, v, g, beta)), backend="cpu")
    assert cula.last_kernel() == "cpu"  # an explicit backend runs even where AUTO would not pick it
    cula.decode(q[:, :1].reshape(1, 1, H, K), k[:, :1].reshape(1, 1, H, K), v[:, :1].reshape(1, 1, H, K),
                np.zeros((1, H, K, K), np.float32), mode="kda", g=g[:, :1].reshape(1, 1, H, K),
                beta=beta[:, :1].reshape(1, 1, H))
    assert cula.last_kernel() == "cpu"
    assert cula.backend_for("chunk_fwd", "cpu") == "cpu"


def test_bench_results_series_follow_the_json_records(tmp_path):
    """The plot beside a results file is drawn from that file's records: configurations in order,
    floor and cula first, peers as they appear; records without a named configuration (decode,
    geometric means, ratios) are left out."""
    import json

    from cula.bench.common import replot, series_from_records

    cfg = lambda name: dict(name=name, B=1, T=64, H=1)  # noqa: E731
    records = [dict(op="x", config=cfg("a"), impl="cula", median_ms=1.5),
               dict(op="x", config=cfg("a"), impl="fla_triton", median_ms=3.0),
               dict(op="x", config=cfg("a"), impl="floor", median_ms=0.25),
               dict(op="x", config=cfg("a"), impl="ratio_fla_triton_over_cula", ratio=2.0),
               dict(op="x", config=cfg("b"), impl="cula", median_ms=2.5),
               dict(op="x", config=cfg("b"), impl="floor", median_ms=0.5),
               dict(op="x", config=dict(N=1, T=1), impl="cula", median_ms=9.0),
               dict(op="x", config="grid", impl="geomean_fla_triton_over_cula", ratio=2.0)]
    names, series = series_from_records(records)
    assert names == ["a", "b"]
    assert series == [("floor", [0.25, 0.5]), ("cula", [1.5, 2.5]), ("fla_triton", [3.0, 0])]
    (tmp_path / "x.json").write_text(json.dumps(dict(meta=dict(gpu="g"), records=records)))
    assert replot(str(tmp_path)) == 0  # draws x.png where matplotlib is installed, says so where not


def test_kda_bench_resume_keeps_measured_rows_and_recomputes_the_means(tmp_path):
    """A KDA benchmark run cut short keeps what it wrote; --resume reads those rows back (same GPU
    and timing method only), with their queued timings, and the report puts every row in grid order
    with geometric means over all of them, for the single calls and for the queued calls."""
    import json

    from cula.bench import kda as bench_kda

    names = [c[0] for c in bench_kda.CONFIGS]

    def row(name, cula_ms, fla_ms):
        return (name, {"cula": cula_ms, "fla_triton": fla_ms}, 0.1, "cuda_mma", {"rel_vs_fla": 1e-3})

    def queued(r):  # the queued timings of a row: the host's share gone
        name, res, floor, kernel, _ = r
        return (name, {i: ms - 0.05 for i, ms in res.items()}, floor, kernel, {})

    def records_of(r):
        name, res, floor, kernel, check = r
        resq = queued(r)[1]
        cfg = dict(name=name, B=1, T=64, H=1)
        return ([dict(op="kda_fwd", config=cfg, impl=i, median_ms=ms, median_ms_queued=resq[i]) for i, ms in res.items()] +
                [dict(op="kda_fwd", config=cfg, impl="floor", median_ms=floor),
                 dict(op="kda_fwd", config=cfg, impl="cula_kernel", name=kernel, **check)])

    late, early = row(names[2], 2.0, 3.0), row(names[0], 1.0, 4.0)  # measured out of grid order
    meta = dict(gpu="gpu0", copy_gb_per_s=1.0, method="m", queued_method="q")
    bench_kda._report(str(tmp_path), meta, [late], records_of(late), [queued(late)], quiet=True)
    records, rows, qrows = bench_kda._done_rows(str(tmp_path), "gpu0", "m")
    assert [r[0] for r in rows] == [names[2]] and rows[0][1] == late[1] and rows[0][4] == late[4]
    assert qrows == [queued(late)]
    assert bench_kda._done_rows(str(tmp_path), "another gpu", "m") == ([], [], [])
    assert bench_kda._done_rows(str(tmp_path), "gpu0", "another method") == ([], [], [])
    bench_kda._report(str(tmp_path), meta, rows + [early], records + records_of(early), qrows + [queued(early)],
                      quiet=True)
    data = json.loads((tmp_path / "kda_fwd.json").read_text())
    assert [r[0] for r in bench_kda._done_rows(str(tmp_path), "gpu0", "m")[1]] == [names[0], names[2]]
    gm = [r for r in data["records"] if r["impl"] == "geomean_fla_triton_over_cula"]
    assert len(gm) == 1 and abs(gm[0]["ratio"] - (4.0 * 1.5) ** 0.5) < 1e-3 and gm[0]["worst"] == 1.5
    gq = [r for r in data["records"] if r["impl"] == "geomean_fla_triton_over_cula_queued"]
    assert len(gq) == 1 and abs(gq[0]["ratio"] - (3.95 / 0.95 * 2.95 / 1.95) ** 0.5) < 1e-3
    md = (tmp_path / "kda_fwd.md").read_text()
    assert md.index(f"| {names[0]} |") < md.index(f"| {names[2]} |")
    queued_part = md[md.index("## Queued calls"):]
    assert "q." in queued_part and f"| {names[0]} | 0.100 | 0.950 | 3.950 |" in queued_part


def test_bench_merge_takes_each_row_from_its_latest_run_and_rebuilds_the_means(tmp_path):
    """cula bench merge: rows of several runs of one suite in one results file, a later run's row
    replacing an earlier one of the same name, each row credited to its run, geometric means over the
    merged rows (each ratio within its own run), grid order kept; merging the result again changes
    nothing; inputs of another GPU are refused."""
    import json

    from cula.bench.common import merge_reports
    from cula.cli import main

    def run(path, gpu, date, rows):
        records = []
        for name, cula_ms, fla_ms in rows:
            cfg = dict(name=name, B=1, T=64, H=1)
            records += [dict(op="cov", config=cfg, impl="cula", median_ms=cula_ms, median_ms_queued=cula_ms / 2),
                        dict(op="cov", config=cfg, impl="fla_triton", median_ms=fla_ms, median_ms_queued=fla_ms / 2),
                        dict(op="cov", config=cfg, impl="floor", median_ms=0.1),
                        dict(op="cov", config=cfg, impl="cula_kernel", name="cuda_mma", rel_vs_fla=1e-3)]
        path.write_text(json.dumps(dict(meta=dict(gpu=gpu, copy_gb_per_s=1.0, method="m", queued_method="q",
                                                  date=date, title="T"), records=records)))
        return str(path)

    a = run(tmp_path / "a.json", "g", "d1", [("r1", 1.0, 2.0), ("r2", 1.0, 0.5)])
    b = run(tmp_path / "b.json", "g", "d2", [("r2", 1.0, 4.0), ("r0", 2.0, 2.0)])
    out = tmp_path / "out"
    assert main(["bench", "merge", "--out", str(out), "--inputs", a, b]) == 0
    merge_reports(str(out), [a, b], order=["r0", "r1", "r2"])
    data = json.loads((out / "cov.json").read_text())
    assert [r["rows"] for r in data["meta"]["runs"]] == [["r1"], ["r2", "r0"]]
    r2 = [r for r in data["records"] if isinstance(r["config"], dict) and r["config"]["name"] == "r2"]
    assert {r["impl"]: r.get("median_ms") for r in r2}["fla_triton"] == 4.0 and len(r2) == 4
    gm = {r["impl"]: r for r in data["records"] if r["config"] == "grid"}
    assert abs(gm["geomean_fla_triton_over_cula"]["ratio"] - (1.0 * 2.0 * 4.0) ** (1 / 3)) < 1e-3
    assert gm["geomean_fla_triton_over_cula_queued"]["worst"] == 1.0
    md = (out / "cov.md").read_text()
    assert md.index("| r0 |") < md.index("| r1 |") < md.index("| r2 |") and "## Queued calls" in md
    merge_reports(str(out), [str(out / "cov.json")], order=["r0", "r1", "r2"])
    assert (out / "cov.md").read_text() == md
    assert json.loads((out / "cov.json").read_text())["meta"]["runs"] == data["meta"]["runs"]
    c = run(tmp_path / "c.json", "other", "d3", [("r3", 1.0, 1.0)])
    with pytest.raises(ValueError, match="other"):
        merge_reports(str(out), [a, c])


def test_bench_merge_of_training_runs_keeps_the_backward_table_and_gradient_checks(tmp_path):
    """cula bench merge of two `bench train` runs: the merged report keeps the training suite's own
    table (backward alone, peak memory), each row's gradient check against FLA (the largest of its
    inputs' relative differences) and FLA's refusals; a row without FLA shows dashes, not nan."""
    import json

    from cula.cli import main

    def run(path, rows):
        records = []
        for name, fla in rows:
            cfg = dict(name=name, family="gdn", B=1, T=64, H=1)
            records += [dict(op="gdn_train", config=cfg, impl="cula", median_ms=2.0, median_ms_queued=1.0,
                             backward_ms_queued=0.8, peak_mib=10.0),
                        dict(op="gdn_train", config=cfg, impl="floor", median_ms=0.1),
                        dict(op="gdn_train", config=cfg, impl="cula_kernel", name="cuda_mma / cuda_chunk")]
            if fla:
                records += [dict(op="gdn_train", config=cfg, impl="fla_triton", median_ms=3.0, median_ms_queued=1.5,
                                 backward_ms_queued=1.2, peak_mib=8.0),
                            dict(op="gdn_train", config=cfg, impl="grad_rel_diff_vs_fla", by_input=dict(q=1e-3, k=4e-3))]
            else:
                records.append(dict(op="gdn_train", config=cfg, impl="fla_triton", refused="RuntimeError: no"))
        path.write_text(json.dumps(dict(meta=dict(gpu="g", copy_gb_per_s=1.0, method="m", queued_method="q",
                                                  date="d"), records=records)))
        return str(path)

    out = tmp_path / "out"
    a = run(tmp_path / "gdn_train.json", [("r1", True)])
    (tmp_path / "b").mkdir()
    b = run(tmp_path / "b" / "gdn_train.json", [("r2", False)])
    assert main(["bench", "merge", "--out", str(out), "--inputs", a, b]) == 0
    md = (out / "gdn_train.md").read_text()
    assert "## Backward alone (queued) and peak memory of one step" in md
    assert "| r1 | 0.800 | 1.200 | 1.50x | 10 | 8 |" in md and "| r2 | 0.800 | - | - | 10 | - |" in md
    assert "| 4.0e-03 |" in md and "nan" not in md and "FLA refused: r2: RuntimeError: no" in md


def test_decode_markdown_shows_both_modes_ratios(tmp_path):
    """decode.md is drawn from decode.json's records: one row per configuration in measured order,
    with FLA / cula for eager calls and for graph replay; without FLA the peer columns are dashes."""
    from cula.bench.decode import write_decode_markdown

    def recs(sd, H, N, cula, fla=None):
        cfg = dict(T=1, N=N, H=H, K=128, V=128, state_dtype=sd)
        out = [dict(config=cfg, impl="cula", mode=m, median_ms=ms, gb_per_s=1000.0, pct_copy_bw=50.0)
               for m, ms in zip(("eager", "graph"), cula)]
        if fla:
            out += [dict(config=cfg, impl="fla_triton", mode=m, median_ms=ms, gb_per_s=900.0, pct_copy_bw=45.0)
                    for m, ms in zip(("eager", "graph"), fla)]
            out += [dict(config=cfg, impl="ratio_fla_over_cula", mode=m, ratio=round(f / c, 3))
                    for m, f, c in zip(("eager", "graph"), fla, cula)]
        return out

    meta = dict(gpu="g", copy_gb_per_s=3000.0, method="m", fla="0.6.0")
    lines = write_decode_markdown(str(tmp_path), meta, recs("float32", 32, 64, (0.2, 0.1), (0.1, 0.15)) +
                                  recs("bfloat16", 64, 1, (0.05, 0.004)))
    assert (tmp_path / "decode.md").read_text().splitlines() == lines
    rows = [l for l in lines if l.startswith("| float32") or l.startswith("| bfloat16")]
    assert rows[0].endswith("| 0.50x | 1.50x |") and rows[0].startswith("| float32 | 32 | 64 |")
    assert rows[1].endswith("| - | - | - | - | - |") and rows[1].startswith("| bfloat16 | 64 | 1 |")
    assert all(l.count("|") == lines[4].count("|") for l in rows)


def test_numpy_views_of_any_layout_give_the_contiguous_result(rng):
    """Reversed, transposed, sliced and broadcast numpy views travel as (pointer, strides) and give
    the bits of the contiguous arrays, and so do Fortran-ordered and read-only inputs."""
    B, T, H, K, V = 2, 21, 2, 8, 4
    q, k = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = -rng.uniform(0.01, 0.3, (B, T, H, K)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    h0 = rng.standard_normal((B, H, V, K)).astype(np.float32)
    ref = cula.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def reversed_view(x):  # the same values behind negative strides
        return np.flip(np.ascontiguousarray(np.flip(x, axis=1)), axis=1)

    def padded_view(x):  # the same values inside a larger buffer, last dimension strided by 2
        buf = np.full(x.shape[:-1] + (2 * x.shape[-1],), np.nan, x.dtype)
        buf[..., ::2] = x
        return buf[..., ::2]

    for make in (reversed_view, padded_view, np.asfortranarray):
        views = [make(x) for x in (q, k, v, g, beta, h0)]
        assert any(not x.flags.c_contiguous for x in views)
        got = cula.chunk_kda(*views[:5], initial_state=views[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1]), make.__name__
    # A gate shared by every head as a broadcast (zero-stride, read-only) view.
    g1 = g[:, :, :1]
    shared = np.broadcast_to(g1, g.shape)
    a = cula.chunk_kda(q, k, v, shared, beta, use_qk_l2norm_in_kernel=True)
    b = cula.chunk_kda(q, k, v, np.ascontiguousarray(shared), beta, use_qk_l2norm_in_kernel=True)
    assert np.array_equal(a[0], b[0])


def test_workspace_peak_is_zero_without_a_device_and_counts_bytes_with_one():
    """cula_workspace_peak_bytes: the CUDA kernels' pool high-water mark (cula bench train adds it to
    torch's peak); 0 for a device index the machine does not have."""
    lib = cula._lib.LIB
    n = lib.cula_cuda_device_count()
    assert lib.cula_workspace_peak_bytes(n, 0) == 0 and lib.cula_workspace_peak_bytes(-1, 1) == 0
    if n > 0:
        assert lib.cula_workspace_peak_bytes(0, 1) >= 0  # reset; the next count starts at what is in use


def test_explain_names_the_kernel_and_why_the_rows_before_it_declined(rng):
    B, T, H, K = 1, 40, 2, 32
    q, k, v = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(3))
    g = -rng.uniform(0.01, 0.3, (B, T, H, K)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    e = cula.explain("chunk_fwd", "kda", q, k, v, g, beta)
    assert e.kernel == "cpu" and e.declined == {}
    cula.chunk_kda(q, k, v, g, beta)
    assert cula.last_kernel() == e.kernel  # the answer is the kernel that runs the call
    e64 = cula.explain("chunk_fwd", "kda", *(x.astype(np.float64) for x in (q, k, v, g, beta)))
    assert e64.kernel == "reference" and "float64" in e64.declined["cpu"]
    pool = rng.standard_normal((3, H, K, K)).astype(np.float32)
    d = cula.explain("decode", q[:, :1], k[:, :1], v[:, :1], pool, mode="kda", g=g[:, :1], beta=beta[:, :1],
                     state_indices=np.array([2], np.int32))
    assert d.kernel == "cpu"
    with pytest.raises(cula.CulaError, match="argument 'beta'"):  # validated as the op validates
        cula.explain("chunk_fwd", "kda", q, k, v, g, beta[:, :3])
    do = rng.standard_normal((B, T, H, K)).astype(np.float32)
    assert cula.explain("chunk_bwd", "kda", q, k, v, g, beta, do).kernel == "reference"
    assert cula.explain("kda_gate", g, A_log=np.zeros(H, np.float32)).kernel == "cpu"
    with pytest.raises(cula.CulaError, match="argument 'op'"):
        cula.explain("chunk_fwd_twice", "kda", q, k, v, g, beta)


def test_validate_entries_check_the_arguments_and_run_nothing(rng):
    """cula_decode_validate / cula_chunk_fwd_validate (the checks behind CULA_CHECK_DEVICE_INDICES):
    the op's own errors for bad slot indices, and for good ones no kernel chosen and nothing written."""
    from cula import _lib
    N, H, K = 3, 2, 32
    q, k, v = (rng.standard_normal((N, 1, H, K)).astype(np.float32) for _ in range(3))
    g = -rng.uniform(0.01, 0.3, (N, 1, H, K)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (N, 1, H)).astype(np.float32)
    pool = rng.standard_normal((N + 1, H, K, K)).astype(np.float32)
    before = pool.copy()
    out = np.full((N, 1, H, K), np.nan, np.float32)
    entry = _lib.LIB.cula_decode_validate
    cula.decode(q, k, v, pool, mode="kda", g=g, beta=beta, state_indices=np.array([2, 0, -1], np.int32), out=out,
                _entry=entry)
    assert np.array_equal(pool, before) and np.isnan(out).all()  # validated, not run
    for bad, msg in (([2, 0, 2], "slot 2 named by sequences 0 and 2"), ([2, 0, 4], "slot indices < pool size P = 4")):
        with pytest.raises(cula.CulaError, match=msg):
            cula.decode(q, k, v, pool, mode="kda", g=g, beta=beta, state_indices=np.array(bad, np.int32),
                        _entry=entry)
    cu = np.arange(N + 1, dtype=np.int32)
    flat = [x.reshape(1, N, *x.shape[2:]) for x in (q, k, v, g)]
    with pytest.raises(cula.CulaError, match="slot 2 named by sequences 0 and 2"):
        cula.chunk_fwd("kda", *flat, beta.reshape(1, N, H), cu_seqlens=cu, state_pool=pool,
                       state_indices=np.array([2, 0, 2], np.int32), _entry=_lib.LIB.cula_chunk_fwd_validate)
    assert np.array_equal(pool, before)


def test_decode_final_state_out_on_the_host_matches_in_place(rng):
    """final_state_out on the host backends (cpu and the float64 reference): the final states equal
    the in-place update's bit for bit, the pool is left as it was, o is the same; with state_indices
    it is refused by name before anything runs."""
    N, H, K = 3, 2, 32
    q, k, v = (rng.standard_normal((N, 2, H, K)).astype(np.float32) for _ in range(3))
    g = -rng.uniform(0.01, 0.3, (N, 2, H, K)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (N, 2, H)).astype(np.float32)
    for backend, dt in (("cpu", np.float32), ("reference", np.float64)):
        x = [a.astype(dt) for a in (q, k, v, g, beta)]
        pool = rng.standard_normal((N + 1, H, K, K)).astype(np.float32)
        before = pool.copy()
        in_place = pool.copy()
        o_in, _ = cula.decode(*x[:3], in_place, mode="kda", g=x[3], beta=x[4], backend=backend)
        out = np.full((N, H, K, K), np.nan, np.float32)
        o, final = cula.decode(*x[:3], pool, mode="kda", g=x[3], beta=x[4], final_state_out=out, backend=backend)
        assert final is out and np.array_equal(pool, before), backend
        assert np.array_equal(out, in_place[:N]) and np.array_equal(o, o_in), backend
        with pytest.raises(cula.CulaError, match="argument 'final_state_out': expected None with state_indices"):
            cula.decode(*x[:3], pool, mode="kda", g=x[3], beta=x[4], final_state_out=out,
                        state_indices=np.arange(N, dtype=np.int32), backend=backend)
        assert np.array_equal(pool, before)
