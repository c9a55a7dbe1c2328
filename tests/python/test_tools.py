"""The repository's tools that run without a GPU."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
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


def test_ab_kernel_time_takes_turns_between_builds(tmp_path):
    """Each round runs every library in a process of its own that loads that library (CPU backend,
    small shapes): a time per round for every config, and the JSON names what each process loaded."""
    import json
    import shutil

    import pytest

    cula_lib = pytest.importorskip("cula._lib")
    libs = {}
    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        libs[name] = str(tmp_path / name / "libcula.so")
        shutil.copy(str(cula_lib.LIB.path), libs[name])
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
    assert tool.parse_config("varlen:40,0,57:2") == (1, 97, 2, [40, 0, 57])
    assert tool.parse_config("2x8192:64") == (2, 8192, 64, None)


def test_ab_kernel_time_rejects_bad_arguments(tmp_path, capsys):
    import pytest

    tool = _tool("ab_kernel_time")
    with pytest.raises(SystemExit, match=r"argument --config: expected BxT:H or varlen:L1,L2,...:H, got '8192:x'"):
        tool.main(["--config", "8192:x"])
    with pytest.raises(SystemExit, match=r"argument --lib: expected NAME=PATH of an existing library, got 'a'"):
        tool.main(["--lib", "a", "--lib", "b=c"])
    lib = tmp_path / "libcula.so"
    lib.write_bytes(b"")
    with pytest.raises(SystemExit, match=r"expected two or more libraries with distinct names, got 1"):
        tool.main(["--lib", f"a={lib}"])
    with pytest.raises(SystemExit, match=r"argument --rounds: expected a positive count, got 0"):
        tool.main(["--lib", f"a={lib}", "--lib", f"b={lib}", "--rounds", "0"])
