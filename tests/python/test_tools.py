"""The repository's tools that run without a GPU."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ncu_source_summary_reads_the_source_page(tmp_path):
    """Stall reasons as shares of all samples, the hottest instructions first with their main
    reasons, instructions per unit of work, and address ranges by share (ncu's CSV layout: a kernel
    line, then the header; columns it does not know are ignored)."""
    tool = _tool("ncu_source_summary")
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
              "stall_barrier", "stall_wait (Not Issued)", "Other"]
    rows = [["0x7f0000000000", "  LDC R1, c[0x0][0x28]", "10", "64", "10", "0", "9", "x"],
            ["0x7f0000000010", "  BAR.SYNC 0x0", "30", "64", "0", "30", "0", "x"],
            ["0x7f0000000900", "  HMMA.16816.F32.BF16 R4, R8, R12, R4", "60", "128", "50", "10", "40", "x"]]
    path = tmp_path / "r.csv"
    path.write_text('"Kernel Name","void k()",\n' + "\n".join(",".join(f'"{c}"' for c in r) for r in [header] + rows) + "\n")
    h, got = tool.read_rows(str(path))
    assert h == header and len(got) == 3
    out = tool.summarise(h, got, top=2, bucket=0x800, units=4)
    assert out[0] == "3 instructions, 100 warp samples, 256 warp instructions executed"
    assert out[1].startswith("64.0 warp instructions per unit")
    assert "  wait                  60.0%" in out and "  barrier               40.0%" in out
    top = out[out.index(next(l for l in out if l.startswith("top 2"))) + 1:][:2]
    assert "HMMA" in top[0] and "wait 50, barrier 10" in top[0] and "BAR.SYNC" in top[1]
    ranges = out[-2:]
    assert ranges[0].split() == ["+000000", "50.0%", "40.0%"] and ranges[1].split() == ["+000800", "50.0%", "60.0%"]
    assert tool.main([str(path), "--top", "1"]) == 0


def _two_builds(tmp_path):
    """Two copies of the loaded libcula.so under tmp_path, as ab_kernel_time's --lib arguments take them."""
    import shutil

    import pytest

    cula_lib = pytest.importorskip("cula._lib")
    libs = {}
    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        libs[name] = str(tmp_path / name / "libcula.so")
        shutil.copy(str(cula_lib.LIB.path), libs[name])
    return libs


def test_ab_kernel_time_takes_turns_between_builds(tmp_path):
    """Each round runs every library in a process of its own that loads that library (CPU backend,
    small shapes): a time per round for every config, and the JSON names what each process loaded."""
    import json

    libs = _two_builds(tmp_path)
    out = tmp_path / "ab.json"
    tool = _tool("ab_kernel_time")
    configs = ["1x96:2", "varlen:40,0,57:2"]
    argv = [x for n, p in libs.items() for x in ("--lib", f"{n}={p}")] + ["--device", "cpu", "--kv", "64",
                                                                          "--rounds", "2", "--reps", "1", "--groups", "1",
                                                                          "--json", str(out)]
    assert tool.main(argv + [x for c in configs for x in ("--config", c)]) == 0
    data = json.loads(out.read_text())
    assert data["loaded"] == libs and data["kernels"] == {"old": "cpu", "new": "cpu"}
    for name in libs:
        assert sorted(data["ms"][name]) == sorted(configs)
        assert all(len(v) == 2 and min(v) > 0 for v in data["ms"][name].values())
    assert tool.parse_config("varlen:40,0,57:2") == (1, 97, 2, 2, [40, 0, 57])
    assert tool.parse_config("2x8192:64") == (2, 8192, 64, 64, None)
    assert tool.parse_config("1x8192:16/32") == (1, 8192, 16, 32, None)


