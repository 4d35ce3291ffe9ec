"""memfit.profile on real and fake tensors: exact accounting, no side effects."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TinyNet, assert_same, snapshot
from torch import nn

import memfit
from memfit import Category, Phase, zoo


def _adamw_state_bytes(model: nn.Module) -> int:
    # exp_avg and exp_avg_sq per parameter, plus a float32 scalar `step` each
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def test_start_bytes_are_exact(tiny):
    model, x = tiny
    opt = torch.optim.AdamW(model.parameters())
    prof = memfit.profile(model, x, optimizer=opt)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    start = {b.category: 0 for b in prof.ledger.blocks}
    for b in prof.ledger.blocks:
        if b.born == -1:
            start[b.category] += b.nbytes
    assert start[Category.PARAMETER] == param_bytes
    assert start[Category.BUFFER] == buffer_bytes
    assert start[Category.OPTIMIZER] == _adamw_state_bytes(model)
    assert start[Category.INPUT] == x.numel() * 4
    assert prof.start_bytes == param_bytes + buffer_bytes + _adamw_state_bytes(model) + x.numel() * 4


def test_gradients_cover_every_parameter(tiny):
    model, x = tiny
    prof = memfit.profile(model, x)
    grads = sum(b.nbytes for b in prof.ledger.blocks if b.category is Category.GRADIENT)
    assert grads == sum(p.numel() * 4 for p in model.parameters())
    # zero_grad(set_to_none=True) frees them: nothing born in the step outlives it
    assert prof.ledger.end_bytes == prof.start_bytes


def test_tied_weights_and_views_count_once():
    work = zoo.build("gpt", n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=512, batch_size=2)
    prof = memfit.profile(work.model, work.inputs)
    unique = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in work.model.parameters()}
    assert work.model.lm_head.weight is work.model.transformer.wte.weight
    params = sum(b.nbytes for b in prof.ledger.blocks if b.category is Category.PARAMETER)
    assert params == sum(unique.values())


def test_fake_matches_real_exactly():
    for name, sizes in (
        ("gpt", dict(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=512)),
        ("resnet", dict(image_size=16, base=8)),
    ):
        work = zoo.build(name, batch_size=4, **sizes)
        real = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn)
        fake = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, fake=True)
        assert fake.peak_bytes == real.peak_bytes, name
        assert fake.start_bytes == real.start_bytes, name
        assert fake.breakdown == real.breakdown, name
        assert fake.device == "fake:cpu" and fake.time_source == "omitted" and fake.step_time_s is None
        assert real.time_source == "measured" and real.step_time_s > 0
        assert fake.modules[""].forward_flops == real.modules[""].forward_flops > 0


def test_fake_needs_no_memory_for_a_big_batch():
    # batch 512 of this gpt would need ~3 GiB of activations; on fake tensors it is instant and free
    work = zoo.build("gpt", n_layer=2, n_embd=128, n_head=4, block_size=128, vocab_size=1024, batch_size=512)
    prof = memfit.profile(work.model, work.inputs, fake=True)
    assert prof.breakdown["activations"] > 2 * 2**30


def test_leaves_model_optimizer_and_rng_untouched(tiny):
    model, x = tiny
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss = model(x).sum()
    loss.backward()
    opt.step()  # real optimizer state and existing gradients, BatchNorm statistics moved
    before = snapshot(model, opt)
    memfit.profile(model, x, optimizer=opt)
    assert_same(before, snapshot(model, opt))
    memfit.profile(model, x, optimizer=opt, fake=True)
    assert_same(before, snapshot(model, opt))


def test_leaves_a_fresh_optimizer_without_state(tiny):
    model, x = tiny
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = snapshot(model, opt)
    memfit.profile(model, x, optimizer=opt)
    assert len(opt.state) == 0
    assert_same(before, snapshot(model, opt))


def test_breakdown_sums_to_peak(tiny):
    model, x = tiny
    prof = memfit.profile(model, x)
    assert sum(prof.breakdown.values()) == prof.peak_bytes
    assert prof.peak["phase"] in {"forward", "backward", "optimizer"}


def test_activations_are_what_autograd_saves():
    # relu saves its output and the second matmul saves the same storage as its input: one
    # block, counted once, held by both modules. The first matmul saves only the input batch.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 8, bias=False))
    x = torch.randn(64, 256)
    prof = memfit.profile(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    acts = [b for b in prof.ledger.blocks if b.category is Category.ACTIVATION]
    assert [b.nbytes for b in acts] == [64 * 512 * 4]
    assert set(acts[0].savers) == {"1", "2"}
    assert prof.modules["1"].saved_bytes == prof.modules["2"].saved_bytes == 64 * 512 * 4
    assert prof.modules["0"].saved_bytes == 0  # the input batch is an input, not an activation
    assert prof.modules[""].saved_bytes == 64 * 512 * 4


class _Chain(nn.Module):
    """``tanh(x * w)`` ``n`` times: per repetition two autograd nodes (mul, tanh) and three
    saved tensors (mul saves x and w, tanh its output)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.tanh(x * self.w)
        return x


