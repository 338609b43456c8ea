"""NASNet-A mobile, AmoebaNet and DARTS as ImageNet networks built from their cell genotypes.

The code follows the DARTS reference implementation (github.com/quark0/darts,
``cnn/genotypes.py``, ``cnn/operations.py``, ``cnn/model.py`` ``NetworkImageNet``) as the
official Nimble repository copied it into ``experiment/darts.py`` (snuspl/nimble @2aaa2fe):
C=48, 14 cells, no auxiliary head, no drop-path (the Nimble copy dropped it), 1000
classes, 224x224 input, and ``forward`` returns the logits only.

A cell takes the outputs of the two previous cells (``s0``, ``s1``), preprocesses both to
``C`` channels, then builds ``steps`` new states; state ``k`` is ``op_a(state_i) +
op_b(state_j)`` for the genotype's two (op, input) pairs. The cell output concatenates the
states listed in ``*_concat``. A genotype lists ``2 * steps`` (op, input index) pairs.

NASNet-A mobile (``nasnet_a_mobile``) is built the same way from the NASNet genotype of
quark0/darts, with C=44 and 14 cells. That matches NASNet-A mobile's "4 @ 1056"
configuration in cell count (N=4 normal cells per stage, 2 reduction cells between the 3
stages, 44 filters in the first stage), but not exactly: the DARTS-style stem (3 strided
convs) replaces NASNet's stem (one conv + 2 reduction cells), the final width is 5 * 176 =
880 channels instead of 1056 (the DARTS-style normal cell concatenates its 5 new states,
NASNet also concatenates its input), and the reduction cell is the DARTS transcription.
Size: 4.77 M parameters and 512 M multiply-adds (convs and linear, 224x224) here,
against the published 5.3 M and 564 M (Zoph et al. 2018, Table 2); about 10 % smaller,
mostly the narrower classifier and stem. ``tests/test_models.py`` pins the count.
For reference DARTS here has 4.72 M parameters (published 4.7 M) and AmoebaNet 4.63 M. The Nimble paper used Cadene's ``pretrainedmodels``
``nasnetamobile``, which is not a dependency here.

One deliberate change from the reference: the global pooling is ``AdaptiveAvgPool2d(1)``
instead of ``AvgPool2d(7)``. At 224x224 the last feature map is 7x7 and the two are the
same computation; the adaptive one also accepts the smaller inputs the tests use.
"""
from __future__ import annotations

from collections import namedtuple

import torch
from torch import nn

__all__ = [
    "Genotype",
    "NASNet",
    "AmoebaNet",
    "DARTS_V2",
    "GENOTYPES",
    "NetworkImageNet",
    "nasnet_a_mobile",
    "amoebanet",
    "darts",
]

Genotype = namedtuple("Genotype", "normal normal_concat reduce reduce_concat")

# --- Genotypes, verbatim from quark0/darts cnn/genotypes.py -------------------------------
# NASNet-A (Zoph et al. 2018) as transcribed by DARTS: 5 steps per cell.
NASNet = Genotype(
    normal=[
        ("sep_conv_5x5", 1),
        ("sep_conv_3x3", 0),
        ("sep_conv_5x5", 0),
        ("sep_conv_3x3", 0),
        ("avg_pool_3x3", 1),
        ("skip_connect", 0),
        ("avg_pool_3x3", 0),
        ("avg_pool_3x3", 0),
        ("sep_conv_3x3", 1),
        ("skip_connect", 1),
    ],
    normal_concat=[2, 3, 4, 5, 6],
    reduce=[
        ("sep_conv_5x5", 1),
        ("sep_conv_7x7", 0),
        ("max_pool_3x3", 1),
        ("sep_conv_7x7", 0),
        ("avg_pool_3x3", 1),
        ("sep_conv_5x5", 0),
        ("skip_connect", 3),
        ("avg_pool_3x3", 2),
        ("sep_conv_3x3", 2),
        ("max_pool_3x3", 1),
    ],
    reduce_concat=[4, 5, 6],
)

