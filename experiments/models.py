"""The model zoo: every network the suite uses, by name, with its input size and origin.

Models come from torchvision, timm and :mod:`experiments.nasnets` (NASNet-A mobile,
AmoebaNet, DARTS). Weights are never downloaded: every model is randomly initialised
(under a fixed seed, so two builds are identical), which is all the scheduling
experiments need and keeps the suite offline.

``ModelSpec.in_paper`` is True for the models of the Nimble paper's experiments
(``experiment/models.json`` of snuspl/nimble) and of the TENSILE paper's experiments;
the others are extras with interesting branch structure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import timm
import torch
import torchvision.models as tvm
from torch import nn

from experiments import nasnets

__all__ = [
    "ModelSpec",
    "MODELS",
    "ANALYSIS_SET",
    "PAPER_INFERENCE_SET",
    "get_model",
    "build_model",
    "check_image_size",
    "example_input",
]

BUILD_SEED = 0  # parameter init seed: every build of a model has the same weights


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry.

    ``build(num_classes=1000)`` returns a fresh, randomly initialised module (train mode,
    as the library leaves it; :func:`build_model` sets eval mode). ``image_size`` is the
    ImageNet input side the papers used; ``min_image_size`` the smallest side the network
    runs at (below it, its downsampling leaves a feature map smaller than a kernel).
    """

    name: str
    build: Callable[..., nn.Module]
    image_size: int
    num_classes: int = 1000
    source: str = ""
    in_paper: bool = False
    min_image_size: int = 1


def _torchvision(name: str, **kwargs) -> Callable[..., nn.Module]:
    """A builder for ``torchvision.models.<name>(weights=None, **kwargs)``."""
    fn = getattr(tvm, name)

    def build(num_classes: int = 1000) -> nn.Module:
        return fn(weights=None, num_classes=num_classes, **kwargs)

    return build


def _timm(name: str) -> Callable[..., nn.Module]:
    """A builder for ``timm.create_model(name, pretrained=False)``."""

    def build(num_classes: int = 1000) -> nn.Module:
        return timm.create_model(name, pretrained=False, num_classes=num_classes)

    return build


def _spec(name: str, build: Callable[..., nn.Module], image_size: int, source: str, in_paper: bool,
          min_image_size: int = 1) -> ModelSpec:
    return ModelSpec(name=name, build=build, image_size=image_size, source=source, in_paper=in_paper,
                     min_image_size=min_image_size)


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        # The Nimble paper's inference set (snuspl/nimble experiment/models.json).
        _spec("resnet50", _torchvision("resnet50"), 224, "torchvision resnet50", True),
        _spec("resnet101", _torchvision("resnet101"), 224, "torchvision resnet101", True),
        # As Nimble's experiment/utils.py builds it; in eval mode the aux head is skipped. At
        # least 75 px in eval mode and in training without the aux head (which the TENSILE
        # experiments drop: in training it needs 299).
        _spec("inception_v3",
              _torchvision("inception_v3", aux_logits=True, transform_input=False, init_weights=True),
              299, "torchvision inception_v3(aux_logits=True, transform_input=False)", True, 75),
        _spec("mobilenet_v2", _torchvision("mobilenet_v2"), 224, "torchvision mobilenet_v2", True),
        _spec("efficientnet_b0", _timm("efficientnet_b0"), 224, "timm efficientnet_b0", True),
        _spec("efficientnet_b5", _timm("efficientnet_b5"), 456, "timm efficientnet_b5", True),
        _spec("nasnet_a_mobile", nasnets.nasnet_a_mobile, 224,
              "experiments.nasnets: NASNet genotype of quark0/darts, C=44, 14 cells "
              "(the paper used pretrainedmodels nasnetamobile)", True),
        _spec("nasnet_a_large", _timm("nasnetalarge"), 331, "timm nasnetalarge", True),
        _spec("amoebanet", nasnets.amoebanet, 224,
              "experiments.nasnets: AmoebaNet genotype of quark0/darts, C=48, 14 cells", True),
        _spec("darts", nasnets.darts, 224,
              "experiments.nasnets: DARTS_V2 genotype of quark0/darts, C=48, 14 cells", True),
        # Extras with branches (not in the Nimble paper).
        _spec("googlenet", _torchvision("googlenet", aux_logits=False, init_weights=True), 224,
              "torchvision googlenet(aux_logits=False)", False),
        # densenet121, vgg16 and inception_v4 are the TENSILE paper's models.
        _spec("densenet121", _torchvision("densenet121"), 224, "torchvision densenet121", True),
        _spec("pnasnet5large", _timm("pnasnet5large"), 331, "timm pnasnet5large", False),
        _spec("vgg16", _torchvision("vgg16"), 224, "torchvision vgg16", True),
        _spec("inception_v4", _timm("inception_v4"), 299, "timm inception_v4", True, 75),
    ]
}

# The stream analysis (experiments/analysis.py), in table order.
ANALYSIS_SET: list[str] = [
    "resnet50", "resnet101", "inception_v3", "mobilenet_v2", "efficientnet_b0", "efficientnet_b5",
    "nasnet_a_mobile", "nasnet_a_large", "amoebanet", "darts", "googlenet", "densenet121",
    "pnasnet5large",
]

# The models of the Nimble paper's inference figure.
PAPER_INFERENCE_SET: list[str] = [
    "resnet50", "resnet101", "inception_v3", "nasnet_a_mobile", "nasnet_a_large",
    "mobilenet_v2", "efficientnet_b0", "efficientnet_b5",
]


def get_model(name: str) -> ModelSpec:
    """The registry entry for ``name``; KeyError naming the valid names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}") from None


def build_model(name: str, *, num_classes: int | None = None, pretrained: bool = False) -> nn.Module:
    """A freshly initialised model in eval mode, on CPU.

    ``num_classes`` defaults to the spec's (1000); pass 10 for the CIFAR-10-shaped
    training experiments. Initialisation runs under a fixed seed without touching the
    caller's RNG state, so two builds have identical weights.
    """
    spec = get_model(name)
    if pretrained:
        raise ValueError(f"pretrained weights are not supported for {name!r}: the suite never downloads weights")
    if num_classes is not None and num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILD_SEED)
        model = spec.build(num_classes=num_classes or spec.num_classes)
    return model.eval()


def check_image_size(name: str, image_size: int) -> None:
    """Raise a ValueError naming the model's smallest input side if ``image_size`` is below it
    (or below 1): caught here, not as a kernel-size error deep inside the network."""
    spec = get_model(name)
    least = max(1, spec.min_image_size)
    if image_size < least:
        raise ValueError(f"{name} needs inputs of at least {least} px a side (its own size is "
                         f"{spec.image_size}), got image_size={image_size}")


def example_input(name: str, batch_size: int, device: str | torch.device = "cpu",
                  image_size: int | None = None, seed: int = 0) -> torch.Tensor:
    """A random ``(batch_size, 3, S, S)`` float32 image batch, same values for the same seed.

    ``S`` is the model's ``image_size`` unless ``image_size`` overrides it (32 for the
    CIFAR-10-shaped experiments).
    """
    spec = get_model(name)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    size = spec.image_size if image_size is None else image_size
    check_image_size(name, size)
    g = torch.Generator().manual_seed(seed)  # CPU generator: same values on every device
    return torch.randn(batch_size, 3, size, size, generator=g).to(device)