def test_cpu_graph_blocks_count_nodes_and_saved_tensors():
    from memfit.measure.ledger import GRAPH_NODE_BYTES, GRAPH_SAVED_BYTES

    model = nn.Sequential(_Chain(50))
    prof = memfit.profile(model, torch.randn(4), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ticks = prof.ledger.ticks
    graph = [b for b in prof.ledger.blocks if b.category is Category.GRAPH and b.module == "0"]
    nodes = [b for b in graph if not b.savers]
    records = [b for b in graph if b.savers]
    assert len(nodes) == 100 and {b.nbytes for b in nodes} == {GRAPH_NODE_BYTES}
    assert len(records) == 149  # the first mul does not save w: x needs no grad
    assert {b.nbytes for b in records} == {GRAPH_SAVED_BYTES}
    assert all(b.phase is Phase.FORWARD for b in graph) and {b.savers for b in records} == {("0",)}
    # records go as backward uses them; nodes all at once, when the step drops the graph
    assert all(ticks[b.died].phase is Phase.BACKWARD for b in records)
    assert len({b.died for b in nodes}) == 1 and max(b.died for b in records) < nodes[0].died
    assert ticks[nodes[0].died].phase is Phase.BACKWARD  # freed before the optimizer step
    # the graph is the step's peak here: four-float tensors weigh nothing beside it
    assert prof.breakdown["autograd_graph"] > 0.9 * prof.step_peak_bytes
    assert memfit.profile(model, torch.randn(4), fake=True).peak_bytes == memfit.profile(model, torch.randn(4)).peak_bytes


def test_a_checkpointed_region_keeps_bookkeeping_instead_of_saved_records():
    from memfit.measure.ledger import CHECKPOINT_BYTES_PER_NODE, GRAPH_NODE_BYTES
    from memfit.recompute.checkpoint import apply_choices

    model = nn.Sequential(_Chain(10), _Chain(10))
    apply_choices(model, {"1": ("full", ())})
    prof = memfit.profile(model, torch.randn(4))
    graph = [b for b in prof.ledger.blocks if b.category is Category.GRAPH and b.phase is Phase.FORWARD]
    plain = [b for b in graph if b.module == "0"]
    ckpt = [b for b in graph if b.module == "1"]
    assert sum(1 for b in plain if b.savers) == 29 and {b.nbytes for b in plain if not b.savers} == {GRAPH_NODE_BYTES}
    # one record: the checkpoint saving its inputs for the recompute; the region's own
    # saves go to the checkpoint's hooks. Before torch 2.13 (2.6, 2.11), the checkpoint's
    # _NoopSaveInputs saves its 0-element dummy output beside the input: two records.
    from torch.utils import checkpoint as torch_checkpoint

    assert sum(1 for b in ckpt if b.savers) == (2 if hasattr(torch_checkpoint, "_NoopSaveInputs") else 1)
    nodes = [b for b in ckpt if not b.savers]
    assert {b.nbytes for b in nodes} == {GRAPH_NODE_BYTES + CHECKPOINT_BYTES_PER_NODE} and len(nodes) == 20


class _EveryOtherMatmul(nn.Module):
    """Checkpoints its two linears with torchtitan's per-op policy: the first matmul's output
    kept by the policy's own cache (MUST_SAVE), everything else recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

        counts = {False: 0, True: 0}  # forward's and recompute's matmuls, as torchtitan counts them

        def policy(ctx, func, *args, **kwargs):
            if func is not torch.ops.aten.mm.default:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE

        def inner(t: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(t)))

        return checkpoint(inner, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy))


def test_what_a_selective_checkpoint_policy_saves_is_an_activation():
    # the policy keeps the first matmul's output in its own cache, which autograd's hooks never
    # see: still an activation (saved for backward), not a temporary
    torch.manual_seed(0)
    model = _EveryOtherMatmul()
    prof = memfit.profile(model, torch.randn(32, 64))
    mm_out = 32 * 64 * 4
    fwd = [b for b in prof.ledger.blocks if b.phase is Phase.FORWARD and b.nbytes == mm_out]
    kept = [b for b in fwd if b.module == "a"]
    assert len(kept) == 1 and kept[0].category is Category.ACTIVATION and kept[0].savers
    assert prof.ledger.ticks[kept[0].died].phase is Phase.BACKWARD
    # the second matmul's output is the model's output, which nothing saves
    assert [b.category for b in fwd if b.module == "b"] == [Category.TEMPORARY]


class _OwnCheckpoint(nn.Module):
    """Checkpoints its child itself, as transformers' gradient checkpointing does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_a_checkpoint_the_model_makes_itself_costs_what_memfits_does():
    from memfit.recompute.checkpoint import apply_choices

    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        pytest.skip(f"torch {torch.__version__} cannot show the recorder another's saved-tensor hooks (docs/limitations.md)")

    torch.manual_seed(0)
    ours = nn.Sequential(_Chain(10), nn.Sequential(_Chain(10)))
    theirs = nn.Sequential(_Chain(10), _OwnCheckpoint(_Chain(10)))
    theirs.load_state_dict({k.replace("1.0.", "1.inner."): v for k, v in ours.state_dict().items()})
    apply_choices(ours, {"1": ("full", ())})
    x = torch.randn(4)
    a = memfit.profile(ours, x, optimizer=torch.optim.SGD(ours.parameters(), lr=0.1))
    b = memfit.profile(theirs, x, optimizer=torch.optim.SGD(theirs.parameters(), lr=0.1))
    assert b.breakdown["autograd_graph"] == a.breakdown["autograd_graph"] and b.peak_bytes == a.peak_bytes


def test_graph_blocks_only_where_autograd_records():
    model = nn.Sequential(_Chain(20), nn.Linear(4, 4))
    model[0].w.requires_grad_(False)  # the chain runs on the input and a frozen weight: no node
    prof = memfit.profile(model, torch.randn(4))
    graph = {b.module for b in prof.ledger.blocks if b.category is Category.GRAPH}
    assert "1" in graph and "0" not in graph
    inference = memfit.profile(model, torch.randn(4), step=memfit.StepOptions(inference=True))
    assert inference.breakdown["autograd_graph"] == 0  # torch.inference_mode builds no graph


def test_module_flops_follow_the_formula():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 4))
    x = torch.randn(32, 128)
    prof = memfit.profile(model, x)
    assert prof.modules["0"].forward_flops == 2 * 32 * 128 * 256
    # backward of the first layer needs only the weight gradient: its input needs none
    assert prof.modules["0"].backward_flops == 2 * 32 * 128 * 256
    assert prof.modules["2"].backward_flops == 2 * 2 * 32 * 256 * 4
    assert prof.modules[""].forward_flops == prof.modules["0"].forward_flops + prof.modules["2"].forward_flops


