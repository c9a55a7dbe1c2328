#!/usr/bin/env python3
"""FLA's own op tests with cula's drop-ins swapped in: the compatibility contract.

    python3 tools/fla_suite/run.py --fla-repo PATH_TO_FLA_CLONE --out bench/results/<gpu>/fla_suite.json
    python3 tools/fla_suite/run.py --fla-tests DIR ...   # DIR holds FLA's tests/ at the pinned commit
    python3 tools/fla_suite/run.py --merge A.json B.json ... --out bench/results/<gpu>/fla_suite.json

The last merges the summaries of runs made side by side (one process per test file, --files F
--out F.json each: the float64 references are host-bound, so the files finish in parallel in about
the time of the longest).

Nothing is fetched at run time. FLA's test files are an input that is not committed here: either a
clone of flash-linear-attention that holds the pinned commit (its tests/ are exported from that
commit with git archive), or a folder that already holds them, made once with

    git -C <fla clone> archive FLA_COMMIT tests | tar -x -C .fla-tests

(.fla-tests/ is git-ignored, so it can travel to a GPU machine with the build). The FLA package
under test is the installed fla-core (requirements-test.txt pins it).

The test files named in FILES (every family cula has drop-ins for) run under pytest with ``swap.py`` loaded, which replaces FLA's
functions by cula's before the test modules import them. Every test is then classed: a test that
called one of cula's functions is part of the contract; one that called none exercises only FLA's own
kernels (``fla.ops.simple_gla.parallel_simple_gla``, FLA's gate kernels, its backends' routing) and is
counted apart. Failures are sorted by reason (the reason classes are in ``_reason``). The summary
goes to --out as JSON and to stdout as a table; the exit status is 0 when no test of cula's failed
(a failure inside an FLA Triton kernel that a test compares with, on a machine without a GPU, is
counted as such and not held against cula)."""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# flash-linear-attention's commit whose tests/ are the contract (the newest that this project has
# read; the installed fla-core 0.6.0 wheel is built from a later one and its public signatures
# are the same)
FLA_COMMIT = "bc3b101dcb713ddc5bd8924b66754eb68b5ccf89"
FILES = ("test_kda.py", "test_gdn.py", "test_delta.py", "test_gla.py", "test_simple_gla.py", "test_lightning_attn.py",
         "test_retention.py")


