"""Replay real GPU memory traces through memfit's model of the CUDA caching allocator.

    python benchmarks/allocator_replay.py DIR [--sources DIR/sources.tsv] [--out table.md]

``DIR`` holds ``torch.cuda.memory._dump_snapshot`` pickles recorded on real GPUs (fetched
separately, never committed: see docs/benchmarks/gpu-traces.md for where they come from). For each trace the
recorded requests are replayed through :class:`memfit.cuda.allocator.CachingAllocator` from the
state the trace began with, and compared with what the GPU's allocator did: the share of
allocations placed at the very address it chose, whether every ``segment_alloc`` (``cudaMalloc``)
happened at the same request with the same size, reserved bytes at the end, and the peaks
predicted vs recorded (the recorded ones re-lived from the trace's own addresses). No torch, no GPU.

``--sources`` is a tab-separated file: pickle name, repository, commit, path in the repository
(``benchmarks/allocator_traces.tsv`` lists the public traces docs/benchmarks/gpu-traces.md reports; its
section says how to fetch them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memfit.cuda.allocator import CachingAllocator
from memfit.cuda.snapshot import SnapshotError, load_snapshot, relive, replay_trace
from memfit.units import format_bytes


def _pct(a: int, b: int) -> str:
    return f"{100.0 * (a - b) / b:+.2f}%" if b else "n/a"


class _SplitAlways(CachingAllocator):
    def _should_split(self, block, size):
        return block.size - size >= 512


class _LowestAddress(CachingAllocator):
    def _get_free_block(self, pool, stream, size):
        fits = [b for k, b in pool.blocks.items() if k[0] == stream and k[1] >= size]
        if not fits:
            return None
        block = min(fits, key=lambda b: b.ptr)
        pool.remove(block)
        return block


_ABLATIONS = {"split-always": _SplitAlways, "lowest-address": _LowestAddress}


def _one(snap: dict, device: int, model: type[CachingAllocator]):
    """One device's trace: the model's replay and the re-lived recording, or why not."""
    rec = relive(snap, device)
    if not rec.has_trace:
        raise SnapshotError("no trace recorded (the snapshot was taken without _record_memory_history)")
    if rec.stats.reserved_bytes != rec.dumped_reserved_bytes:
        raise SnapshotError(
            f"re-lived reserved at the end {rec.stats.reserved_bytes} != dumped {rec.dumped_reserved_bytes}: trace incomplete"
        )
    if rec.stats.allocated_bytes != rec.dumped_allocated_bytes:
        raise SnapshotError(
            f"re-lived allocated at the end {rec.stats.allocated_bytes} != dumped {rec.dumped_allocated_bytes}: trace incomplete"
        )
    if rec.allocs == 0:
        raise SnapshotError("the trace records no allocation")
    return replay_trace(snap, device=device, model=model), rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--sources", help="TSV: file, repository, commit, path (default DIR/sources.tsv if present)")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument(
        "--ablation",
        choices=sorted(_ABLATIONS),
        help="replay with one rule broken (a control: the scores must drop): split every remainder >= 512 B, "
        "or take the lowest-addressed free block that fits instead of the best fit",
    )
    ns = parser.parse_args(argv)
    model = _ABLATIONS[ns.ablation] if ns.ablation else CachingAllocator
    root = Path(ns.dir)
    sources: dict[str, tuple[str, str, str]] = {}
    src_file = Path(ns.sources) if ns.sources else root / "sources.tsv"
    if src_file.exists():
        for line in src_file.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 4:  # a fifth column notes why a candidate was kept or not
                sources[parts[0]] = (parts[1], parts[2], parts[3])
    rows = [
        "| trace (repository @ commit: path) | allocs | same address | segment_allocs matched | extra | "
        "reserved at end (model / GPU) | peak allocated (model / GPU) | peak reserved (model / GPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    skipped = []
    totals = [0, 0, 0, 0, 0]
    for path in sorted(root.glob("*.pickle")) + sorted(root.glob("*.pkl")):
        repo, commit, inner = sources.get(path.name, (path.name, "", ""))
        name = f"{repo} @ {commit[:8]}: {inner}" if commit else path.name
        try:
            snap = load_snapshot(path)
        except SnapshotError as exc:
            skipped.append(f"- {name}: {exc}")
            continue
        devices = [d for d, t in enumerate(snap.get("device_traces") or []) if t] or [0]
        for device in devices:
            label = f"{name} (device {device})" if len(devices) > 1 else name
            try:
                out, rec = _one(snap, device, model)
            except SnapshotError as exc:
                skipped.append(f"- {label}: {exc}")
                continue
            s, r = out.stats, rec.stats
            end_ok = "=" if s.reserved_bytes == r.reserved_bytes else "**≠**"
            rows.append(
                f"| {label} | {out.allocs:,} | {100.0 * out.same_address_fraction:.2f}% | "
                f"{out.segment_allocs_matched}/{out.segment_allocs} | {out.segment_allocs_extra} | "
                f"{format_bytes(s.reserved_bytes)} {end_ok} {format_bytes(r.reserved_bytes)} | "
                f"{format_bytes(s.allocated_peak_bytes)} / {format_bytes(r.allocated_peak_bytes)} ({_pct(s.allocated_peak_bytes, r.allocated_peak_bytes)}) | "
                f"{format_bytes(s.reserved_peak_bytes)} / {format_bytes(r.reserved_peak_bytes)} ({_pct(s.reserved_peak_bytes, r.reserved_peak_bytes)}) |"
            )
            totals[0] += out.allocs
            totals[1] += out.same_address
            totals[2] += out.segment_allocs_matched
            totals[3] += out.segment_allocs
            totals[4] += out.segment_allocs_extra
    if totals[0]:
        rows.append(
            f"| **all** | {totals[0]:,} | {100.0 * totals[1] / totals[0]:.2f}% | {totals[2]}/{totals[3]} | {totals[4]} | | | |"
        )
    text = "\n".join(rows) + ("\n\nNot replayed:\n" + "\n".join(skipped) if skipped else "") + "\n"
    print(text)
    if ns.out:
        Path(ns.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
