"""torch's FSDPMemTracker on the FSDP2 Llama step memfit measures, tensor by tensor beside memfit.

    python benchmarks/distributed_memtracker.py WORLD_SIZE [KEY=VALUE ...]   # zoo llama sizes, e.g. preset=8b
        foreach=True        AdamW's foreach (default False, as memfit's CPU step)
        masks=True          let transformers build the attention masks on fake tensors (memfit's
                            measure/_hf_fake.py stops it, as a real step never builds them)
        drop_output=True    `model(...).loss.backward()`: the model's output (the logits) freed
                            before backward; by default it is held through backward and the loss
                            through the optimizer step, as memfit's step (`output = model(...);
                            loss_fn(output).backward(); value = loss.detach()`) holds them
        real=True           the tracker on real tensors (tiny sizes only; still the fake group)
        compare=True        also profile the same rank with memfit and diff the two peaks

Rank 0 on the fake process group and fake tensors, as torchtitan's memory estimation does. Two
steps, each under its own tracker: the first (a warm-up, as memfit's) shows the tracker counting
DTensor's sharding propagation, which runs each new op once on global-shape fake tensors under the
same fake mode as the step (the tracker skips only ops under another fake mode); the second is
the step memfit records. For each: the tracker's peak snapshot and the storages alive at its peak.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from memfit import zoo
from memfit.compat import hf_fake as _hf_fake
from memfit.measure.ledger import Category, Ledger
from memfit.zoo import parse_sizes

# the tracker's categories under memfit's names (its ACT and TEMP are "allocated in forward" and
# "allocated in backward"; memfit's are "saved for backward" and "not saved": compared together)
CATEGORY = {
    "SHARDED_PARAM": "parameters",
    "BUFFER": "buffers",
    "SHARDED_GRAD": "gradients",
    "OPT": "optimizer_state",
    "INP": "inputs",
    "ACT": "activations+temporaries",
    "TEMP": "activations+temporaries",
    "UNSHARDED_PARAM": "unsharded_parameters",
    "ALL_GATHER": "all_gather_buffers",
    "REDUCE_SCATTER": "reduce_scatter_buffers",
}


@dataclass
class TrackerPeak:
    total: int
    by_category: dict[str, int]  # the tracker's own categories
    live: list[tuple[str, int]]  # (the tracker's category, bytes) of each storage alive at the peak
    in_optimizer: bool
    in_backward: bool
    phase_peaks: dict[str, int]  # the highest total in forward, backward and the optimizer step


class _PeakTracker(FSDPMemTracker):
    """The tracker, remembering which storages were alive at each new peak."""

    at_peak: TrackerPeak | None = None

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.phase_peaks = {"forward": 0, "backward": 0, "optimizer": 0}

    def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
        now = sum(snap["Total"] for snap in self._curr_mem_snap.values())
        self.phase_peaks[phase] = max(self.phase_peaks[phase], now)
        if self._peak_mem != before:
            live = [(w.reftype.name, w.mem_consumed) for w, _ in list(self._WINFO.values()) if w.mem_consumed]
            total = sum(self._peak_mem.values())
            cats = collections.Counter()
            for name, n in live:
                cats[name] += n
            self.at_peak = TrackerPeak(total, dict(cats), live, self._in_opt, self._mod_tracker.is_bw, self.phase_peaks)


def tracker_steps(work, world: int, *, foreach: bool = False, masks: bool = False, drop_output: bool = False, real: bool = False):
    """The tracker's peak of the warm-up step and of the next one, rank 0 of ``world`` on the fake
    group (which this initialises and destroys); on fake tensors, or with ``real`` on the
    workload's own (a model small enough to build)."""
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = copy.deepcopy(work.model)
        mode = None if real else FakeTensorMode(allow_non_fake_inputs=True)
        with mode or contextlib.nullcontext():
            if mode is None:
                model = work.parallel.parallelize(model, mesh)
                kwargs = dict(work.inputs)
            else:
                model = work.parallel.parallelize(model.to("meta"), mesh)
                model.to_empty(device="cpu")
                kwargs = {k: mode.from_tensor(v) for k, v in work.inputs.items()}
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
            peaks = []
            for _ in range(2):
                tracker = _PeakTracker(model, opt)
                tracker.track_inputs(tuple(kwargs.values()))
                hf = contextlib.nullcontext() if masks or real else _hf_fake.unpacked_positions(kwargs)
                with tracker, hf:
                    _step(model, kwargs, opt, drop_output)
                peaks.append(tracker.at_peak)
        return peaks
    finally:
        dist.destroy_process_group()


