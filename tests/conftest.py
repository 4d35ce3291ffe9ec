"""Shared fixtures: small models that make a step in milliseconds on a CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class TinyNet(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear: buffers, RNG and saved tensors."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


@pytest.fixture
def tiny() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyNet(), torch.randn(32, 64)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Everything a training step could change, cloned, for bitwise comparison."""
    state = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "grad_ids": {n: id(p.grad) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
        "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
    }
    if optimizer is not None:
        state["opt"] = {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for i, st in enumerate(optimizer.state.values())
        }
        state["opt_keys"] = len(optimizer.state)
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if key in ("params", "buffers", "grads"):
            for n in x:
                if x[n] is None or y[n] is None:
                    assert x[n] is None and y[n] is None, n
                else:
                    assert torch.equal(x[n], y[n]), f"{key} {n} changed"
        elif key == "rng":
            assert torch.equal(x, y), "RNG state changed"
        elif key == "opt":
            assert x.keys() == y.keys()
            for i in x:
                assert x[i].keys() == y[i].keys()
                for k in x[i]:
                    if isinstance(x[i][k], torch.Tensor):
                        assert torch.equal(x[i][k], y[i][k]), f"optimizer state {k} changed"
                    else:
                        assert x[i][k] == y[i][k]
        else:
            assert x == y, key
