"""Argument types shared by the experiments' command lines."""
from __future__ import annotations

import argparse

from .models import get_model

__all__ = ["int_list", "model_list"]


def int_list(text: str) -> list[int]:
    """``"1,32"`` -> ``[1, 32]`` (an argparse ``type``: a bad value is a usage error)."""
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def model_list(text: str) -> list[str]:
    """``"resnet50,darts"`` -> the names, each checked against :mod:`experiments.models` (an
    argparse ``type``: an unknown name fails before anything is measured)."""
    names = [m for m in text.split(",") if m]
    for name in names:
        try:
            get_model(name)
        except KeyError as exc:
            raise argparse.ArgumentTypeError(str(exc.args[0])) from None
    return names
