"""A small ResNet for tests: in-place ReLU after batch norm, and a residual ``out += x``."""
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