def test_cpu_attention_flops_are_counted():
    work = zoo.build("gpt", n_layer=1, n_embd=64, n_head=4, block_size=32, vocab_size=256, batch_size=2, dropout=0.0)
    prof = memfit.profile(work.model, work.inputs, fake=True)
    attn = prof.modules["transformer.h.0.attn"]
    linear = prof.modules["transformer.h.0.attn.c_attn"].forward_flops + prof.modules["transformer.h.0.attn.c_proj"].forward_flops
    sdpa = 2 * (2 * 2 * 4 * 32 * 32 * 16)  # QK^T and PV: 2*B*nh*T*T*hs each
    assert attn.forward_flops == linear + sdpa
    assert attn.backward_flops > 2 * linear


def test_module_times_are_measured(tiny):
    model, x = tiny
    prof = memfit.profile(model, x)
    root = prof.modules[""]
    assert root.forward_time_s > 0 and root.backward_time_s > 0
    assert prof.modules["fc1"].forward_time_s <= root.forward_time_s
    assert root.forward_time_s + root.backward_time_s <= prof.step_time_s


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: dict


class KwargsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, mask: torch.Tensor | None = None) -> Out:
        y = self.fc(x) * scale
        if mask is not None:
            y = y * mask
        return Out(y, {"note": "non-tensor", "n": 3})