def test_ab_kernel_time_times_the_backward_of_every_family(tmp_path):
    """--op bwd: the backward op of each family (Lightning with its decay) under two builds, on the
    CPU backend's reference backward; the JSON records the op, and --split each build's rows per round
    (on the host, the op's one row)."""
    import json

    libs = _two_builds(tmp_path)
    tool = _tool("ab_kernel_time")
    for family in ("kda", "gdn", "gla", "simple_gla", "lightning"):
        out = tmp_path / f"{family}.json"
        configs = ["varlen:40,0,23:2"] + (["1x30:1/2"] if family in ("kda", "gdn") else [])  # grouped value heads
        argv = [x for n, p in libs.items() for x in ("--lib", f"{n}={p}")] + [
            "--device", "cpu", "--kv", "64", "--rounds", "1", "--reps", "1", "--groups", "1", "--family", family,
            "--op", "bwd", "--split", "--json", str(out)] + [x for c in configs for x in ("--config", c)]
        assert tool.main(argv) == 0, family
        data = json.loads(out.read_text())
        assert data["op"] == "bwd" and data["kernels"] == {"old": "reference", "new": "reference"}, data
        for c in configs:
            assert all(min(v[c]) > 0 for v in data["ms"].values()), (family, c)
            for name in libs:
                (rows,) = data["split"][name][c]
                assert list(rows) == ["reference (host)"] and rows["reference (host)"] > 0, rows


