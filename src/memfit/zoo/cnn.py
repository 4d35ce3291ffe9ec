"""CNNs whose kernels allocate memory no tensor shows: ``convnext``, ``resnext``,
``mobilenet``, ``convmixer``. Depthwise and grouped convolutions (oneDNN reorders their
inputs and weights inside the kernel on CPU) and LayerNorm over channels (the kernel copies
its permuted input to a contiguous one first): four families, so that kernel workspace is
measured, not tuned to one model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit.workload import Workload
from memfit.zoo.small import _CrossEntropy


class ChannelsLayerNorm(nn.Module):
    """LayerNorm over the channels of an NCHW tensor (ConvNeXt's), by permuting."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, LayerNorm over channels, pointwise 4x expansion, GELU, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = ChannelsLayerNorm(c)
        self.pw1 = nn.Conv2d(c, 4 * c, 1)
        self.pw2 = nn.Conv2d(4 * c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))


class ResNeXtBlock(nn.Module):
    """1x1 reduce, grouped 3x3 (32 groups), 1x1 expand, BatchNorm and ReLU, residual."""

    def __init__(self, c: int, groups: int = 32) -> None:
        super().__init__()
        mid = c // 2
        self.reduce = nn.Sequential(nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU())
        self.grouped = nn.Sequential(nn.Conv2d(mid, mid, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(mid), nn.ReLU())
        self.expand = nn.Sequential(nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.expand(self.grouped(self.reduce(x))))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, depthwise 3x3 (stride 1 or 2), 1x1 project; ReLU6."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        mid = c_in * expand
        self.residual = stride == 1 and c_in == c_out
        self.body = nn.Sequential(
            nn.Conv2d(c_in, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU6(),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, groups=mid, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU6(),
            nn.Conv2d(mid, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class Stages(nn.Module):
    """Stem, stages of blocks with a downsampling between them, pooled linear head."""

    def __init__(self, stem: nn.Module, stages: list[nn.Module], width: int, classes: int = 100) -> None:
        super().__init__()
        self.stem = stem
        self.stages = nn.ModuleList(stages)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((2, 3)))


def _workload(model: nn.Module, batch_size: int, pixels: int, name: str) -> Workload:
    x = torch.randn(batch_size, 3, pixels, pixels)
    y = torch.randint(0, 100, (batch_size,))
    return Workload(model, x, _CrossEntropy(y), name=name, meta={"batch_size": batch_size, "pixels": pixels})


def convnext(
    batch_size: int = 8, pixels: int = 128, dims: tuple[int, ...] = (48, 96, 192, 384), depths: tuple[int, ...] = (2, 2, 4, 2)
) -> Workload:
    """A ConvNeXt-style network: patchify stem, 4 stages, LayerNorm-over-channels downsampling."""
    stages: list[nn.Module] = []
    for i, (c, n) in enumerate(zip(dims, depths)):
        down = [] if i == 0 else [ChannelsLayerNorm(dims[i - 1]), nn.Conv2d(dims[i - 1], c, 2, stride=2)]
        stages.append(nn.Sequential(*down, *(ConvNeXtBlock(c) for _ in range(n))))
    stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), ChannelsLayerNorm(dims[0]))
    return _workload(Stages(stem, stages, dims[-1]), batch_size, pixels, "convnext")


def resnext(
    batch_size: int = 8, pixels: int = 96, dims: tuple[int, ...] = (128, 256, 512), depths: tuple[int, ...] = (2, 3, 2)
) -> Workload:
    """A ResNeXt-style network: grouped 3x3 convolutions with BatchNorm."""
    stages: list[nn.Module] = []
    for i, (c, n) in enumerate(zip(dims, depths)):
        down = [] if i == 0 else [nn.Conv2d(dims[i - 1], c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        stages.append(nn.Sequential(*down, *(ResNeXtBlock(c) for _ in range(n))))
    stem = nn.Sequential(nn.Conv2d(3, dims[0], 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(dims[0]), nn.ReLU())
    return _workload(Stages(stem, stages, dims[-1]), batch_size, pixels, "resnext")


def mobilenet(batch_size: int = 16, pixels: int = 128) -> Workload:
    """A MobileNetV2-style network: inverted residuals around depthwise 3x3 convolutions."""
    cfg = [(32, 1, 1), (48, 2, 2), (64, 2, 3), (96, 2, 3), (160, 1, 2)]  # (channels, first stride, blocks)
    stages: list[nn.Module] = []
    c_in = 32
    for c, s, n in cfg:
        blocks = [InvertedResidual(c_in if j == 0 else c, c, s if j == 0 else 1) for j in range(n)]
        stages.append(nn.Sequential(*blocks))
        c_in = c
    stem = nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU6())
    return _workload(Stages(stem, stages, c_in), batch_size, pixels, "mobilenet")


def convmixer(batch_size: int = 8, pixels: int = 96, dim: int = 192, depth: int = 6, kernel: int = 9) -> Workload:
    """A ConvMixer: patch embedding, then depthwise 9x9 + pointwise blocks with GELU and
    BatchNorm: held out from the families above (other kernel size, no LayerNorm)."""

    class Residual(nn.Module):
        def __init__(self, fn: nn.Module) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fn(x)

    blocks = [
        nn.Sequential(
            Residual(nn.Sequential(nn.Conv2d(dim, dim, kernel, groups=dim, padding=kernel // 2), nn.GELU(), nn.BatchNorm2d(dim))),
            nn.Conv2d(dim, dim, 1),
            nn.GELU(),
            nn.BatchNorm2d(dim),
        )
        for _ in range(depth)
    ]
    stem = nn.Sequential(nn.Conv2d(3, dim, 4, stride=4), nn.GELU(), nn.BatchNorm2d(dim))
    return _workload(Stages(stem, [nn.Sequential(*blocks)], dim), batch_size, pixels, "convmixer")