def _step(model, kwargs, opt, drop_output: bool):  # type: ignore[no-untyped-def]
    if drop_output:
        model(**kwargs).loss.backward()
        value = None
    else:
        output = model(**kwargs)
        output.loss.backward()
        value = output.loss.detach()  # memfit's step returns the loss's value, read after the optimizer
        del output
    opt.step()
    opt.zero_grad()
    return value


def memfit_peak(work, world: int, *, masks: bool = False) -> tuple[int, list[tuple[str, int]], dict[str, int]]:
    """memfit's peak of rank 0 and, autograd's graph (host memory, no storage) left out, the
    (category, bytes) of the blocks alive at that peak and the peak of each phase."""
    from memfit.measure import distributed

    with contextlib.ExitStack() as stack:
        if masks:
            stack.enter_context(_no_hf_adapter())
        ledger = distributed.profile_rank(work, distributed.FakeGroup(world, 0)).ledger
    storages = Ledger([b for b in ledger.blocks if b.category != Category.GRAPH], ledger.ticks)
    live = [(b.category.value, b.nbytes) for b in storages.live_at(storages.peak_tick)]
    phases = {p.value: n for p, n in storages.phase_peaks().items() if p.value != "start"}
    return ledger.peak_bytes, live, phases


@contextlib.contextmanager
def _no_hf_adapter():
    original = _hf_fake.unpacked_positions
    _hf_fake.unpacked_positions = lambda kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        _hf_fake.unpacked_positions = original


def diff(tracker_live: list[tuple[str, int]], memfit_live: list[tuple[str, int]]) -> dict[str, tuple[int, int, list, list]]:
    """Per memfit category: the tracker's bytes, memfit's, and the storage sizes only one has."""
    mine: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    theirs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, n in tracker_live:
        theirs[CATEGORY.get(name, name)][n] += 1
    for cat, n in memfit_live:
        mine["activations+temporaries" if cat in ("activations", "temporaries") else cat][n] += 1
    out = {}
    for cat in sorted(set(mine) | set(theirs)):
        t, m = theirs[cat], mine[cat]
        out[cat] = (_total(t), _total(m), sorted((t - m).elements()), sorted((m - t).elements()))
    return out


def _total(c: collections.Counter) -> int:
    return sum(n * k for n, k in c.items())


def _where(p: TrackerPeak) -> str:
    return "optimizer step" if p.in_optimizer else "backward" if p.in_backward else "forward"


def main() -> int:
    world = int(sys.argv[1])
    sizes = parse_sizes(sys.argv[2:])
    opts = {k: sizes.pop(k, False) for k in ("foreach", "masks", "drop_output", "real")}
    compare = sizes.pop("compare", False)
    work = zoo.build("llama", **sizes)
    start = time.perf_counter()
    warm, step = tracker_steps(work, world, **opts)
    print(f"tracker, {time.perf_counter() - start:.1f} s")
    for label, p in (("warm-up step", warm), ("next step", step)):
        print(f"  {label}: peak {p.total:,} B in the {_where(p)}", {k: v for k, v in p.by_category.items() if v})
        print("    phase peaks:", {k: f"{v:,}" for k, v in p.phase_peaks.items()})
        sizes_at = collections.Counter(p.live)
        print("    storages:", sorted(sizes_at.items(), key=lambda kv: -kv[0][1] * kv[1])[:12])
    if compare:
        start = time.perf_counter()
        peak, live, phases = memfit_peak(work, world, masks=opts["masks"] and not opts["real"])
        print(f"memfit, {time.perf_counter() - start:.1f} s: peak {peak:,} B ({sum(n for _, n in live):,} B in storages)")
        print("    phase peaks (storages):", {k: f"{v:,}" for k, v in phases.items()})
        for cat, (t, m, only_t, only_m) in diff(step.live, live).items():
            note = f"  tracker only: {only_t[-6:]}" if only_t else ""
            note += f"  memfit only: {only_m[-6:]}" if only_m else ""
            print(f"  {cat:26} tracker {t:>16,}  memfit {m:>16,}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