def test_ab_kernel_time_runs_one_build_under_two_settings(tmp_path):
    """--env NAME:VAR=VALUE sets a variable in one library's processes only (one build, two settings),
    recorded in the JSON; a name that is not a --lib name is refused. (With --no-l2norm: q and k as drawn.)"""
    import json

    import pytest

    libs = _two_builds(tmp_path)
    tool = _tool("ab_kernel_time")
    out = tmp_path / "env.json"
    argv = [x for n, p in libs.items() for x in ("--lib", f"{n}={p}")] + [
        "--device", "cpu", "--kv", "64", "--rounds", "1", "--reps", "1", "--groups", "1", "--config", "1x40:1"]
    assert tool.main(argv + ["--env", "new:CULA_BWD_LEAN=0", "--no-l2norm", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["env"] == {"new": {"CULA_BWD_LEAN": "0"}} and all(min(v["1x40:1"]) > 0 for v in data["ms"].values())
    with pytest.raises(SystemExit, match="argument --env: expected NAME:VAR=VALUE"):
        tool.main(argv + ["--env", "other:X=1"])


def test_ab_kernel_time_rejects_bad_arguments(tmp_path, capsys):
    import pytest

    tool = _tool("ab_kernel_time")
    with pytest.raises(SystemExit, match=r"argument --config: expected BxT:H\[/HV\] or .*, got '8192:x'"):
        tool.main(["--config", "8192:x"])
    with pytest.raises(SystemExit, match=r"argument --config: expected .*\(HV a multiple of H\), got '1x64:3/4'"):
        tool.main(["--config", "1x64:3/4"])
    with pytest.raises(SystemExit, match=r"grouped value heads \(H/HV\) take the delta-rule families .*--family gla"):
        tool.main(["--config", "1x64:2/4", "--family", "gla"])
    with pytest.raises(SystemExit, match=r"argument --lib: expected NAME=PATH of an existing library, got 'a'"):
        tool.main(["--lib", "a", "--lib", "b=c"])
    lib = tmp_path / "libcula.so"
    lib.write_bytes(b"")
    with pytest.raises(SystemExit, match=r"expected two or more libraries with distinct names, got 1"):
        tool.main(["--lib", f"a={lib}"])
    with pytest.raises(SystemExit, match=r"argument --rounds: expected a positive count, got 0"):
        tool.main(["--lib", f"a={lib}", "--lib", f"b={lib}", "--rounds", "0"])
    with pytest.raises(SystemExit, match=r"argument --split-calls: expected a positive count, got 0"):
        tool.main(["--lib", f"a={lib}", "--lib", f"b={lib}", "--split", "--split-calls", "0"])


FAKE_FLA_TESTS = '''
import pytest
import torch

from fla.ops.gla import fused_recurrent_gla
from fla.ops.kda import chunk_kda
from fla.ops.kda.naive import naive_recurrent_kda


def _inputs():
    torch.manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 40, 2, 16), dim=-1) for _ in range(2))
    return q, k, torch.randn(1, 40, 2, 8), -torch.rand(1, 40, 2, 16), torch.rand(1, 40, 2)


def test_chunk_matches_naive():
    q, k, v, g, beta = _inputs()
    assert chunk_kda.__module__ == "cula.kda"
    o = chunk_kda(q, k, v, g, beta)[0]
    assert (o - naive_recurrent_kda(q, k, v, g, beta)[0]).abs().max() < 1e-4


def test_fla_only():
    q, k, v, g, beta = _inputs()
    assert naive_recurrent_kda(q, k, v, g, beta)[0].shape == v.shape


def test_refused():
    q, k, v, g, beta = _inputs()
    fused_recurrent_gla(q, k, v, g, gv=torch.zeros_like(v))


def test_wrong_value():
    q, k, v, g, beta = _inputs()
    assert chunk_kda(q, k, v, g, beta)[0].sum() == 12345.0


@pytest.mark.skip(reason="skipped on purpose")
def test_skipped():
    pass
'''


def test_fla_suite_runner_swaps_cula_in_and_sorts_outcomes(tmp_path):
    """tools/fla_suite/run.py on a small stand-in for one of FLA's test files: FLA's names are cula's
    functions when the test module imports them, a test that calls none of cula's is counted apart,
    and failures are sorted into their reason classes (written as JSON and a table)."""
    pytest.importorskip("torch", reason="torch is not installed")
    pytest.importorskip("fla", reason="fla-core is not installed")
    ops_dir = tmp_path / "tests" / "ops"
    ops_dir.mkdir(parents=True)
    (ops_dir / "test_kda.py").write_text(FAKE_FLA_TESTS)
    out = tmp_path / "results" / "fla_suite.json"
    tool = _tool("fla_suite/run")
    assert tool.main(["--fla-tests", str(tmp_path), "--files", "test_kda.py", "--out", str(out)]) == 1
    got = json.loads(out.read_text())
    summary = got["files"]["test_kda.py"]
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (1, 2, 1), summary
    assert summary["fla_only"] == {"passed": 1}
    assert summary["failures"] == {"refused_by_cula": 1, "tolerance_or_value": 1}
    assert "fla.ops.kda.chunk" in got["swapped"]["kda.chunk_kda"]
    assert "fla.ops.gla.fused_recurrent" in got["swapped"]["gla.fused_recurrent_gla"]
    assert got["environment"]["fla_commit"] == tool.FLA_COMMIT
    assert "| test_kda.py | 1 | 2 | 1 | passed 1 |" in (tmp_path / "results" / "fla_suite.md").read_text()
    assert got["fla_only_tests"] == ["test_kda.py::test_fla_only"]
    again = tmp_path / "again.json"  # the FLA-only test left out, by its id without the folders
    tool.main(["--fla-tests", str(tmp_path), "--files", "test_kda.py", "--skip-fla-only", str(out), "--out", str(again),
               "--cula-commit", "abc1234"])
    got = json.loads(again.read_text())
    summary = got["files"]["test_kda.py"]
    assert (summary["passed"], summary["failed"], summary["fla_only"]) == (1, 2, {}), summary
    assert got["environment"]["cula_commit"] == "abc1234 (as given)"  # a copied tree's commit, stamped as given
    with pytest.raises(SystemExit, match="argument --fla-tests"):
        tool.main(["--fla-tests", str(tmp_path), "--files", "test_gdn.py"])
    # runs side by side, one file each, merged into one summary
    (ops_dir / "test_gla.py").write_text(FAKE_FLA_TESTS)
    gla = tmp_path / "gla.json"
    tool.main(["--fla-tests", str(tmp_path), "--files", "test_gla.py", "--skip-fla-only", str(out), "--out", str(gla),
               "--cula-commit", "abc1234"])
    merged = tmp_path / "merged.json"
    assert tool.main(["--merge", str(again), str(gla), "--out", str(merged)]) == 1
    got = json.loads(merged.read_text())
    assert got["files_run"] == ["test_kda.py", "test_gla.py"] and set(got["files"]) == {"test_kda.py", "test_gla.py"}
    assert [f["test"].rsplit("/", 1)[-1].split("::")[0] for f in got["failures"]] == ["test_kda.py"] * 2 + ["test_gla.py"] * 2
    assert "| test_gla.py | 1 | 2 | 1 |" in (tmp_path / "merged.md").read_text()
    assert "one process per file, merged" in (tmp_path / "merged.md").read_text()
    with pytest.raises(SystemExit, match="argument --merge: .*cula_commit"):  # runs of different builds
        tool.main(["--merge", str(out), str(gla), "--out", str(tmp_path / "bad.json")])


def test_coverage_decode_rows_run_through_the_drop_ins():
    """`cula bench coverage`'s decode rows: each row's arguments, built as the benchmark builds them
    (a few sequences, on the host), are taken by cula's drop-in, which returns o [N, T, HV, V] and
    the final states [N, HV, K, V], finite. (The GPU run times them against FLA's same call.)"""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import cula.gated_delta_rule
    import cula.kda
    from cula.bench.coverage import DECODE_CONFIGS, _inputs, _kda_gate

    for name, family, _, T, H, HV, K, V, dtype, gate in DECODE_CONFIGS:
        N, T = 3, min(T, 20)
        x = _inputs(torch, family, N, T, H, HV, K, V, dtype, "cpu")
        kw = dict(scale=K ** -0.5, output_final_state=True,
                  initial_state=torch.randn(N, HV, K, V) * 0.1)
        kw.update(_kda_gate(torch, gate, HV, K, "cpu") if family == "kda" else dict(use_qk_l2norm_in_kernel=True))
        if family == "kda":
            kw.pop("safe_gate", None)
            o, s = cula.kda.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        else:
            o, s = cula.gated_delta_rule.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"],
                                                                          beta=x["beta"], **kw)
        assert tuple(o.shape) == (N, T, HV, V) and tuple(s.shape) == (N, HV, K, V), name
        assert torch.isfinite(o.float()).all() and torch.isfinite(s).all(), name


def test_train_rows_run_through_the_drop_ins():
    """`cula bench train`'s rows of every family: the inputs and the call built as the benchmark builds
    them (a few tokens, on the host), at every row's head sizes, give o and a gradient for every
    differentiable input."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula.bench import train

    for family, K, V in sorted({(c.family, c.K, c.V) for c in train.CONFIGS}):
        kw = dict(scale=K ** -0.5, cu_seqlens=None)
        if family == "kda":
            from cula.bench.coverage import _kda_gate

            kw.update(_kda_gate(torch, "softplus", 2, K, "cpu"))
        x = train._leaves(torch, family, 1, 70, 2, 2, "cpu", kw, K, V)
        o = train._call(family, train._train_fns(family)[0], x, kw)
        grads = torch.autograd.grad(o, train._wrt(x, kw), torch.randn_like(o))
        assert tuple(o.shape) == (1, 70, 2, V), (family, K, V)
        assert all(g is not None and torch.isfinite(g).all() for g in grads), (family, K, V)


def test_backward_error_model_puts_bf16_gdn_token_gradients_within_fla_tolerances(rng, monkeypatch):
    """tools/analysis/bwd_rounding.py, the float64 model the chunk backward's product precision rests
    on, for GDN (one decay per token): float32 operands reproduce the float64 chunk algebra, and bf16
    operands everywhere (products, factor block and states, FLA's layout) keep dq, dk and dv inside
    FLA's tolerances (at most 0.47x over 400 draws of 256 tokens). dbeta and dg, sums over the value
    or key channels whose terms cancel, pass their tolerances with bf16 in about 1% of draws (up to
    2.4x): DESIGN.md."""
    pytest.importorskip("numpy")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools", "analysis"))
    model = _tool("analysis/bwd_rounding")
    q, k, v, beta, a, dO, dST = model.problem(256, seed=int(rng.integers(2 ** 31)), scalar=True)
    starts = model.states(q, k, v, beta, a)
    ref = model.with_dg(model.backward(q, k, v, beta, a, dO, dST, starts))
    runs = {name: model.with_dg(model.backward(q, k, v, beta, a, dO, dST, starts, op=r, fac=r, state=r))
            for name, r in (("float32", model.f32), ("bf16", model.bf16))}
    for n, tol in model.TOL_GDN.items():
        err = {name: model.error(g, ref, n) for name, g in runs.items()}
        assert err["float32"] < 1e-3 * tol, (n, err)
        assert err["bf16"] > 0, (n, err)
        if n in ("dq", "dk", "dv"):
            assert err["bf16"] < tol, (n, err)


def test_bf16x2_rounding_is_a_pair_of_bf16_values_near_float32():
    """The precision models' hi / lo bf16 operand: hi and lo each a bf16 value, their sum within
    2^-16 of the float32 input (relative), far closer than one bf16 or one TF32 rounding."""
    import numpy as np

    r = _tool("analysis/rounding")
    x = np.random.default_rng(7).standard_normal(4096) * np.exp(np.random.default_rng(8).uniform(-20, 20, 4096))
    hi = r.bf16(r.f32(x))
    lo = r.bf16(r.f32(x) - hi)
    got = r.bf16x2(x)
    assert np.array_equal(got, hi + lo)
    assert np.array_equal(r.bf16(hi), hi) and np.array_equal(r.bf16(lo), lo)
    rel = np.abs(got - r.f32(x)) / np.abs(r.f32(x))
    assert rel.max() < 2.0 ** -16
    tf32_rel = np.abs(r.tf32(x) - r.f32(x)) / np.abs(r.f32(x))
    assert rel.max() < 0.1 * tf32_rel.max()


def test_train_bench_compares_every_gradient_with_fla_by_name():
    """`cula bench train`'s check column: each differentiable input's gradient against FLA's by name
    (relative Frobenius difference), the gate parameters after the tensors."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cula.bench import train

    x = {n: torch.randn(3, 4) for n in ("q", "k", "v", "g", "beta")}
    kw = dict(A_log=torch.randn(2), dt_bias=torch.randn(2, 4), scale=0.5)
    names = train._wrt_names(x, kw)
    assert names == ["q", "k", "v", "g", "beta", "A_log", "dt_bias"]
    ref = train._wrt(x, kw)
    got = [t.clone() for t in ref]
    got[2] = got[2] * 1.25
    diffs = train._grad_rel_diffs(names, got, ref)
    assert diffs["v"] == pytest.approx(0.25, rel=1e-5)
    assert all(diffs[n] == 0 for n in names if n != "v")


@pytest.mark.parametrize("family", ["simple_gla", "gla", "lightning"])
def test_lean_backward_model_is_the_chunk_algebra(monkeypatch, family):
    """The error model's lean form without the delta rule (bwd_rounding.py --family=...), unrounded,
    equals chunked_bwd_numpy.py's chunk algebra (itself checked against the reference backward), so
    its rounding table measures that algebra."""
    import numpy as np
    from chunked_bwd_numpy import backward

    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools", "analysis"))
    model = _tool("analysis/bwd_rounding")
    T = 150
    q, k, v, a, dO, dST = model.lean_problem(T, 7, family)
    got = model.lean_backward(q, k, v, a, dO, dST, model.states(q, k, v, None, a, delta=False))
    ref, _ = backward(q, k, v, np.ones(T), a, np.zeros((model.K, model.V)), dO, dST, C=model.C, delta=False)
    for n in ("dq", "dk", "dv", "da"):
        assert np.abs(got[n] - ref[n]).max() <= 1e-12 * np.abs(ref[n]).max(), n
