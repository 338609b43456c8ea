"""experiments.headroom: K model copies on one stream vs K streams (the multi-stream ceiling)."""
import pytest
import torch
from torch import nn

from experiments import headroom


def test_unknown_model_and_bad_numbers_are_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        headroom.main(["--models", "resnet5O"])
    assert "unknown model 'resnet5O'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        headroom.main(["--models", "resnet50", "--batch", "1,x"])
    assert "expected comma-separated integers, got '1,x'" in capsys.readouterr().err


def test_one_copy_or_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="copies must be >= 2"):
        headroom.overlap("resnet50", 1, copies=1)
    with pytest.raises(ValueError, match="one input per model, got 2 models and 1 inputs"):
        headroom.capture_copies([nn.Identity(), nn.Identity()], [torch.zeros(1)], parallel=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without CUDA")
def test_without_cuda_the_cli_says_so(capsys):
    with pytest.raises(SystemExit):
        headroom.main(["--models", "resnet50"])
    assert "no CUDA device is available here" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copies_on_their_own_streams_compute_what_each_copy_computes_alone(tmp_path):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda().eval() for _ in range(3)]
    inputs = [torch.randn(2, 3, 16, 16, device="cuda") for _ in range(3)]
    outs = []
    for model in models:        # the outputs made during capture are the ones replays rewrite
        model.register_forward_hook(lambda m, i, o: outs.append(o))
    graph = headroom.capture_copies(models, inputs, parallel=True)
    static_outputs = outs[-3:]
    for x in inputs:            # fresh inputs in place, then one replay
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        for model, x, got in zip(models, inputs, static_outputs):
            torch.testing.assert_close(got, model[1](model[0](x)))

    headroom.main(["--models", "googlenet", "--batch", "1", "--copies", "2", "--iters", "100",
                   "--results", str(tmp_path)])
    import pandas as pd
    row = pd.read_csv(next(tmp_path.glob("*/headroom.csv"))).iloc[0]
    assert row["copies"] == 2 and row["iters"] == 100 and row["gpu"] != "cpu"
    assert 0.8 < row["overlap"] < 2.2           # two copies overlap between none and fully
    assert row["one_stream_ms"] > row["one_copy_ms"]
