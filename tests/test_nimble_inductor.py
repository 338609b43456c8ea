"""Inductor-compiled segments on Nimble's streams (nimble.inductor): partitioning and equality
with eager on the CPU (segments run in order there), capture on the GPU."""
import operator

import pytest
import torch
import torchvision
from torch import nn

from compare import assert_matches_eager
from nimble import NimbleError
from nimble.inductor import InductorNimble, partition, trace_aten
from nimble.streams import assign_streams


class Branchy(nn.Module):
    """Three parallel branches between a stem and a head (three streams)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.c = nn.MaxPool2d(3, 1, 1)
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        x = self.stem(x).relu()
        y = torch.cat([self.a(x), self.b(x), self.c(x)], 1)
        return self.head(y.mean((2, 3)))


def test_segments_cover_every_op_once_in_dependency_order():
    m = torchvision.models.googlenet(aux_logits=False, init_weights=True).eval()
    gm = trace_aten(m, (torch.randn(1, 3, 64, 64),))
    segments, streams = partition(gm)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    placed = [n for s in segments for n in s.nodes]
    copied = {n for s in segments for n in s.sources}
    assert len(placed) == len(set(placed)) and set(placed) | copied <= set(ops)
    assert {n for n in ops if n.users} <= set(placed) | copied      # every live op runs
    made_by = {n: i for i, s in enumerate(segments) for n in s.nodes}
    for i, s in enumerate(segments):
        for a in s.inputs:          # made earlier, or a graph input / parameter
            assert a.op in ("placeholder", "get_attr") or made_by[a] < i
            if a in made_by and segments[made_by[a]].stream != s.stream:
                assert made_by[a] in s.waits      # a cross-stream read waits for its producer
        assert all(n.target is not operator.getitem or n.args[0] in s.nodes for n in s.nodes)
    assert 1 < streams <= assign_streams(len(placed), []).num_streams
    single, one = partition(gm, multi_stream=False)
    assert one == 1 and all(s.stream == 0 and not s.waits for s in single)


def test_branches_get_streams_and_weight_transposes_are_copied_in():
    gm = trace_aten(Branchy().eval(), (torch.randn(2, 3, 16, 16),))
    segments, streams = partition(gm)
    assert streams == 3
    head = segments[-1]
    assert [n.target for n in head.sources] == [torch.ops.aten.t.default]
    assert sorted(head.waits) == [2, 3]


def test_matches_eager_on_cpu_and_checks_calls():
    torch.manual_seed(0)
    m = Branchy().eval()
    x = torch.randn(2, 3, 16, 16)
    fast = InductorNimble(m).prepare(x, backend="aot_eager")
    assert fast.stats["streams"] == 3 and fast.stats["segments"] == 5
    for _ in range(2):
        x = torch.randn(2, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), m(x))
    with pytest.raises(NimbleError, match="prepared for shape"):
        fast(torch.randn(1, 3, 16, 16))
    with pytest.raises(NimbleError, match="prepared for 1 input"):   # not silently the old input
        fast()
    with pytest.raises(ValueError, match="eval"):
        InductorNimble(Branchy()).prepare(x)


def test_small_segments_run_as_traced_and_the_rest_is_compiled():
    """Segments under min_segment_ops ops have nothing to fuse: they run their ATen ops as
    traced (fewer compiles: half of NASNet-A mobile's segments hold one op), same results."""
    torch.manual_seed(0)
    m = Branchy().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = m(x)
    counts = {}
    for k in (1, 2, 1000):
        fast = InductorNimble(m).prepare(x, backend="aot_eager", min_segment_ops=k)
        counts[k] = fast.stats["compiled_segments"]
        torch.testing.assert_close(fast(x), ref)
    assert counts[1] == fast.stats["segments"] == 5 and counts[1000] == 0
    assert 0 < counts[2] <= counts[1]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="min_segment_ops: expected a positive int"):
            InductorNimble(m).prepare(x, backend="aot_eager", min_segment_ops=bad)


@pytest.mark.slow
def test_a_real_multi_branch_model_runs_segment_by_segment_like_eager():
    """GoogLeNet: 4 streams, 46 segments; aot_eager compiles fast and keeps ATen's numerics."""
    from experiments.models import build_model, example_input
    m = build_model("googlenet").eval()
    x = example_input("googlenet", 1, "cpu")
    fast = InductorNimble(m).prepare(x, backend="aot_eager")
    assert fast.stats["streams"] == 4 and fast.stats["segments"] > 20
    with torch.no_grad():
        torch.testing.assert_close(fast(x), m(x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [False, True])
def test_inductor_segments_match_eager_on_cpu(freeze):
    """Inductor's C++ kernels on a CPU; frozen, BatchNorm folds into its conv, and the global
    freezing flag is left as found."""
    torch.manual_seed(0)
    m = Branchy().eval()
    x = torch.randn(2, 3, 16, 16)
    fast = InductorNimble(m).prepare(x, freeze=freeze)
    assert torch._inductor.config.freezing is False
    with torch.no_grad():
        torch.testing.assert_close(fast(x), m(x), rtol=1e-5, atol=1e-5)


def test_freeze_keeps_weights_inside_the_segments():
    """freeze=True: no segment is fed a weight at call time (Inductor may fold them)."""
    torch.manual_seed(0)
    m = Branchy().eval()
    x = torch.randn(2, 3, 16, 16)
    plain = InductorNimble(m).prepare(x, backend="aot_eager")
    frozen = InductorNimble(m).prepare(x, backend="aot_eager", freeze=True)
    assert any(a.op == "get_attr" for s in plain.segments for a in s.feeds)
    assert not any(a.op == "get_attr" for s in frozen.segments for a in s.feeds)
    assert [[a.name for a in s.inputs] for s in frozen.segments] == \
        [[a.name for a in s.inputs] for s in plain.segments]          # the same partition
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), m(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="freeze: expected True or False, got 'yes'"):
        InductorNimble(m).prepare(x, backend="aot_eager", freeze="yes")


@pytest.mark.gpu
@pytest.mark.usefixtures("strict_fp32")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,freeze", [("googlenet", False), ("inception_v3", False),
                                         ("googlenet", True), ("mobilenet_v2", True)])
def test_inductor_under_nimble_matches_eager_on_gpu(name, freeze):
    from experiments.models import build_model, example_input
    m = build_model(name).cuda().eval()
    fast = InductorNimble(m).prepare(example_input(name, 1, "cuda"), freeze=freeze)
    assert (fast.stats["streams"] > 1) == (name != "mobilenet_v2")     # a chain: one stream
    assert_matches_eager(fast, m, name, 1, 1e-4)
