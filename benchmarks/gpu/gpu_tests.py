"""Run every ``gpu``-marked test file in a process of its own, print each file's result as it comes,
and end with one summary line, whatever happened to the files before.

    python -m benchmarks.gpu.gpu_tests --out runs/gpu          # every tests/**/*.py with a gpu mark
    python -m benchmarks.gpu.gpu_tests --file tests/test_offload.py --timeout 120

``benchmarks/gpu/run.sh`` calls this first. A test that ends its process from C (bitsandbytes'
``exit`` on a paged-memory error, a segfault, an abort) costs its own file only: that file's line
says how it ended (the signal, or the exit code with no pytest summary), and the files after it
still run. Each file's whole output goes to ``<out>/gpu_tests/<file>.log``; the summary line is
also written to ``<out>/gpu_tests.txt`` with every file's line.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 300
_GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bgpu\b)", re.MULTILINE)
# pytest's last line: "==== 3 passed, 1 failed, 2 skipped in 12.3s ====" (or without the bars under -q)
_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
_SUMMARY = re.compile(r"\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b.* in [0-9.]+s")


def gpu_test_files(root: Path = ROOT / "tests") -> list[Path]:
    """Every test file under ``root`` that marks a test ``gpu``, sorted."""
    return sorted(p for p in root.rglob("test_*.py") if _GPU_MARK.search(p.read_text(errors="replace")))


@dataclass
class FileResult:
    file: str
    outcome: str  # "passed", "failed", "crashed", "timed out", "no gpu tests"
    counts: dict[str, int]
    detail: str
    seconds: float

    def line(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in self.counts.items()) or "no pytest summary"
        detail = f" -- {self.detail}" if self.detail else ""
        return f"{self.file}: {self.outcome} ({counts}) in {self.seconds:.0f} s{detail}"


def _ended_by(returncode: int) -> str:
    if returncode < 0:  # killed by a signal (subprocess reports -signum)
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def parse(file: str, returncode: int | None, output: str, seconds: float) -> FileResult:
    """What one file's pytest process came to. ``returncode`` None: it was stopped at the time limit."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if _SUMMARY.search(line)), None)
    counts: dict[str, int] = {}
    if summary is not None:
        for number, kind in _COUNTS.findall(summary):
            kind = "errors" if kind.startswith("error") else kind
            counts[kind] = counts.get(kind, 0) + int(number)
    last = lines[-1][:200] if lines else ""
    if returncode is None:
        return FileResult(file, "timed out", counts, f"stopped; last line: {last}", seconds)
    if summary is None:  # the process ended before pytest could say anything: a crash from C
        return FileResult(file, "crashed", counts, f"{_ended_by(returncode)}; last line: {last}", seconds)
    if returncode == 5 or (not counts.get("passed") and not counts.get("failed") and not counts.get("errors")
                           and not counts.get("skipped")):
        return FileResult(file, "no gpu tests", counts, "", seconds)
    if returncode == 0:
        return FileResult(file, "passed", counts, "", seconds)
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return FileResult(file, "failed", counts, "; ".join(failed)[:600], seconds)


def run_file(path: Path, *, timeout_s: float, log: Path, python: str = sys.executable) -> FileResult:
    """``pytest -m gpu`` on one file in a process of its own (its output to ``log``). Output is not
    captured (``-s``): what a test prints (its measured figures) and what a library writes from C
    before ending the process are in the log, and the crash's line names it."""
    shown = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    cmd = [python, "-m", "pytest", "-m", "gpu", "-q", "-s", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=", str(path)]
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            done = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
            returncode: int | None = done.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    return parse(shown, returncode, log.read_text(errors="replace"), time.perf_counter() - start)


def summary(results: list[FileResult], planned: int) -> str:
    totals: dict[str, int] = {}
    for result in results:
        for kind, number in result.counts.items():
            totals[kind] = totals.get(kind, 0) + number
    bad = [r.file for r in results if r.outcome in ("failed", "crashed", "timed out")]
    counts = ", ".join(f"{n} {k}" for k, n in totals.items()) or "no tests"
    ran = f"{len(results)} of {planned} files" if len(results) < planned else f"{planned} files"
    verdict = "all passed" if not bad and len(results) == planned else f"not passed: {', '.join(bad) or 'interrupted'}"
    return f"gpu tests: {ran}: {counts}; {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_tests", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu", help="where gpu_tests.txt and the logs go")
    parser.add_argument("--file", action="append", type=Path, default=[], help="this test file only (repeatable)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per file before it is stopped")
    args = parser.parse_args(argv)
    files = [p.resolve() for p in args.file] or gpu_test_files()
    results: list[FileResult] = []
    lines: list[str] = []
    try:
        for index, path in enumerate(files, 1):
            log = args.out / "gpu_tests" / (path.stem + ".log")
            result = run_file(path, timeout_s=args.timeout, log=log)
            results.append(result)
            lines.append(result.line())
            print(f"[{index}/{len(files)}] {result.line()}", flush=True)
    finally:  # an interrupted driver still says what it saw
        final = summary(results, len(files))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_tests.txt").write_text("\n".join([*lines, final]) + "\n")
        print(final, flush=True)
    return 0 if all(r.outcome in ("passed", "no gpu tests") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
