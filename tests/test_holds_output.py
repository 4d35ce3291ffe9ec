"""StepOptions.holds_output: a loop that binds the model's output to a name (``output =
model(x)``) keeps the previous step's output alive until the next step's forward returns.
memfit runs its steps so (the step before the recorded one leaves its output alive, the
recorded step drops it as its forward returns and leaves its own): real and fake tensors see
the same blocks, and values are untouched."""

from __future__ import annotations

import copy

import torch
from torch import nn

import memfit
from memfit import Category, Phase, StepOptions
from memfit.cuda.allocator import AllocatorSettings
from memfit.measure.ledger import GRAPH_NODE_BYTES, START_TICK, Block, Ledger, Tick
from memfit.measure.replay import _start_placement, _successors, replay_training
from memfit.measure.step import HeldOutput, train_step

WIDTH = 2048
BATCH = 256
OUT = BATCH * WIDTH * 4  # the output's bytes (float32), 2 MiB


class BigOutput(nn.Module):
    """A linear layer whose output (256 x 2048 floats) dwarfs its weights. Its forward first
    makes and drops a scratch tensor four times the output's size (no gradient, nothing
    saved): the step peaks there, in the forward, with or without a held output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ones(x.shape[0], 4 * WIDTH, device=x.device).sum()  # the forward's transient peak
        return self.lin(x)


def _setup() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return BigOutput(), torch.randn(BATCH, 4)


def _sum(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _held(ledger: Ledger) -> tuple[Block, Block]:
    """The previous step's output (alive at the start) and this step's, which the loop keeps."""
    assert len(ledger.held_output) == 1, ledger.held_output
    (start, end), = ledger.held_output.items()
    return ledger.blocks[start], ledger.blocks[end]  # type: ignore[index]


def _root_forward_end(ledger: Ledger) -> int:
    return next(s.end for s in ledger.spans if s.module == "" and s.phase is Phase.FORWARD)


def test_training_step_holds_the_previous_output_through_the_forward():
    """Real CPU tensors: the step starts with the previous step's output (2 MiB) and the
    autograd nodes it keeps, both die as the forward returns, and the step ends holding its
    own. The peak, in the forward, is higher by exactly those bytes."""
    model, x = _setup()
    base = memfit.profile(model, x, loss_fn=_sum)
    prof = memfit.profile(model, x, loss_fn=_sum, step=StepOptions(holds_output=True))
    led = prof.ledger
    before, after = _held(led)
    assert before.nbytes == after.nbytes == OUT
    assert before.born == START_TICK and before.category is Category.TEMPORARY
    # it dies right after the model's forward returns, before the loss runs
    assert before.died == _root_forward_end(led)
    assert led.ticks[before.died] == Tick(Phase.FORWARD, None, led.ticks[before.died].op)
    # this step's output: made by the linear layer, alive at the end (the next step frees it)
    assert (after.phase, after.module, after.died) == (Phase.FORWARD, "lin", None)
    # the graph the held output keeps after backward (its nodes, the model's forward's): one
    # block at the start, the size of the nodes this step's output keeps at its end
    graph_start = [b for b in led.blocks if b.born == START_TICK and b.category is Category.GRAPH]
    kept_nodes = [b for b in led.blocks if b.category is Category.GRAPH and b.born != START_TICK and b.died is None]
    assert len(graph_start) == 1 and graph_start[0].died == before.died + 1
    assert kept_nodes and all(b.nbytes == GRAPH_NODE_BYTES and b.module is not None for b in kept_nodes)
    assert graph_start[0].nbytes == sum(b.nbytes for b in kept_nodes)
    # the loss's own nodes (outside the model) go after backward as before
    assert not [b for b in base.ledger.blocks if b.category is Category.GRAPH and b.died is None]
    held = OUT + graph_start[0].nbytes
    assert prof.start_bytes == base.start_bytes + held
    assert prof.ledger.end_bytes == base.ledger.end_bytes + held
    assert base.peak["phase"] == prof.peak["phase"] == "forward"
    assert prof.peak_bytes - base.peak_bytes == held


def test_evaluation_step_holds_the_output_and_nothing_else():
    """An evaluation step (inference mode) keeps no graph: the held output is its only extra."""
    model, x = _setup()
    view = lambda out: out[0, 0]  # noqa: E731  (a loss that allocates nothing)
    base = memfit.profile(model, x, loss_fn=view, step=StepOptions(inference=True))
    prof = memfit.profile(model, x, loss_fn=view, step=StepOptions(inference=True, holds_output=True))
    before, after = _held(prof.ledger)
    assert before.nbytes == after.nbytes == OUT and before.died == _root_forward_end(prof.ledger)
    assert not [b for b in prof.ledger.blocks if b.category is Category.GRAPH]
    assert prof.peak["phase"] == base.peak["phase"] == "forward"
    assert prof.peak_bytes - base.peak_bytes == OUT


def test_fake_tensors_see_what_real_ones_do():
    model, x = _setup()
    step = StepOptions(holds_output=True)
    real = memfit.profile(model, x, loss_fn=_sum, step=step)
    fake = memfit.profile(model, x, loss_fn=_sum, step=step, fake=True)
    assert fake.ledger.held_output == real.ledger.held_output
    assert (fake.start_bytes, fake.peak_bytes, fake.ledger.end_bytes) == (real.start_bytes, real.peak_bytes, real.ledger.end_bytes)


def test_micro_batches_hold_each_passs_output_until_the_next_forward_returns():
    """``for mb in batch: out = model(mb); ...``: the first micro-batch's output lives until the
    second's forward returns, and the step ends holding the last one's (half the batch's)."""
    model, x = _setup()
    prof = memfit.profile(model, x, loss_fn=_sum, step=StepOptions(micro_batches=2, holds_output=True))
    led = prof.ledger
    before, after = _held(led)
    assert before.nbytes == after.nbytes == OUT // 2
    forwards = [s.end for s in led.spans if s.module == "" and s.phase is Phase.FORWARD]
    assert len(forwards) == 2 and before.died == forwards[0]
    outputs = [b for b in led.blocks if b.module == "lin" and b.phase is Phase.FORWARD and b.nbytes == OUT // 2]
    assert len(outputs) == 2
    first, last = sorted(outputs, key=lambda b: b.born)
    assert first.died == forwards[1] and last is after and last.died is None
    # the autograd nodes each pass's output keeps after its backward go with it
    graph = [b for b in led.blocks if b.category is Category.GRAPH and b.born != START_TICK and b.module is not None]
    nodes = [b for b in graph if not b.savers]  # (not the saved-tensor records: backward used them)
    assert {b.died for b in nodes if b.born < forwards[0]} == {forwards[1] + 1}
    assert {b.died for b in nodes if b.born > forwards[0]} == {None}


def test_a_dict_output_is_held_whole():
    """A model that returns a dict (a transformers ModelOutput is one): the loop's name holds
    every tensor in it, each paired with its successor by its place in the output."""

    class Dict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, WIDTH)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.lin(x)
            return {"loss": logits.square().mean(), "logits": logits}

    torch.manual_seed(0)
    prof = memfit.profile(Dict(), torch.randn(BATCH, 4), step=StepOptions(holds_output=True))
    led = prof.ledger
    assert len(led.held_output) == 2
    pairs = sorted((led.blocks[i].nbytes, led.blocks[j].nbytes) for i, j in led.held_output.items())  # type: ignore[index]
    assert pairs == [(4, 4), (OUT, OUT)]
    successor, _ = _successors(led)
    assert {i: successor[i] for i in led.held_output} == led.held_output


def test_the_option_changes_no_value():
    """The held output only outlives its step: losses, gradients and parameters over three
    steps are bitwise those of the loop that drops it (dropout and batch norm included)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16))
    x = torch.randn(12, 8)
    runs = []
    for held in (None, HeldOutput()):
        model = copy.deepcopy(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        grads: list[list[torch.Tensor]] = []

        def on_phase(phase: Phase, model: nn.Module = model, grads: list = grads) -> None:
            if phase is Phase.OPTIMIZER:
                grads.append([p.grad.clone() for p in model.parameters()])

        torch.manual_seed(1)
        losses = [train_step(model, (x,), {}, _sum, opt, on_phase, micro_batches=2, held=held) for _ in range(3)]
        runs.append((losses, grads, [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]))
        if held is not None:
            assert held.filled and held.value.shape == (6, 16)  # the last micro-batch's output
    (l0, g0, p0, b0), (l1, g1, p1, b1) = runs
    assert l0 == l1
    for a, b in zip([t for step in g0 for t in step] + p0 + b0, [t for step in g1 for t in step] + p1 + b1):
        assert torch.equal(a, b)


def test_profile_leaves_the_model_as_it_was():
    model, x = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    memfit.profile(model, x, loss_fn=_sum, step=StepOptions(holds_output=True))
    assert all(torch.equal(a, b) and p.grad is None for a, b, p in zip(before, model.parameters(), model.parameters()))


def test_options_json_names_it_only_when_set():
    assert "holds_output" not in StepOptions().to_dict()
    data = StepOptions(holds_output=True, inference=True).to_dict()
    assert data["holds_output"] is True and StepOptions.from_dict(data) == StepOptions(holds_output=True, inference=True)


def test_ledger_json_round_trip_keeps_the_pairs():
    model, x = _setup()
    led = memfit.profile(model, x, loss_fn=_sum, step=StepOptions(holds_output=True), fake=True).ledger
    assert Ledger.from_dict(led.to_dict()).held_output == led.held_output
    plain = memfit.profile(model, x, loss_fn=_sum, fake=True).ledger
    assert "held_output" not in plain.to_dict()  # ledgers of other steps read as before


def _held_ledger() -> Ledger:
    """A step by hand: a weight (start), the previous step's 3 MiB output (start, freed when the
    forward returns, tick 2), a 1 MiB activation, and its own 3 MiB output (alive at the end)."""
    mib = 1 << 20
    f = Phase.FORWARD
    blocks = [
        Block(0, 4 * mib, Category.PARAMETER, Phase.START, None, START_TICK, None),
        Block(1, 3 * mib, Category.TEMPORARY, Phase.START, None, START_TICK, 2),
        Block(2, 1 * mib, Category.ACTIVATION, f, "a", 0, 3),
        Block(3, 3 * mib, Category.TEMPORARY, f, "b", 1, None),
    ]
    ticks = [Tick(f, "a", "mm"), Tick(f, "b", "mm"), Tick(f, None, "mm"), Tick(Phase.BACKWARD, "a", "mm")]
    return Ledger(blocks, ticks, held_output={1: 3})


def test_the_loop_replay_starts_without_it_and_frees_it_where_the_next_forward_returns():
    led = _held_ledger()
    before, during = _start_placement(led)
    assert [b.id for b in before] == [0] and not during  # the program's first step holds no output yet
    assert _successors(led) == ({1: 3}, [])
    run = replay_training(led, AllocatorSettings())
    mib = 1 << 20
    # from the second step on, two outputs and the activation beside the weight: 4 + 3 + 3 + 1 MiB
    assert run.steady and run.stats.allocated_peak_bytes == 11 * mib


def test_a_plan_is_verified_on_the_held_step_and_keeps_it():
    """memfit.plan with holds_output: every verification run starts with the output of the run
    before it, the plan records the option, and the planned step profiled again with it peaks
    where the plan said."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model, x = nn.Sequential(Block(), Block(), nn.Linear(64, 1024)), torch.randn(128, 64)
    step = StepOptions(holds_output=True)
    base = memfit.profile(model, x, step=step)
    plan = memfit.plan(model, x, "0%", step=step, objective="flops", profile=base)
    assert plan.step == step and plan.checkpointed
    assert plan.start_bytes == base.start_bytes and plan.none_peak_bytes == base.peak_bytes
    memfit.apply(model, plan)
    try:
        again = memfit.profile(model, x, step=step)
    finally:
        memfit.remove(model)
    assert again.ledger.held_output and again.peak_bytes == plan.predicted_peak_bytes < plan.none_peak_bytes


def test_peaks_at_other_batches_hold_an_output_of_their_own(monkeypatch):
    """fake_peaks (memfit.fit's batch search) records one warm copy at many batches: at each, the
    step starts with an output of that batch (one step runs first to make it), so every peak is
    a fresh profile's, without falling back to one."""
    import memfit.measure.profile as profile_module
    from memfit.measure.checked import checked_step
    from memfit.measure.profile import fake_peaks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 512))
    step = StepOptions(holds_output=True)
    batches = (8, 32, 8, 64)
    want = [memfit.profile(model, torch.randn(b, 16), step=step, fake=True).peak_bytes for b in batches]
    fresh: list[int] = []
    original = profile_module.profile_step  # what a fallback to a fresh profile runs
    monkeypatch.setattr(profile_module, "profile_step", lambda *a, **k: fresh.append(1) or original(*a, **k))
    with fake_peaks(checked_step(model, torch.randn(8, 16), options=step, fake=True)) as peak:
        assert [peak(torch.randn(b, 16)) for b in batches] == want
    assert not fresh
