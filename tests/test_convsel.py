"""nimble.convsel, the per-conv cuDNN/native choice, with a stand-in timer (no GPU)."""
import contextlib
import copy
import pickle

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from nimble import Nimble, NimbleError
from nimble.convsel import NativeConv2d, cudnn_disabled, select_conv_kernels, summarize


@contextlib.contextmanager
def conv2d_spy():
    """Record, for every F.conv2d call, whether cuDNN was enabled and the conv depthwise."""
    seen, original = [], F.conv2d

    def spy(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
        seen.append((torch.backends.cudnn.enabled, groups == x.shape[1] > 1))
        return original(x, w, bias, stride, padding, dilation, groups)

    F.conv2d = spy
    try:
        yield seen
    finally:
        F.conv2d = original


class DepthwiseFasterNative:
    """A stand-in timer: PyTorch's native kernel wins for depthwise convs, loses for the rest.
    It reads the cuDNN flag while the candidate runs, as a real timer's kernels would."""

    def __init__(self):
        self.calls = 0

    def __call__(self, with_cudnn, native):
        self.calls += 1
        with conv2d_spy() as seen:
            with_cudnn()
            native()
        (cudnn_on, depthwise), (cudnn_off, _) = seen
        assert cudnn_on == torch.backends.cudnn.enabled and cudnn_off is False
        return (1.0, 0.5) if depthwise else (1.0, 2.0)


def test_depthwise_convs_move_to_native_kernels_and_outputs_stay():
    model = torchvision.models.mobilenet_v2().eval()
    x = torch.randn(1, 3, 64, 64)
    timer = DepthwiseFasterNative()
    chosen, choices = select_conv_kernels(model, x, timer=timer)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    depthwise = [m for m in convs if m.groups == m.in_channels > 1]
    moved = [m for m in chosen.modules() if isinstance(m, NativeConv2d)]
    assert len(moved) == len(depthwise) == 17
    assert all(m.groups == m.in_channels for m in moved)
    assert not any(isinstance(m, NativeConv2d) for m in model.modules())   # input untouched
    # every signature timed once, not every module
    assert timer.calls == len(choices) < len(convs)
    assert sum(c.count for c in choices) == len(convs)
    assert sum(c.count for c in choices if c.native) == 17
    assert all(c.speedup == 2.0 for c in choices if c.native)
    assert "17 of 52 Conv2d" in summarize(choices)
    with torch.no_grad():
        assert torch.equal(chosen(x), model(x))         # same kernels on the CPU
    assert chosen.state_dict().keys() == model.state_dict().keys()


def test_a_native_conv_runs_without_cudnn_and_keeps_the_choice_when_copied():
    conv = nn.Conv2d(4, 4, 3, groups=4)
    conv.__class__ = NativeConv2d
    before = torch.backends.cudnn.enabled
    for copied in (conv, copy.deepcopy(conv), pickle.loads(pickle.dumps(conv))):
        with conv2d_spy() as seen:
            copied(torch.randn(1, 4, 6, 6))
        assert seen == [(False, True)], type(copied)
        assert torch.backends.cudnn.enabled == before     # restored after the call


def test_cudnn_disabled_restores_the_flag_on_errors():
    before = torch.backends.cudnn.enabled
    with pytest.raises(ZeroDivisionError):
        with cudnn_disabled():
            assert torch.backends.cudnn.enabled is False
            1 / 0
    assert torch.backends.cudnn.enabled == before


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Conv2d(3, 3, 3, padding=1, groups=3)
        self.dilated = nn.Conv2d(3, 3, 3, padding=2, dilation=2, groups=3)

    def forward(self, x):
        return self.dilated(self.shared(self.shared(x)))


def test_reused_and_dilated_convs_stay_on_cudnn_untimed():
    timer = DepthwiseFasterNative()
    chosen, choices = select_conv_kernels(Reused().eval(), torch.randn(1, 3, 8, 8), timer=timer)
    assert timer.calls == 0
    assert not any(isinstance(m, NativeConv2d) for m in chosen.modules())
    reasons = sorted(c.reason for c in choices)
    assert reasons[0].startswith("called 2 times") and reasons[1].startswith("dilated")
    assert all(c.cudnn_ms is None and c.speedup is None for c in choices)


class Lookalikes(Reused):
    """A plain conv shaped like the reused one, and one like the dilated one but undilated."""

    def __init__(self):
        super().__init__()
        self.plain = nn.Conv2d(3, 3, 3, padding=1, groups=3)
        self.undilated = nn.Conv2d(3, 3, 3, padding=2, groups=3)

    def forward(self, x):
        y = self.dilated(self.shared(self.shared(x)))
        return self.plain(y), self.undilated(x)


def test_lookalikes_of_reused_and_dilated_convs_are_still_timed():
    timer = DepthwiseFasterNative()
    chosen, choices = select_conv_kernels(Lookalikes().eval(), torch.randn(1, 3, 8, 8), timer=timer)
    assert timer.calls == 2
    assert isinstance(chosen.plain, NativeConv2d) and isinstance(chosen.undilated, NativeConv2d)
    assert not isinstance(chosen.shared, NativeConv2d) and not isinstance(chosen.dilated, NativeConv2d)
    assert sorted(c.native for c in choices) == [False, False, True, True]


def test_native_must_win_by_the_margin():
    model = nn.Sequential(nn.Conv2d(3, 8, 3)).eval()
    _, choices = select_conv_kernels(model, torch.randn(1, 3, 8, 8),   # native 2 % faster
                                     timer=lambda a, b: (1.0, 0.98), margin=0.03)
    assert not choices[0].native and choices[0].native_ms == 0.98
    chosen, choices = select_conv_kernels(model, torch.randn(1, 3, 8, 8),
                                          timer=lambda a, b: (1.0, 0.9), margin=0.03)
    assert choices[0].native and isinstance(chosen[0], NativeConv2d)


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="inference: call model.eval"):
        select_conv_kernels(nn.Conv2d(3, 3, 3), torch.randn(1, 3, 8, 8), timer=lambda a, b: (1.0, 1.0))
    with pytest.raises(ValueError, match="margin must be a fraction >= 0, got -0.1"):
        select_conv_kernels(nn.Conv2d(3, 3, 3).eval(), torch.randn(1, 3, 8, 8),
                            timer=lambda a, b: (1.0, 1.0), margin=-0.1)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            select_conv_kernels(nn.Conv2d(3, 3, 3).eval(), torch.randn(1, 3, 8, 8))
    with pytest.raises(NimbleError, match="select_convs times inference convolutions only"):
        Nimble(nn.Conv2d(3, 3, 3)).prepare(torch.randn(1, 3, 8, 8), training=True,
                                           select_convs=True)
