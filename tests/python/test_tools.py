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