def _export_tests(repo: str, dest: str) -> str:
    """FLA's tests/ at FLA_COMMIT from a local clone, into dest."""
    archive = subprocess.run(["git", "-C", repo, "archive", FLA_COMMIT, "tests"], capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"run.py: argument --fla-repo: {repo} does not hold FLA commit {FLA_COMMIT}: "
                 f"{archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def _reason(record: dict) -> str:
    """The class of one failure, from its error's first line."""
    error = record["error"] or ""
    if not record["cula"]:
        return "fla_only"
    if "active drivers" in error or "NVIDIA driver" in error:  # an FLA Triton kernel the test compares with
        return "fla_kernel_needs_gpu"
    if "NotImplementedError" in error and "backward" in error:
        return "missing_backward"
    if any(m in error for m in ("not supported by cula", "CulaError", "CulaUnsupportedError", "cula does not")):
        return "refused_by_cula"
    if error.startswith("AssertionError") or "assert" in error.split(":")[0].lower():
        return "tolerance_or_value"
    return "error"


def summarise(records: list[dict]) -> dict:
    """Per test file: counts of cula's tests by outcome, FLA-only tests, and each failure's class."""
    by_test: dict[str, dict] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for r in records:  # a test with a failing teardown has two records: keep the worse
        old = by_test.get(r["test"])
        if old is None or rank[r["outcome"]] > rank[old["outcome"]]:
            by_test[r["test"]] = dict(r, cula=sorted(set(r["cula"]) | set(old["cula"] if old else [])))
    files: dict[str, dict] = {}
    failures, fla_only = [], []
    for test, r in sorted(by_test.items()):
        f = files.setdefault(test.split("::")[0].rsplit("/", 1)[-1], dict(
            passed=0, failed=0, skipped=0, xfailed=0, fla_only=collections.Counter(), failures=collections.Counter(),
            skip_reasons=collections.Counter()))
        if r["outcome"] == "skipped":
            f["skip_reasons"][(r["error"] or "")[:120]] += 1
        if not r["cula"] and r["outcome"] != "skipped":
            f["fla_only"][r["outcome"]] += 1
            fla_only.append(test.rsplit("/", 1)[-1])
            continue
        outcome = "xfailed" if r["xfail"] else r["outcome"]
        f[outcome] += 1
        if outcome == "failed":
            reason = _reason(r)
            f["failures"][reason] += 1
            failures.append(dict(test=test, reason=reason, error=r["error"], cula=r["cula"]))
    for f in files.values():
        f["fla_only"], f["failures"], f["skip_reasons"] = dict(f["fla_only"]), dict(f["failures"]), dict(f["skip_reasons"])
    return dict(files=files, failures=failures, fla_only_tests=fla_only)


def _environment(cula_commit=None) -> dict:
    env = dict(fla_commit=FLA_COMMIT, python=platform.python_version(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    try:
        import torch

        env.update(torch=torch.__version__, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        import fla

        env["fla_core"] = fla.__version__
        import triton

        env["triton"] = triton.__version__
    except ImportError as e:  # reported, not fatal: pytest will say what is missing
        env["import_error"] = str(e)
    if cula_commit:  # given: a copied working tree whose git metadata is not the tree's
        env["cula_commit"] = f"{cula_commit} (as given)"
        return env
    cula_head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    env["cula_commit"] = cula_head.stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "python", "csrc", "include"],
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        env["cula_commit"] += " with uncommitted changes"
    return env


LEGEND = """Failure reasons: `missing_backward` (cula has no backward for the call), `refused_by_cula` (an
argument cula refuses), `tolerance_or_value` (an assertion on the values), `fla_kernel_needs_gpu` (the
test compares with an FLA Triton kernel, which needs a GPU), `error` (anything else). Tests that call
none of cula's functions exercise only FLA's own kernels and are counted apart."""


def table(summary: dict) -> str:
    rows = ["| file | passed | failed | skipped | FLA's own kernels only (not cula's) | failures by reason |",
            "|---|---|---|---|---|---|"]
    for name, f in summary["files"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(f["failures"].items())) or "-"
        own = ", ".join(f"{k} {v}" for k, v in sorted(f["fla_only"].items())) or "-"
        rows.append(f"| {name} | {f['passed']} | {f['failed']} | {f['skipped']} | {own} | {reasons} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--merge", nargs="+", metavar="JSON", help="summaries of runs to merge into --out (no run)")
    src.add_argument("--fla-repo", help="a clone of flash-linear-attention holding FLA_COMMIT")
    src.add_argument("--fla-tests", help="a folder holding FLA's tests/ at FLA_COMMIT")
    ap.add_argument("--out", help="where the JSON summary goes (bench/results/<gpu>/fla_suite.json)")
    ap.add_argument("--files", nargs="+", default=list(FILES), help="FLA test files to run (default: %(default)s)")
    ap.add_argument("--skip-fla-only", metavar="JSON", help="a summary of an earlier run: leave out the tests it "
                    "found to call none of cula's functions (they test only FLA's own kernels)")
    ap.add_argument("--cula-commit", help="the cula commit the working tree holds, where the checkout's git metadata "
                    "is not the tree's (a working tree copied to a GPU machine)")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k chunk")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)

    environment = _environment(args.cula_commit)  # before the run: the code that runs
    with tempfile.TemporaryDirectory() as tmp:
        root = _export_tests(args.fla_repo, tmp) if args.fla_repo else os.path.abspath(args.fla_tests)
        paths = [os.path.join(root, "tests", "ops", f) for f in args.files]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            sys.exit(f"run.py: argument --fla-tests: {root} lacks {missing} (export tests/ of FLA commit {FLA_COMMIT})")
        log = os.path.join(tmp, "records.jsonl")
        env = dict(os.environ, CULA_FLA_SUITE_LOG=log,
                   PYTHONPATH=os.pathsep.join([HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        if args.skip_fla_only:
            skip = os.path.join(tmp, "skip.txt")
            with open(skip, "w") as f:
                f.write("\n".join(json.load(open(args.skip_fla_only))["fla_only_tests"]))
            env["CULA_FLA_SUITE_SKIP"] = skip
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "swap", "-o", "addopts=",
               *paths, *args.pytest_args]
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=root, env=env)
        lines = open(log).read().splitlines() if os.path.exists(log) else []
    records = [json.loads(line) for line in lines]
    swapped = next((r["swapped"] for r in records if "swapped" in r), {})
    summary = summarise([r for r in records if "test" in r])
    if not summary["files"]:
        sys.exit(f"run.py: pytest ran no test (exit status {proc.returncode}); see its output above")
    result = dict(environment=environment, files_run=args.files, pytest_args=args.pytest_args,
                  skipped_fla_only_from=args.skip_fla_only, swapped=swapped,
                  pytest_exit_status=proc.returncode, **summary)
    return _report(result, args.out)


def _report(result: dict, out) -> int:
    """The summary's table to stdout, and to out (JSON) and its .md beside it; the exit status."""
    print(table(result))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        with open(re.sub(r"\.json$", "", out) + ".md", "w") as f:
            e, pytest_args = result["environment"], result["pytest_args"]
            f.write(f"# FLA's op tests with cula swapped in ({e.get('device')})\n\nFLA commit {FLA_COMMIT}, "
                    f"fla-core {e.get('fla_core')}, torch {e.get('torch')}, cula {e.get('cula_commit')}, "
                    f"{e['date']}. Made by `tools/fla_suite/run.py`"
                    f"{' with pytest arguments `' + ' '.join(pytest_args) + '`' if pytest_args else ''}"
                    f"{' (one process per file, merged)' if result.get('merged_from') else ''}."
                    f"\n\n{table(result)}\n\n{LEGEND}\n")
    return 0 if not [f for f in result["failures"] if f["reason"] != "fla_kernel_needs_gpu"] else 1


def merge(paths: list[str], out) -> int:
    """One summary of several runs' summaries (e.g. one process per test file, run side by side): their
    files, failures and FLA-only tests together; the environment of the first, which every run must
    share (the same FLA commit, cula commit, device and pytest arguments)."""
    runs = [json.load(open(p)) for p in paths]
    first = runs[0]
    for p, r in zip(paths, runs):
        for key in ("cula_commit", "fla_commit", "device", "torch"):
            if r["environment"].get(key) != first["environment"].get(key):
                sys.exit(f"run.py: argument --merge: {p} ran with {key} {r['environment'].get(key)!r}, "
                         f"{paths[0]} with {first['environment'].get(key)!r}")
        if r["pytest_args"] != first["pytest_args"]:
            sys.exit(f"run.py: argument --merge: {p} ran with pytest arguments {r['pytest_args']}, "
                     f"{paths[0]} with {first['pytest_args']}")
    result = dict(first, files_run=[f for r in runs for f in r["files_run"]],
                  pytest_exit_status=max(r["pytest_exit_status"] for r in runs),
                  files={n: f for r in runs for n, f in r["files"].items()},
                  failures=[f for r in runs for f in r["failures"]],
                  fla_only_tests=[t for r in runs for t in r["fla_only_tests"]],
                  merged_from=[os.path.basename(p) for p in paths])
    return _report(result, out)


if __name__ == "__main__":
    sys.exit(main())