def test_keyword_inputs_and_dataclass_outputs():
    model = KwargsModel()
    inputs = {"x": torch.randn(4, 16), "scale": 2.0, "mask": torch.ones(4, 16)}
    prof = memfit.profile(model, inputs, loss_fn=lambda out: out.logits.square().mean())
    assert prof.peak_bytes > prof.start_bytes
    assert prof.modules[""].backward_time_s > 0  # backward entered through the dataclass output


def test_default_loss_uses_output_loss_or_sum(monkeypatch):
    import memfit.workload as workload

    losses = []
    real = workload.default_loss

    def spy(output):
        loss = real(output)
        losses.append((output, loss))
        return loss

    monkeypatch.setattr(workload, "default_loss", spy)
    work = zoo.build("gpt", n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64, batch_size=2)
    cases = [
        (work.model, work.inputs, lambda out: out.loss),  # GPTOutput.loss, as it is
        (nn.Linear(4, 4), torch.randn(2, 4), lambda out: out.sum()),  # sum of a tensor
        (KwargsModel(), torch.randn(2, 16), lambda out: out.logits.sum()),  # sum over a dataclass's one tensor
    ]
    for model, inputs, expected in cases:
        losses.clear()
        memfit.profile(model, inputs)
        assert losses, f"{type(model).__name__}: the step did not take the default loss"
        for output, loss in losses:  # every step the profile ran trained on that loss
            assert loss.shape == () and torch.equal(loss, expected(output)), type(model).__name__


def test_json_round_trip(tiny):
    model, x = tiny
    prof = memfit.profile(model, x)
    data = prof.to_dict()
    for key in ("peak_bytes", "start_bytes", "breakdown", "modules", "peak", "time_source"):
        assert key in data
    again = memfit.Profile.from_dict(data)
    assert again.peak_bytes == prof.peak_bytes and again.breakdown == prof.breakdown
    assert again.modules == prof.modules


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.inner(x))


@pytest.mark.parametrize("fake", [False, True])
def test_forward_error_names_the_module(fake):
    model, x = Boom(), torch.randn(2, 4)
    before = snapshot(model)
    with pytest.raises(memfit.ForwardError) as info:
        memfit.profile(model, x, fake=fake)
    msg = str(info.value)
    assert "'head'" in msg and "Linear" in msg and "RuntimeError" in msg
    assert "\n" not in msg
    assert_same(before, snapshot(model))


def test_loss_must_be_a_scalar_with_grad(tiny):
    model, x = tiny
    before = snapshot(model)
    with pytest.raises(memfit.LossError, match="scalar"):
        memfit.profile(model, x, loss_fn=lambda out: out)
    with pytest.raises(memfit.LossError, match="require grad"):
        memfit.profile(model, x, loss_fn=lambda out: out.detach().sum())
    with pytest.raises(memfit.LossError, match="tensor"):
        memfit.profile(model, x, loss_fn=lambda out: 3.0)
    assert_same(before, snapshot(model))


def test_bad_arguments(tiny):
    model, x = tiny
    with pytest.raises(memfit.WorkloadError, match="nn.Module"):
        memfit.profile("not a model", x)
    with pytest.raises(memfit.WorkloadError, match="inputs must be"):
        memfit.profile(model, {1, 2})
    with pytest.raises(memfit.WorkloadError, match="Optimizer"):
        memfit.profile(model, x, optimizer="adam")
    with pytest.raises(memfit.WorkloadError, match="the model is on the meta device, which holds no data"):
        memfit.profile(TinyNet().to("meta"), x)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(memfit.WorkloadError, match="requires grad"):
        memfit.profile(frozen, torch.randn(1, 2))


def test_phases_of_the_timeline(tiny):
    model, x = tiny
    prof = memfit.profile(model, x)
    phases = [t.phase for t in prof.ledger.ticks]
    # forward, then backward, then the optimizer: each a contiguous run
    order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert order == [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
