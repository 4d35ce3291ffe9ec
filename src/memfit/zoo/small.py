"""Small classic models: ``mlp-deep``, ``heavy`` and ``resnet``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from memfit.workload import Workload

# -- mlp-deep: 100 x (Linear(1024) + ReLU), batch 128 -----------------------------------------


def _mse_to_zero(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def build_mlp(batch_size: int = 128, depth: int = 100, width: int = 1024) -> Workload:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    meta = {"batch_size": batch_size, "depth": depth, "width": width}
    return Workload(nn.Sequential(*layers), torch.randn(batch_size, width), _mse_to_zero, name="mlp-deep", meta=meta)


# -- heavy: ~100k tiny scalar ops ---------------------------------------------------------------


class HeavyBlock(nn.Module):
    """``ops_per_block`` scalar ops: each step is ``tanh(x * w[i])`` (select, mul, tanh)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.w = nn.Parameter(1.0 + 0.01 * torch.randn(steps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.w.shape[0]):
            x = torch.tanh(x * self.w[i])
        return x


class Heavy(nn.Module):
    def __init__(self, n_ops: int, ops_per_block: int) -> None:
        super().__init__()
        steps = max(1, ops_per_block // 3)
        self.blocks = nn.Sequential(*[HeavyBlock(steps) for _ in range(max(1, n_ops // (3 * steps)))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def build_heavy(batch_size: int = 4, n_ops: int = 100_000, ops_per_block: int = 300) -> Workload:
    meta = {"batch_size": batch_size, "n_ops": n_ops, "ops_per_block": ops_per_block}
    return Workload(Heavy(n_ops, ops_per_block), torch.randn(batch_size), _mse_to_zero, name="heavy", meta=meta)


# -- resnet: bottleneck CNN with BatchNorm and Dropout -------------------------------------------


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, depths: tuple[int, ...], base: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 3, padding=1, bias=False), nn.BatchNorm2d(base), nn.ReLU(inplace=True))
        cin, stages = base, []
        for i, depth in enumerate(depths):
            width = base * 2**i
            blocks = []
            for j in range(depth):
                blocks.append(Bottleneck(cin, width, stride=2 if (j == 0 and i > 0) else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.dropout(torch.flatten(self.pool(x), 1)))


class _CrossEntropy:
    """Loss against fixed labels; a class rather than a closure so it pickles."""

    def __init__(self, labels: torch.Tensor) -> None:
        self.labels = labels

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, self.labels.to(logits.device))


def build_resnet(
    batch_size: int = 16, image_size: int = 64, base: int = 32, depths: tuple[int, ...] = (2, 2, 2, 2), num_classes: int = 100
) -> Workload:
    depths = tuple(int(d) for d in depths)
    if len(depths) != 4:
        raise ValueError("depths needs four stages, e.g. (2, 2, 2, 2)")
    model = ResNet(depths, base, num_classes, dropout=0.2)
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, num_classes, (batch_size,))
    meta = {"batch_size": batch_size, "image_size": image_size, "base": base, "depths": list(depths)}
    return Workload(model, images, _CrossEntropy(labels), name="resnet", meta=meta)
