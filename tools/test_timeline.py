"""Where a test run's time went, from the file MEMFIT_TEST_CPU=FILE wrote (tests/conftest.py):
each xdist worker's files in the order it ran them (start and end, seconds from the run's first
test; CPU seconds), how long each worker sat idle after its last test while the other still ran,
the files and the tests by CPU seconds. What to cut or move to shorten `make test` (docs/architecture.md, "Test tiers").

    python tools/test_timeline.py CPU.tsv [--top 20]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass
class _File:
    worker: str
    name: str
    start: float
    end: float = 0.0
    cpu: float = 0.0
    tests: int = 0


def read(tsv: Path) -> tuple[list[tuple[float, float, str, str, float]], bool]:
    """(cpu, wall, node, worker, start) per test; and whether the lines had the worker and start
    (written before they were, a file gives the CPU tables alone)."""
    rows = []
    timed = True
    for line in tsv.read_text().splitlines():
        cols = line.split("\t")
        if len(cols) < 5:
            timed = False
            cols += ["-", "0"]
        rows.append((float(cols[0]), float(cols[1]), cols[2], cols[3], float(cols[4])))
    return rows, timed


def files_by_worker(rows: list[tuple[float, float, str, str, float]]) -> dict[str, _File]:
    """Each (worker, file) run: when it started and ended, its CPU seconds and its tests."""
    out: dict[str, _File] = {}
    for cpu, wall, node, worker, start in sorted(rows, key=lambda r: r[4]):
        key = f"{worker} {node.split('::')[0]}"
        f = out.setdefault(key, _File(worker, node.split("::")[0], start))
        f.end = max(f.end, start + wall)
        f.cpu += cpu
        f.tests += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tsv", type=Path, help="the file MEMFIT_TEST_CPU wrote")
    ap.add_argument("--top", type=int, default=20, help="how many files and tests to list by CPU seconds (default 20)")
    args = ap.parse_args()
    rows, timed = read(args.tsv)
    if not rows:
        raise SystemExit(f"{args.tsv}: no tests in it; write it with MEMFIT_TEST_CPU={args.tsv} pytest ...")
    runs = files_by_worker(rows)
    if timed:
        t0 = min(r[4] for r in rows)
        last = max(f.end for f in runs.values())
        for worker in sorted({f.worker for f in runs.values()}):
            mine = sorted((f for f in runs.values() if f.worker == worker), key=lambda f: f.start)
            print(
                f"worker {worker}: {len(mine)} files, {sum(f.cpu for f in mine):.0f} CPU s, "
                f"last test ends at {mine[-1].end - t0:.0f} s, idle {last - mine[-1].end:.0f} s at the end"
            )
            for f in mine:
                print(f"  {f.start - t0:7.0f} {f.end - t0:7.0f}  {f.cpu:7.1f} CPU s  {f.tests:4d} tests  {f.name}")
    per_file: dict[str, float] = {}
    for f in runs.values():
        per_file[f.name] = per_file.get(f.name, 0.0) + f.cpu
    total = sum(r[0] for r in rows)
    print(f"\n{len(rows)} tests, {total:.0f} CPU s; the files by CPU seconds:")
    for name, cpu in sorted(per_file.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {cpu:7.1f}  {name}")
    print("the tests by CPU seconds (CPU, wall):")
    for cpu, wall, node, _, _ in sorted(rows, key=lambda r: -r[0])[: args.top]:
        print(f"  {cpu:7.1f} {wall:7.1f}  {node}")


if __name__ == "__main__":
    main()