# AmoebaNet-A (Real et al. 2019) as transcribed by DARTS: 5 steps per cell.
AmoebaNet = Genotype(
    normal=[
        ("avg_pool_3x3", 0),
        ("max_pool_3x3", 1),
        ("sep_conv_3x3", 0),
        ("sep_conv_5x5", 2),
        ("sep_conv_3x3", 0),
        ("avg_pool_3x3", 3),
        ("sep_conv_3x3", 1),
        ("skip_connect", 1),
        ("skip_connect", 0),
        ("avg_pool_3x3", 1),
    ],
    normal_concat=[4, 5, 6],
    reduce=[
        ("avg_pool_3x3", 0),
        ("sep_conv_3x3", 1),
        ("max_pool_3x3", 0),
        ("sep_conv_7x7", 2),
        ("sep_conv_7x7", 0),
        ("avg_pool_3x3", 1),
        ("max_pool_3x3", 0),
        ("max_pool_3x3", 1),
        ("conv_7x1_1x7", 0),
        ("sep_conv_3x3", 5),
    ],
    reduce_concat=[3, 4, 6],
)

# DARTS (second order), the genotype of the paper's ImageNet result: 4 steps per cell.
# quark0/darts sets DARTS = DARTS_V2; Nimble's experiment/darts.py uses the same one.
DARTS_V2 = Genotype(
    normal=[
        ("sep_conv_3x3", 0),
        ("sep_conv_3x3", 1),
        ("sep_conv_3x3", 0),
        ("sep_conv_3x3", 1),
        ("sep_conv_3x3", 1),
        ("skip_connect", 0),
        ("skip_connect", 0),
        ("dil_conv_3x3", 2),
    ],
    normal_concat=[2, 3, 4, 5],
    reduce=[
        ("max_pool_3x3", 0),
        ("max_pool_3x3", 1),
        ("skip_connect", 2),
        ("max_pool_3x3", 1),
        ("max_pool_3x3", 0),
        ("skip_connect", 2),
        ("skip_connect", 2),
        ("max_pool_3x3", 1),
    ],
    reduce_concat=[2, 3, 4, 5],
)

GENOTYPES: dict[str, Genotype] = {"nasnet": NASNet, "amoebanet": AmoebaNet, "darts_v2": DARTS_V2}


# --- Operations, as in quark0/darts cnn/operations.py -------------------------------------
class ReLUConvBN(nn.Sequential):
    """ReLU -> conv -> BN; the cells' 1x1 preprocessing."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int, padding: int):
        super().__init__(
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_out, kernel_size, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(c_out),
        )


class DilConv(nn.Sequential):
    """ReLU -> dilated depthwise conv -> pointwise conv -> BN."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int, padding: int, dilation: int):
        super().__init__(
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_in, kernel_size, stride=stride, padding=padding, dilation=dilation,
                      groups=c_in, bias=False),
            nn.Conv2d(c_in, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )


class SepConv(nn.Sequential):
    """Two stacked (ReLU -> depthwise conv -> pointwise conv -> BN); only the first strides."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int, padding: int):
        super().__init__(
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_in, kernel_size, stride=stride, padding=padding, groups=c_in, bias=False),
            nn.Conv2d(c_in, c_in, 1, bias=False),
            nn.BatchNorm2d(c_in),
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_in, kernel_size, stride=1, padding=padding, groups=c_in, bias=False),
            nn.Conv2d(c_in, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )


class FactorizedReduce(nn.Module):
    """Halve the spatial size with two 1x1 stride-2 convs on offset grids, concatenated.

    Needs even height and width (the second path drops the first row and column).
    """

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        if c_out % 2:
            raise ValueError(f"FactorizedReduce needs an even c_out, got {c_out}")
        self.relu = nn.ReLU(inplace=False)
        self.conv_1 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.conv_2 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        return self.bn(torch.cat([self.conv_1(x), self.conv_2(x[:, :, 1:, 1:])], dim=1))


def make_op(name: str, c: int, stride: int) -> nn.Module:
    """One cell operation by its genotype name (the ``OPS`` table of quark0/darts)."""
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride=stride, padding=1)
    if name == "skip_connect":
        return nn.Identity() if stride == 1 else FactorizedReduce(c, c)
    if name in ("sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7"):
        k = int(name[-1])
        return SepConv(c, c, k, stride, k // 2)
    if name in ("dil_conv_3x3", "dil_conv_5x5"):
        k = int(name[-1])
        return DilConv(c, c, k, stride, k - 1, dilation=2)
    if name == "conv_7x1_1x7":
        return nn.Sequential(
            nn.ReLU(inplace=False),
            nn.Conv2d(c, c, (1, 7), stride=(1, stride), padding=(0, 3), bias=False),
            nn.Conv2d(c, c, (7, 1), stride=(stride, 1), padding=(3, 0), bias=False),
            nn.BatchNorm2d(c),
        )
    raise KeyError(f"unknown cell operation {name!r}")


# --- Network, as in quark0/darts cnn/model.py (Nimble's copy) -----------------------------
class Cell(nn.Module):
    """One normal or reduction cell of a genotype."""

    def __init__(self, genotype: Genotype, c_prev_prev: int, c_prev: int, c: int,
                 reduction: bool, reduction_prev: bool):
        super().__init__()
        # After a reduction cell s0 has twice the spatial size of s1: reduce it to match.
        self.preprocess0 = FactorizedReduce(c_prev_prev, c) if reduction_prev else ReLUConvBN(c_prev_prev, c, 1, 1, 0)
        self.preprocess1 = ReLUConvBN(c_prev, c, 1, 1, 0)
        pairs = genotype.reduce if reduction else genotype.normal
        self.concat = list(genotype.reduce_concat if reduction else genotype.normal_concat)
        if len(pairs) % 2:
            raise ValueError(f"a genotype cell needs an even number of (op, input) pairs, got {len(pairs)}")
        self.steps = len(pairs) // 2
        self.indices = [index for _, index in pairs]
        # In a reduction cell only ops reading the cell inputs (index 0, 1) stride.
        self.ops = nn.ModuleList(
            make_op(name, c, 2 if reduction and index < 2 else 1) for name, index in pairs
        )
        self.multiplier = len(self.concat)

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = [self.preprocess0(s0), self.preprocess1(s1)]
        for i in range(self.steps):
            h1 = self.ops[2 * i](states[self.indices[2 * i]])
            h2 = self.ops[2 * i + 1](states[self.indices[2 * i + 1]])
            states.append(h1 + h2)
        return torch.cat([states[i] for i in self.concat], dim=1)


class NetworkImageNet(nn.Module):
    """Stem of three stride-2 convs, ``layers`` cells (reduction at 1/3 and 2/3), pool, linear.

    Input height and width must be multiples of 32 (224 in the papers).
    """

    def __init__(self, genotype: Genotype, C: int = 48, num_classes: int = 1000, layers: int = 14):
        super().__init__()
        self.stem0 = nn.Sequential(
            nn.Conv2d(3, C // 2, kernel_size=3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(C // 2),
            nn.ReLU(inplace=True),
            nn.Conv2d(C // 2, C, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(C),
        )
        # Hazard kept from the reference: this in-place ReLU overwrites stem0's output,
        # which the first cell reads again as s0 (harmless there: it starts with a ReLU),
        # so the traced graph has an in-place write on s0's storage.
        self.stem1 = nn.Sequential(
            nn.ReLU(inplace=True),
            nn.Conv2d(C, C, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(C),
        )
        c_prev_prev, c_prev, c_curr = C, C, C
        self.cells = nn.ModuleList()
        reduction_prev = True  # stem1 halved the size of stem0's output
        for i in range(layers):
            reduction = i in (layers // 3, 2 * layers // 3)
            if reduction:
                c_curr *= 2
            cell = Cell(genotype, c_prev_prev, c_prev, c_curr, reduction, reduction_prev)
            self.cells.append(cell)
            reduction_prev = reduction
            c_prev_prev, c_prev = c_prev, cell.multiplier * c_curr
        self.global_pooling = nn.AdaptiveAvgPool2d(1)  # = AvgPool2d(7) at 224x224
        self.classifier = nn.Linear(c_prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 3 or x.shape[2] % 32 or x.shape[3] % 32:
            raise ValueError(f"expected an image batch (N, 3, H, W) with H, W multiples of 32, got {tuple(x.shape)}")
        s0 = self.stem0(x)
        s1 = self.stem1(s0)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        out = self.global_pooling(s1)
        return self.classifier(torch.flatten(out, 1))


def nasnet_a_mobile(num_classes: int = 1000) -> NetworkImageNet:
    """NASNet-A mobile approximation: NASNet genotype, C=44, 14 cells (see module docstring)."""
    return NetworkImageNet(NASNet, C=44, num_classes=num_classes, layers=14)


def amoebanet(num_classes: int = 1000) -> NetworkImageNet:
    """AmoebaNet-A, ImageNet variant of Nimble's ``experiment/darts.py``: C=48, 14 cells."""
    return NetworkImageNet(AmoebaNet, C=48, num_classes=num_classes, layers=14)


def darts(num_classes: int = 1000) -> NetworkImageNet:
    """DARTS (V2), ImageNet variant of Nimble's ``experiment/darts.py``: C=48, 14 cells."""
    return NetworkImageNet(DARTS_V2, C=48, num_classes=num_classes, layers=14)
