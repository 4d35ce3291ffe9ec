"""StepOptions.drops_output: a loop that keeps only the loss (``loss = model(**batch).loss``,
transformers' Trainer and TRL's trainers) drops the model's output before backward, where
memfit's usual step (``out = model(x); out.loss.backward()``) keeps it through backward. Real
and fake tensors see the same blocks, and values are untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit import Phase, StepOptions
from memfit.errors import WorkloadError
from memfit.measure.step import train_step

WIDTH = 2048
BATCH = 256
OUT = BATCH * WIDTH * 4  # the output's bytes (float32), 2 MiB


def _setup() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, WIDTH), torch.randn(BATCH, 4)


def _doubled_sum(out: torch.Tensor) -> torch.Tensor:
    """A loss that saves nothing of the output (a scalar factor, a sum), so only the loop's
    name keeps it through backward."""
    return (out * 2).sum()


def _output(ledger: memfit.Ledger) -> memfit.Block:
    (block,) = [b for b in ledger.blocks if b.module == "" and b.phase is Phase.FORWARD and b.nbytes == OUT]
    return block


def _backward_start(ledger: memfit.Ledger) -> int:
    return next(i for i, t in enumerate(ledger.ticks) if t.phase is Phase.BACKWARD)


def test_the_output_dies_before_backward_and_backwards_peak_falls_by_its_bytes():
    model, x = _setup()
    kept = memfit.profile(model, x, loss_fn=_doubled_sum)
    dropped = memfit.profile(model, x, loss_fn=_doubled_sum, step=StepOptions(drops_output=True))
    # memfit's usual step: the output lives through backward, freed after it
    assert _output(kept.ledger).died > _backward_start(kept.ledger)
    # the Trainer's: freed once the loss is computed, in the forward phase
    out = _output(dropped.ledger)
    assert out.died is not None and out.died < _backward_start(dropped.ledger)
    assert dropped.ledger.ticks[out.died].phase is Phase.FORWARD
    # backward holds exactly the output less; the forward, where the loss still needs it, the same
    kept_peaks, dropped_peaks = kept.ledger.phase_peaks(), dropped.ledger.phase_peaks()
    assert kept_peaks[Phase.BACKWARD] - dropped_peaks[Phase.BACKWARD] == OUT
    assert kept_peaks[Phase.FORWARD] == dropped_peaks[Phase.FORWARD]


def test_fake_tensors_see_what_real_ones_do():
    model, x = _setup()
    step = StepOptions(drops_output=True, accumulate=2)
    real = memfit.profile(model, x, loss_fn=_doubled_sum, step=step)
    fake = memfit.profile(model, x, loss_fn=_doubled_sum, step=step, fake=True)
    assert (fake.start_bytes, fake.peak_bytes, fake.ledger.end_bytes) == (real.start_bytes, real.peak_bytes, real.ledger.end_bytes)
    assert fake.breakdown == real.breakdown


def test_the_option_changes_no_value():
    """Dropping the output only frees it sooner: losses, gradients and parameters over three
    steps are bitwise those of the loop that keeps it (dropout and batch norm included)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16))
    x = torch.randn(12, 8)
    runs = []
    for drops in (False, True):
        model = copy.deepcopy(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        grads: list[list[torch.Tensor]] = []

        def on_phase(phase: Phase, model: nn.Module = model, grads: list = grads) -> None:
            if phase is Phase.OPTIMIZER:
                grads.append([p.grad.clone() for p in model.parameters()])

        torch.manual_seed(1)
        losses = [
            train_step(model, (x,), {}, _doubled_sum, opt, on_phase, micro_batches=2, accumulate=2, drops_output=drops)
            for _ in range(3)
        ]
        runs.append((losses, grads, [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]))
    (l0, g0, p0, b0), (l1, g1, p1, b1) = runs
    assert l0 == l1
    for a, b in zip([t for step in g0 for t in step] + p0 + b0, [t for step in g1 for t in step] + p1 + b1):
        assert torch.equal(a, b)


def test_it_contradicts_holding_the_output():
    with pytest.raises(WorkloadError, match="drops_output and holds_output contradict"):
        StepOptions(drops_output=True, holds_output=True)


def test_options_json_names_it_only_when_set():
    assert "drops_output" not in StepOptions().to_dict()
    data = StepOptions(drops_output=True, accumulate=4).to_dict()
    assert data["drops_output"] is True and StepOptions.from_dict(data) == StepOptions(drops_output=True, accumulate=4)
