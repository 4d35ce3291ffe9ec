"""Copies of the user's step (fake copies, cast copies, a rank's copy) run the copy's own
modules, even where the model calls them through a function it keeps as an attribute."""

import torch
from torch import nn

import memfit
from memfit.measure.ledger import START_TICK, Category
from memfit.measure.sandbox import copy_model


class _Block(nn.Module):
    """minGPT's pattern: the MLP is called through a lambda closing over the submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.ModuleDict({"fc": nn.Linear(32, 128), "proj": nn.Linear(128, 32)})
        m = self.mlp
        self.mlpf = lambda x: m.proj(torch.relu(m.fc(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlpf(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block())


def test_copy_binds_closures_to_the_copy():
    model = _model()
    new = copy_model(model)
    for old_block, new_block in zip(model, new):
        cell = new_block.mlpf.__closure__[0].cell_contents
        assert cell is new_block.mlp and cell is not old_block.mlp
    x = torch.randn(4, 32)
    assert torch.equal(new(x), model(x))


def test_fake_profile_of_closure_model_counts_only_the_copy():
    model, x = _model(), torch.randn(64, 32)
    real = memfit.profile(model, x)
    fake = memfit.profile(model, x, fake=True)
    other = [b for b in fake.ledger.blocks if b.born == START_TICK and b.category is Category.OTHER]
    assert other == []  # before: the user's MLP weights, used by the copy, sat at the start as "other"
    assert fake.start_bytes == real.start_bytes
    assert fake.peak_bytes == real.peak_bytes


def test_cast_copy_leaves_the_users_model_without_grads():
    model, x = _model(), torch.randn(16, 32)
    memfit.profile(model, x, step=memfit.StepOptions(param_dtype="bfloat16"))
    assert all(p.grad is None for p in model.parameters())
