"""torch's private FSDPMemTracker beside memfit on the same fake FSDP2 step (docs/benchmarks/distributed.md,
"Beside torch's FSDPMemTracker"), through benchmarks/distributed_memtracker.py's functions.

Pins the reconciliation: on the step memfit records the tracker's storages equal memfit's, and the
tracker's warm-up optimizer step counts DTensor's sharding-propagation tensors at their global
shape. If torch changes the tracker, these fail and that section needs measuring again."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import needs

from memfit import zoo

# private: may move or go. Looked up, not imported: collecting this file imports nothing of it.
pytestmark = needs("torch.distributed._tools.fsdp2_mem_tracker", "transformers")

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "distributed_memtracker.py"
WORLD = 4
SIZES = dict(num_hidden_layers=2, seq_len=64, batch_size=2)


@pytest.fixture(scope="module")
def runs():
    spec = importlib.util.spec_from_file_location("distributed_memtracker", _BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclass looks its module up there
    spec.loader.exec_module(bench)
    work = zoo.build("llama", **SIZES)
    warm, step = bench.tracker_steps(work, WORLD)
    peak, live, phases = bench.memfit_peak(work, WORLD)
    return bench, work, warm, step, peak, live, phases


def test_tracker_agrees_with_memfit_on_the_recorded_step(runs):
    bench, _, _, step, _, live, phases = runs
    # the same loop (output held through backward, loss value through the optimizer step):
    # every phase's peak and every category at the peak equal to the byte, autograd's graph
    # (host memory memfit estimates on CPU, no storage) aside
    assert step.phase_peaks == phases
    for cat, (tracker, memfit, only_tracker, only_memfit) in bench.diff(step.live, live).items():
        assert (tracker, only_tracker) == (memfit, only_memfit), cat


def test_tracker_counts_global_shape_propagation_tensors_in_the_warm_up_step(runs):
    _, work, warm, step, _, _, phases = runs
    cfg = work.model.config
    global_head = cfg.vocab_size * cfg.hidden_size * 4  # fp32 embedding or head, unsharded
    assert warm.in_optimizer and warm.total > step.total
    phantom = [n for name, n in warm.live if name == "OPT" and n == global_head]
    # a rank holds a 1/WORLD shard of it (and its moments): these are DTensor's sharding
    # propagation running the op once on global-shape fake tensors, under the step's fake mode
    assert phantom, "torch's FSDPMemTracker no longer counts DTensor's propagation: update docs/benchmarks/distributed.md"
    assert warm.total - sum(phantom) <= phases["optimizer"]
