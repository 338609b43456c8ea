"""experiments.conv_workspace: a model's convs found by shape, caps parsed, a backward timed
under a workspace cap (GPU)."""
from __future__ import annotations

import argparse

import pytest
import torch

from experiments import conv_workspace as cw


def model() -> torch.nn.Module:
    """Two convs, the second strided and grouped, one called twice."""
    body = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, bias=False)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 5, padding=2), torch.nn.ReLU(), body, body)


def test_the_convs_are_found_in_call_order_with_what_rebuilds_them():
    layers = cw.conv_layers(model(), torch.randn(2, 3, 16, 16))
    assert [(c.index, c.name) for c in layers] == [(0, "0"), (1, "2"), (2, "2")]
    first, second, third = layers
    assert first.input_shape == (2, 3, 16, 16) and not first.input_grad and first.bias
    assert first.kernel_size == (5, 5) and first.padding == (2, 2)
    assert second.input_shape == (2, 8, 16, 16) and second.input_grad
    assert second.stride == (2, 2) and second.groups == 2 and not second.bias
    assert third.input_shape == (2, 8, 8, 8)
    conv, x = second.build("cpu")
    assert conv(x).shape == (2, 8, 8, 8) and x.requires_grad


def test_a_padding_given_by_name_is_refused():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding="same"))
    with pytest.raises(ValueError, match=r"0: padding='same': expected numbers"):
        cw.conv_layers(net, torch.randn(1, 3, 8, 8))


def test_caps_parse_in_mib_and_bad_ones_say_what_was_expected():
    assert cw.parse_caps("none, 200,0") == [None, 200.0, 0.0]
    for bad, said in (("-1", "'-1'"), ("x", "'x'"), ("nan", "'nan'"), (",", "got none")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            cw.parse_caps(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without CUDA")
def test_without_cuda_the_cli_says_so(capsys):
    with pytest.raises(SystemExit):
        cw.main(["--model", "vgg16"])
    assert "no CUDA device is available here" in capsys.readouterr().err


def test_one_model_at_a_time(capsys):
    with pytest.raises(SystemExit):
        cw.main(["--model", "vgg16,resnet50"])
    assert "--model: expected one model, got ['vgg16', 'resnet50']" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_backward_under_no_workspace_runs_a_plan_that_takes_none():
    layer = cw.conv_layers(torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1),
                                               torch.nn.Conv2d(32, 32, 3, padding=1)),
                           torch.randn(8, 3, 128, 128))[1]   # its input gradient: 16 MiB
    free = cw._measure_in_child(layer, None, 100)
    capped = cw._measure_in_child(layer, 0.0, 100)
    assert free["status"] == capped["status"] == "ok", (free, capped)
    assert capped["workspace_mb"] <= 2.0 and capped["workspace_mb"] <= free["workspace_mb"] + 2.0
    assert 0 < capped["bwd_p10_ms"] <= capped["bwd_median_ms"] <= capped["bwd_p90_ms"]


def test_a_gradients_new_segment_is_what_the_allocator_would_reserve():
    mib = 2**20
    assert cw._segment_bytes(1000) == cw._segment_bytes(mib) == 2 * mib
    assert cw._segment_bytes(mib + 1) == cw._segment_bytes(10 * mib - 1) == 20 * mib
    assert cw._segment_bytes(10 * mib) == 10 * mib and cw._segment_bytes(16 * mib + 1) == 18 * mib
