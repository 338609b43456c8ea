"""Small nets for tests: a ResNet (in-place ReLU after batch norm, a residual ``out += x``)
and a DenseNet block (concatenations of the block input and every new feature map)."""
from __future__ import annotations

import torch
from torch import nn


class ResNetBlock(nn.Module):
    """conv-BN-ReLU(inplace), conv-BN, ``out += identity``, ReLU(inplace): ResNet's block."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)
        self.conv2, self.bn2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def make_resnet(width: int = 8, device: str = "cpu") -> nn.Module:
    """A stem and three blocks of ``width`` channels, 10 classes; the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU(inplace=True), *[ResNetBlock(width) for _ in range(3)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)).to(device)


class DenseNetLike(nn.Module):
    """A stem and torchvision's DenseNet layer (cat → BN → ReLU(inplace) → conv), ``layers``
    of them: every concatenation joins the stem's output and new features that only
    later concatenations read, in forward."""

    def __init__(self, c0: int, growth: int, layers: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c0, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(c0 + i * growth), nn.ReLU(inplace=True),
                          nn.Conv2d(c0 + i * growth, growth, 3, padding=1))
            for i in range(layers))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(c0 + layers * growth, 10))

    def forward(self, x):
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return self.head(torch.cat(features, 1))


def make_densenet(width: int = 8, device: str = "cpu", layers: int = 4) -> nn.Module:
    """``DenseNetLike`` with a ``width``-channel stem and growth ``width // 2``; the same
    weights every call."""
    torch.manual_seed(0)
    return DenseNetLike(width, max(1, width // 2), layers).to(device)
