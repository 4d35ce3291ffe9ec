"""Write tests/slow.txt: the tests whose CPU seconds (recorded by tests/conftest.py under
MEMFIT_TEST_CPU=FILE) exceed a threshold (2 s; a test already listed stays while over 1 s), each with its seconds (tests/conftest.py hands the
files out to the xdist workers by them, the most first). `make slow-list` runs the suite and then this.

    python tools/slow_list.py CPU.tsv [--over 2.0] [--keep-over 1.0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "slow.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "tsv", type=Path, help="the file MEMFIT_TEST_CPU wrote: cpu seconds, wall seconds, node id (worker, start) per line"
    )
    ap.add_argument("--over", type=float, default=2.0, help="CPU seconds above which a test is slow (default 2)")
    ap.add_argument(
        "--keep-over", type=float, default=1.0, help="CPU seconds above which a test already listed stays slow (default 1)"
    )
    args = ap.parse_args()
    cpu: dict[str, float] = {}
    for line in args.tsv.read_text().splitlines():
        seconds, _, node = line.split("\t")[:3]  # then the worker and the start, where written
        cpu[node] = max(cpu.get(node, 0.0), float(seconds))
    # A listed test stays until it measures under --keep-over: one run's seconds of a test move by a
    # second or more with the load and with the order (the first test of a file on a worker pays its
    # lazy imports, the fake-CUDA child's start), and a test of 1-2 s flipping into the fast tier on
    # one run's noise made `make test-fast` tens of seconds slower (2026-11-28: 52 such tests, 74 CPU s).
    listed = {line.partition("\t")[0] for line in OUT.read_text().splitlines()} if OUT.exists() else set()
    slow = sorted(node for node, s in cpu.items() if s > args.over or (node in listed and s > args.keep_over))
    OUT.write_text("".join(f"{node}\t{cpu[node]:.1f}\n" for node in slow))
    total = sum(cpu.values())
    print(
        f"{len(slow)} of {len(cpu)} tests over {args.over} CPU s, or listed and over {args.keep_over} "
        f"({sum(cpu[n] for n in slow):.0f} of {total:.0f} s): {OUT}"
    )


if __name__ == "__main__":
    main()
