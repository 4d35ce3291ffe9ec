"""Grouped and depthwise convolutions' FLOPs against the closed form: torch's formula for a
convolution's backward counts grad_weight as if groups were 1 (~97x too high for ConvNeXt's
depthwise convolutions); memfit counts it with the groups."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import memfit
from memfit.compat.torch_compat import CORRECTED_FLOPS


def _forward(n: int, cin: int, cout: int, groups: int, hout: int, wout: int, k: int) -> int:
    return 2 * n * cout * hout * wout * (cin // groups) * k * k


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)  # its input needs no gradient: grad_weight only
        self.depthwise = nn.Conv2d(32, 32, 7, padding=3, groups=32)
        self.grouped = nn.Conv2d(32, 64, 3, stride=2, padding=1, groups=4)
        self.up = nn.ConvTranspose2d(64, 32, 2, stride=2, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.grouped(self.depthwise(self.stem(x))))


def test_grouped_and_depthwise_convolutions_count_the_closed_form():
    torch.manual_seed(0)
    n = 2
    prof = memfit.profile(_Net(), torch.randn(n, 3, 16, 16), fake=True)
    expect = {
        "stem": _forward(n, 3, 32, 1, 16, 16, 3),
        "depthwise": _forward(n, 32, 32, 32, 16, 16, 7),
        "grouped": _forward(n, 32, 64, 4, 8, 8, 3),
        # a transposed convolution: every input element times the (Cout / groups) x k x k weights of its group
        "up": 2 * n * 64 * 8 * 8 * (32 // 2) * 2 * 2,
    }
    for name, forward in expect.items():
        m = prof.modules[name]
        assert m.forward_flops == forward, name
        # backward = grad_input (none for the stem: its input needs no gradient) + grad_weight, each the forward's count
        assert m.backward_flops == (1 if name == "stem" else 2) * forward, (name, m.backward_flops / forward)


def test_flop_counter_mode_with_the_corrected_formulas():
    # what the bench child counts: torch's FlopCounterMode with memfit's conv backward
    conv = nn.Conv2d(96, 96, 7, padding=3, groups=96)
    x = torch.randn(1, 96, 14, 14, requires_grad=True)
    forward = _forward(1, 96, 96, 96, 14, 14, 7)
    with FlopCounterMode(display=False, custom_mapping=CORRECTED_FLOPS) as counter:
        conv(x).sum().backward()
    assert counter.get_total_flops() == 3 * forward
    with FlopCounterMode(display=False) as torch_counter:  # torch's own: grad_weight 96x (the groups) too high
        conv(x).sum().backward()
    assert torch_counter.get_total_flops() == forward + forward + 96 * forward
