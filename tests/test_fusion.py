"""nimble.fusion: which convs fuse with their ReLU (and residual add), and a run that carries
the fusions out with CPU stand-ins for cuDNN's fused kernels (no GPU)."""
import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from nimble.fusion import (FusedRun, FusionMismatchError, find_conv_relu, summarize,
                           with_fusion_edges)
from nimble.passes import fold_conv_bn
from nimble.trace import OpRecorder, trace_graph

calls = {"relu": 0, "add_relu": 0}


def conv_relu(x, w, b, stride, padding, dilation, groups):
    calls["relu"] += 1
    return torch.relu(F.conv2d(x, w, b, stride, padding, dilation, groups))


def conv_add_relu(x, w, z, alpha, b, stride, padding, dilation, groups):
    calls["add_relu"] += 1
    return torch.relu(F.conv2d(x, w, b, stride, padding, dilation, groups) + alpha * z)


class FusedMode(OpRecorder):
    """Runs each op as the scheduled capture would with ``FusedRun``, on the CPU."""

    def __init__(self, fused: FusedRun):
        super().__init__()
        self.fused = fused

    def run_op(self, index, func, args, kwargs):
        if index is None:
            return func(*args, **kwargs)
        func, args, kwargs = self.fused.swap(index, func, args, kwargs)
        out = func(*args, **kwargs)
        self.fused.done(index, out)
        return out


def fused_output(model, x, fusions):
    run = FusedRun(fusions, kernels=(conv_relu, conv_add_relu))
    with torch.no_grad(), FusedMode(run):
        out = model(x)
    run.finish()
    return out


def found(model, x):
    graph = trace_graph(model, (x,))
    return graph, find_conv_relu(model, (x,), graph)


@pytest.mark.parametrize("name,convs,fused,with_add", [
    # ResNet-50: stem + 2 per bottleneck; the 12 blocks without downsample add x, the 4
    # with it compute the downsample after their last conv, which therefore stays apart.
    ("resnet50", 53, 45, 12),
    ("resnet18", 20, 14, 5),
    ("mobilenet_v2", 52, 0, 0),          # ReLU6 (not fused: slower) and linear bottlenecks
])
def test_torchvision_models_fuse_the_expected_convs_and_keep_their_outputs(name, convs, fused,
                                                                           with_add):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    x = torch.randn(1, 3, 64, 64)
    model, _ = fold_conv_bn(model, (x,))
    graph, fusions = found(model, x)
    assert sum(n.name == "aten.convolution.default" for n in graph.nodes) == convs
    assert (len(fusions), sum(f.z_from is not None for f in fusions)) == (fused, with_add)
    assert summarize(fusions, graph) == (f"fuse_relu: {fused} of {convs} convs run fused with "
                                         f"their ReLU ({with_add} with the residual add)")
    calls.update(relu=0, add_relu=0)
    with torch.no_grad():
        ref = model(x)
    got = fused_output(model, x, fusions)
    assert calls == {"relu": fused - with_add, "add_relu": with_add}
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


class Pattern(nn.Module):
    """One conv and what follows it, chosen by ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.pre = nn.Conv2d(4, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        z = self.pre(x)
        y = self.conv(x)
        k = self.kind
        if k == "relu_":
            return F.relu(y, inplace=True)
        if k == "relu":
            return F.relu(y)
        if k == "add_relu_":
            y += z
            return torch.relu_(y)
        if k == "add_relu":
            return F.relu(z + y)
        if k == "read_twice":
            return F.relu(y) + y
        if k == "output_too":
            return F.relu(y), y
        if k == "alpha":
            return F.relu(torch.add(y, z, alpha=2))
        if k == "z_after":
            late = self.pre(x)
            y += late
            return F.relu(y)
        if k == "z_view":
            return F.relu(y + z.view(z.shape))
        if k == "into_z":
            z += y
            return F.relu(z)
        if k == "relu6":
            return F.relu6(y)
        if k == "relu6_":
            return F.relu6(y, inplace=True)
        if k == "hardtanh":
            return F.hardtanh(y)
        raise ValueError(k)


@pytest.mark.parametrize("kind,fused,with_add", [
    ("relu_", 1, 0), ("relu", 1, 0), ("add_relu_", 1, 1), ("add_relu", 1, 1),
    # not fused: the pre-ReLU values are read elsewhere or returned, alpha is not 1, the
    # residual is made after the conv or is a view, the conv's output is added *into* z
    # (the sum must live in z's storage), or the activation is not a ReLU
    ("read_twice", 0, 0), ("output_too", 0, 0), ("alpha", 0, 0), ("z_after", 0, 0),
    ("z_view", 0, 0), ("into_z", 0, 0), ("relu6", 0, 0), ("relu6_", 0, 0), ("hardtanh", 0, 0),
])
def test_patterns(kind, fused, with_add):
    torch.manual_seed(0)
    model = Pattern(kind).eval()
    x = 10 * torch.randn(2, 4, 8, 8)        # large enough for a ReLU6's cap to matter
    graph, fusions = found(model, x)
    assert [f.conv for f in fusions] == [1] * fused        # node 0 is `pre`
    assert sum(f.z_from is not None for f in fusions) == with_add
    with torch.no_grad():
        ref = model(x)
    assert "relu6" not in kind or (ref == 6).sum() > 0     # a ReLU in its place would show
    torch.testing.assert_close(fused_output(model, x, fusions), ref)
    # the fused conv now reads z: the graph gets an edge from z's maker to it
    extra = set(with_fusion_edges(graph, fusions).edges) - set(graph.edges)
    assert extra == {(f.z_from[0], f.conv) for f in fusions if f.z_from}
    assert all(u < v for u, v in with_fusion_edges(graph, fusions).edges)


def test_a_run_that_leaves_the_pattern_is_an_error_not_a_wrong_result():
    model = Pattern("relu_").eval()
    x = torch.randn(2, 4, 8, 8)
    _, fusions = found(model, x)
    other = Pattern("hardtanh").eval()  # same ops up to the conv, then not a ReLU
    other.load_state_dict(model.state_dict())
    with pytest.raises(FusionMismatchError, match="expected to be the ReLU of fused conv #1.s output"):
        fused_output(other, x, fusions)
    # a run that stops short of the ReLU: finish() says so
    run = FusedRun(fusions, kernels=(conv_relu, conv_add_relu))
    run.done(1, torch.zeros(1))
    with pytest.raises(FusionMismatchError, match="never reached their ReLU"):
        run.finish()


def test_fuse_relu_is_refused_for_training():
    from nimble import Nimble, NimbleError
    # refused before anything needs a GPU
    with pytest.raises(NimbleError, match="fuse_relu fuses inference convolutions only"):
        Nimble(torchvision.models.resnet18()).prepare(torch.randn(2, 3, 64, 64), training=True,
                                                      fuse_relu=True)
