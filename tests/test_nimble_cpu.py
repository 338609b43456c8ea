"""The parts of nimble.capture and nimble.passes that run without a GPU."""
import os
import weakref

import pytest
import timm
import torch
import torchvision
from torch import nn

from compare import rel_err
from nimble import Nimble, NimbleError, TaskGraph
from nimble import capture
from nimble.capture import (SERIALIZE_SHARES, cap_streams, fold_tiny_isolated_ops, serialize_hot,
                            serialize_ladder)
from nimble.memplan import lifetimes, live_bytes
from nimble.passes import fold_conv_bn, to_channels_last
from nimble.racecheck import find_races
from nimble.streams import assign_streams
from nimble.trace import trace_graph


def test_fold_conv_bn_torchvision_matches_and_leaves_original():
    m = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 64, 64)
    # non-trivial BN statistics, or folding is a no-op numerically
    for bn in (mod for mod in m.modules() if isinstance(mod, nn.BatchNorm2d)):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.uniform_(0.5, 1.5)
    folded, n = fold_conv_bn(m, x)
    assert n == 20                                   # every conv of resnet18 has its own BN
    assert sum(isinstance(mod, nn.BatchNorm2d) for mod in m.modules()) == 20   # original intact
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in folded.modules())
    with torch.no_grad():
        assert rel_err(folded(x), m(x)) < 1e-5
    g = trace_graph(folded, x)
    assert not any("batch_norm" in node.name for node in g.nodes)


def test_channels_last_copy_matches_and_leaves_original():
    m = torchvision.models.resnet18().eval()
    x, extra = torch.randn(2, 3, 64, 64), torch.randn(2, 5)
    cl, (x_cl, extra_out) = to_channels_last(m, (x, extra))
    assert m.conv1.weight.is_contiguous()                      # original untouched
    assert cl.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not cl.conv1.weight.is_contiguous()
    assert x_cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(x_cl, x)
    assert extra_out is extra                                  # not 4-D: left as it is
    with torch.no_grad():
        assert rel_err(cl(x_cl), m(x)) < 1e-5
    g = trace_graph(cl, x_cl)                                  # Nimble traces the NHWC copy
    assert len(g.nodes) > 0


def test_fold_conv_bn_timm_keeps_fused_activation():
    m = timm.create_model("efficientnet_b0", pretrained=False).eval()
    x = torch.randn(1, 3, 64, 64)
    folded, n = fold_conv_bn(m, x)
    assert n > 40
    with torch.no_grad():
        assert rel_err(folded(x), m(x)) < 1e-4


def test_conv_output_used_twice_is_not_folded():
    class TwoUsers(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y
    m = TwoUsers().eval()
    folded, n = fold_conv_bn(m, torch.randn(1, 3, 8, 8))
    assert n == 0 and isinstance(folded.bn, nn.BatchNorm2d)


def test_fold_needs_eval_mode():
    with pytest.raises(ValueError, match="eval mode"):
        fold_conv_bn(torchvision.models.resnet18(), torch.randn(1, 3, 32, 32))


def test_capped_plan_is_race_free():
    m = torchvision.models.googlenet(aux_logits=False, init_weights=True).eval()
    g = trace_graph(m, torch.randn(1, 3, 64, 64))
    plan = assign_streams(g.num_nodes, g.edges)
    assert plan.num_streams > 2
    capped = cap_streams(plan, g, 2)
    assert set(capped.stream_of) == {0, 1}
    assert find_races(g, capped.stream_of, capped.syncs, trials=20) == []
    assert find_races(g, plan.stream_of, plan.syncs, trials=20) == []


def test_batchnorm_counters_do_not_get_streams_of_their_own():
    """Training-mode BN adds 1 to num_batches_tracked: 53 isolated 8-byte ops in ResNet-50."""
    from nimble.training import trace_training_forward
    m = torchvision.models.resnet50(num_classes=10).train()
    g = trace_training_forward(m, (torch.randn(2, 3, 32, 32),))
    plan = assign_streams(g.num_nodes, g.edges)
    folded = fold_tiny_isolated_ops(plan, g)
    assert plan.num_streams > 50 and folded.num_streams == 2     # the residual branches
    assert folded.syncs == plan.syncs
    assert find_races(g, folded.stream_of, folded.syncs, trials=20) == []
    assert Nimble._make_plan(g, True, None).num_streams == 2
    # an isolated op that moves real data keeps its own stream
    heavy = fold_tiny_isolated_ops(plan, g, max_bytes=1)
    assert heavy.num_streams == plan.num_streams


def test_wrapping_and_call_order_errors():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        Nimble(lambda x: x)
    with pytest.raises(NimbleError, match="call prepare"):
        Nimble(nn.ReLU())(torch.randn(2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_prepare_without_cuda_says_so():
    with pytest.raises(NimbleError, match="needs a CUDA device"):
        Nimble(nn.ReLU().eval()).prepare(torch.randn(2))


def test_prepare_step_names_its_stream_choices():
    model = nn.Sequential(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NimbleError, match="use_multi_stream must be True, False or 'auto', got 'fast'"):
        Nimble(model).prepare_step(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long),
                                   nn.functional.cross_entropy, opt, use_multi_stream="fast")


def test_prepare_names_its_stream_choices_before_anything_runs():
    with pytest.raises(NimbleError, match="use_multi_stream must be True, False or 'auto', got 'fast'"):
        Nimble(nn.ReLU().eval()).prepare(torch.randn(2), use_multi_stream="fast")
    with pytest.raises(NimbleError, match="for training it is an option of prepare_step"):
        Nimble(nn.ReLU()).prepare(torch.randn(2), training=True, use_multi_stream="auto")


class FakeGraph:
    """A stand-in for a captured graph: replays in ``ms`` (patched ``replay_ms``)."""

    def __init__(self, ms):
        self.ms, self.released = ms, False

    def reset(self):
        self.released = True


def test_auto_keeps_the_faster_capture_and_its_state(monkeypatch):
    """use_multi_stream="auto" on stand-ins for the two captures: the graph that replays
    faster wins, with its plan, streams, outputs and stats; the loser's pool is released."""
    import nimble.capture as capture

    for multi_ms, single_ms, kept in ((1.0, 2.0, "multi"), (2.0, 1.0, "single")):
        fast = Nimble(nn.ReLU().eval())
        graphs = {"multi": FakeGraph(multi_ms), "single": FakeGraph(single_ms)}

        class Plan:
            num_streams = 3

        fast.plan, fast._streams, fast._cuda_graph = Plan(), ["s0", "s1", "s2"], graphs["multi"]
        fast._static_outputs, fast._out_spec, fast.graph = ["out-multi"], "spec", "task graph"
        fast.stats.num_streams, fast.stats.graph_pool_bytes = 3, 300

        def adopt(graph):
            assert graph == "task graph" and fast._use_multi_stream is False
            fast.plan, fast._streams = "one-stream plan", ["s0"]
            fast.stats.num_streams = 1

        def capture_forward():
            fast._cuda_graph, fast._static_outputs = graphs["single"], ["out-single"]
            fast.stats.graph_pool_bytes = 100

        monkeypatch.setattr(fast, "_adopt_graph", adopt)
        monkeypatch.setattr(fast, "_capture_forward", capture_forward)
        monkeypatch.setattr(capture, "replay_ms", lambda g, n: g.ms)
        fast._keep_faster_forward()
        assert fast._cuda_graph is graphs[kept] and not graphs[kept].released
        assert graphs["single" if kept == "multi" else "multi"].released
        assert fast._static_outputs == [f"out-{kept}"]
        assert (fast.stats.num_streams, fast.stats.graph_pool_bytes) == \
            ((3, 300) if kept == "multi" else (1, 100))
        assert fast.stats.notes[-1].startswith("use_multi_stream='auto': 3 streams")
        assert fast.stats.notes[-1].endswith("kept the streams" if kept == "multi" else "kept one stream")


def test_select_convs_keeps_the_faster_whole_graph(monkeypatch):
    """select_convs on stand-ins for the two captures: the graph with the selection is raced
    against the one with every conv on cuDNN; the faster keeps its module, outputs and stats;
    the loser's pool is released and native_convs is 0 when cuDNN wins."""
    import nimble.capture as capture

    for selected_ms, plain_ms, kept in ((1.0, 2.0, "selected"), (2.0, 1.0, "plain")):
        fast = Nimble(nn.ReLU().eval())
        graphs = {"selected": FakeGraph(selected_ms), "plain": FakeGraph(plain_ms)}
        modules = {"selected": nn.ReLU(), "plain": nn.ReLU()}
        fast._run_module, fast._cuda_graph = modules["selected"], graphs["selected"]
        fast._static_outputs, fast.stats.graph_pool_bytes, fast.stats.native_convs = ["out-sel"], 300, 7
        plan = fast.plan = object()

        def capture_forward():
            assert fast._run_module is modules["plain"] and fast.plan is plan
            fast._cuda_graph, fast._static_outputs = graphs["plain"], ["out-plain"]
            fast.stats.graph_pool_bytes = 100

        monkeypatch.setattr(fast, "_capture_forward", capture_forward)
        monkeypatch.setattr(capture, "replay_ms", lambda g, n: g.ms)
        fast._keep_faster_convs(modules["plain"])
        other = "plain" if kept == "selected" else "selected"
        assert fast._cuda_graph is graphs[kept] and not graphs[kept].released
        assert graphs[other].released and fast._run_module is modules[kept]
        assert (fast._static_outputs, fast.stats.graph_pool_bytes, fast.stats.native_convs) == \
            ((["out-sel"], 300, 7) if kept == "selected" else (["out-plain"], 100, 0))
        assert fast.stats.notes[-1].startswith(f"select_convs: {selected_ms:.3f} ms with the selection, "
                                               f"{plain_ms:.3f} ms with every conv on cuDNN")
        assert fast.stats.notes[-1].endswith("kept the selection" if kept == "selected" else "kept cuDNN")


def test_only_whole_step_training_is_refused_under_cuda_malloc_async(monkeypatch):
    """Inference and fwd-bwd captures run under cudaMallocAsync; whole-step ones fail there
    (measured), and only there."""
    import nimble.capture as capture
    from nimble.capture import check_whole_step_allocator
    monkeypatch.setattr(capture, "allocator_backend", lambda: "cudaMallocAsync")
    with pytest.raises(NimbleError, match="whole-step training capture .* not supported"):
        check_whole_step_allocator()
    monkeypatch.setattr(capture, "allocator_backend", lambda: "native")
    check_whole_step_allocator()


def test_prepare_step_is_refused_under_cuda_malloc_async_before_anything_runs(monkeypatch):
    import nimble.capture as capture
    monkeypatch.setattr(capture, "allocator_backend", lambda: "cudaMallocAsync")
    model = nn.Linear(4, 2)      # on the CPU: the allocator refusal comes before any check
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NimbleError, match="cudaMallocAsync"):
        Nimble(model).prepare_step(torch.randn(2, 4), torch.zeros(2, dtype=torch.long),
                                   nn.functional.cross_entropy, opt)


class _LoggedStream:
    """Stands in for a CUDA stream: logs the waits ScheduledMode makes."""

    def __init__(self, index: int, log: list) -> None:
        self.index, self.log = index, log

    def wait_stream(self, other: "_LoggedStream") -> None:
        self.log.append(("wait", self.index, other.index))


class _Held:
    """Stands in for a tensor ScheduledMode holds: logs when it is freed."""

    def __init__(self, name: str, log: list) -> None:
        weakref.finalize(self, log.append, ("free", name))


def test_join_frees_what_it_holds_on_its_own_stream_before_joining():
    """A held tensor is freed after its stream waited for the stream that read it and before
    the origin joins that stream (under cudaMallocAsync a free is a node on its stream)."""
    from nimble.capture import ScheduledMode
    from nimble.streams import StreamPlan

    log: list = []
    plan = StreamPlan(stream_of=[0, 1, 2], syncs=[], num_streams=3, chains=[], meg_edges=[])
    mode = ScheduledMode(TaskGraph(nodes=[], edges=[]), plan,
                         [_LoggedStream(i, log) for i in range(3)])
    mode.pending[1].append((_Held("made on 1, read on 2", log), 2, 2))
    mode.pending[2].append((_Held("made on 2, read on 0", log), 0, 0))
    mode.clock[2][0] = 0                       # stream 2 already follows that read
    mode.join()
    assert log == [("wait", 1, 2), ("free", "made on 1, read on 2"),
                   ("free", "made on 2, read on 0"),
                   ("wait", 0, 1), ("wait", 0, 2)]
    assert all(not refs for refs in mode.pending)


class _Graph:
    """Stands in for a captured graph: remembers its plan and whether it was released."""

    def __init__(self, plan, log: list) -> None:
        self.plan, self.released = plan, False
        log.append(self)

    def reset(self) -> None:                              # what release_graph calls
        self.released = True


def _off_stream_0(plan) -> int:
    return sum(s != 0 for s in plan.stream_of)


def _fake_fit(monkeypatch, pool_mib):
    """GoogLeNet's full plan (4 streams) on a Nimble whose capture is faked: the pool is
    ``pool_mib(plan)`` MiB; eager's peak 160 MiB with 10 MiB of weights (182 MiB of pool
    fit 1.2x). Returns the Nimble, its graph and the list of fake graphs made."""
    m = torchvision.models.googlenet(aux_logits=False, init_weights=True).eval()
    g = trace_graph(m, torch.randn(1, 3, 64, 64))
    fast = Nimble(m)
    fast.graph, fast.plan = g, Nimble._make_plan(g, True, None)
    fast._streams = [object()] * fast.plan.num_streams
    fast.stats.weights_bytes, fast.stats.eager_peak_bytes = 10 << 20, 160 << 20
    graphs: list = []

    def capture():
        fast._cuda_graph = _Graph(fast.plan, graphs)
        fast.stats.graph_pool_bytes = pool_mib(fast.plan) << 20
    monkeypatch.setattr(fast, "_capture_forward", capture)
    fast._capture_forward()
    return fast, g, graphs


def test_serialize_hot_moves_the_ops_at_the_memory_peak_to_stream_0():
    m = torchvision.models.googlenet(aux_logits=False, init_weights=True).eval()
    g = trace_graph(m, torch.randn(1, 3, 64, 64))
    full = Nimble._make_plan(g, True, None)
    live = live_bytes(lifetimes(g), g.num_nodes)
    previous = -1
    for share in SERIALIZE_SHARES:
        plan = serialize_hot(full, g, share)
        hot = [i for i in range(g.num_nodes) if live[i] >= share * live.max()]
        assert all(plan.stream_of[i] == 0 for i in hot)
        assert all(plan.stream_of[i] != 0 for i in range(g.num_nodes)
                   if i not in hot and full.stream_of[i] != 0)    # the rest keep their streams
        assert len(set(plan.stream_of)) == plan.num_streams
        assert sum(s == 0 for s in plan.stream_of) >= previous    # lower shares move more
        previous = sum(s == 0 for s in plan.stream_of)
        assert find_races(g, plan.stream_of, plan.syncs, trials=5) == []
    ladder = serialize_ladder(full, g)                    # one profile, repeats left out
    assert [share for share, _ in ladder] == sorted({share for share, _ in ladder}, reverse=True)
    assert all(a.stream_of != b.stream_of for (_, a), (_, b) in zip(ladder, ladder[1:]))
    for share, plan in ladder:
        assert plan.stream_of == serialize_hot(full, g, share).stream_of
    assert {tuple(serialize_hot(full, g, s).stream_of) for s in SERIALIZE_SHARES} == \
           {tuple(plan.stream_of) for _, plan in ladder}
    assert len(ladder) < len(SERIALIZE_SHARES)            # GoogLeNet's profile has repeats
    assert serialize_hot(full, g, 0.0).num_streams == 1
    assert serialize_hot(full, g, 1.0).num_streams == full.num_streams
    with pytest.raises(ValueError, match="share"):
        serialize_hot(full, g, 1.5)


def test_memory_limit_bisects_both_ladders_and_keeps_the_faster_fit(monkeypatch):
    """prepare(memory_limit=...)'s search with a fake capture: the pool grows with the ops
    off stream 0 and with the streams. Each ladder is bisected to its first fitting plan
    (checked against a plain scan); both fits race and the faster stays; every other
    capture is released."""
    def pool_mib(plan):
        return _off_stream_0(plan) + 30 * plan.num_streams
    allowed = 182
    for faster in ("serialized", "folded"):
        fast, g, graphs = _fake_fit(monkeypatch, pool_mib)
        full = fast.plan
        monkeypatch.setattr(capture, "race_graphs", lambda a, b, rounds, replays: (
            (1.0, 2.0) if faster == "serialized" else (2.0, 1.0)))
        monkeypatch.setattr(capture, "replay_ms", lambda graph, replays: 1.0)
        fast._fit_memory(1.2)
        share = next(s for s in SERIALIZE_SHARES if pool_mib(serialize_hot(full, g, s)) <= allowed)
        k = next(k for k in range(full.num_streams - 1, 1, -1)
                 if pool_mib(cap_streams(full, g, k)) <= allowed)
        want = serialize_hot(full, g, share) if faster == "serialized" else cap_streams(full, g, k)
        assert fast.plan.stream_of == want.stream_of and fast._cuda_graph.plan is fast.plan
        assert fast.stats.graph_pool_bytes == pool_mib(want) << 20 <= allowed << 20
        assert len(fast._streams) == fast.stats.num_streams == want.num_streams
        assert [x for x in graphs if not x.released] == [fast._cuda_graph]
        note = fast.stats.notes[-1]
        assert f"ops at >= {share:g} of the live peak on stream 0 " \
               f"{pool_mib(serialize_hot(full, g, share))} MiB" in note
        assert f"{k} streams {pool_mib(cap_streams(full, g, k))} MiB" in note
        times = ("1.000", "2.000") if faster == "serialized" else ("2.000", "1.000")
        assert f"serialized {times[0]} ms, folded {times[1]} ms" in note
        assert len(graphs) <= 2 + 4 + 2                   # full, ~log2 of each ladder
        assert find_races(g, fast.plan.stream_of, fast.plan.syncs, trials=5) == []


def test_memory_limit_falls_back_to_one_stream(monkeypatch):
    fast, g, graphs = _fake_fit(monkeypatch, lambda plan: 100 * plan.num_streams)
    fast._fit_memory(1.2)                                 # 182 MiB: only one stream fits
    assert fast.plan.num_streams == fast.stats.num_streams == len(fast._streams) == 1
    assert fast.stats.notes[-1].endswith("kept 1 stream (100 MiB)")
    assert [x for x in graphs if not x.released] == [fast._cuda_graph]
    kept = fast._cuda_graph
    fast._fit_memory(0.6)                                 # 86 MiB: not even one stream fits
    assert "not met even on one stream" in fast.stats.notes[-1]
    assert fast._cuda_graph is kept and not kept.released  # one stream: nothing to try


def test_memory_limit_keeps_the_capture_that_fitted(monkeypatch):
    """A plan that fits once need not fit when captured again (cudaMallocAsync's spans
    moved by up to 13 %): the search keeps the fitting capture, never a new one."""
    sizes = iter([220, 150, 200, 200, 200, 200, 200, 200, 200, 200])
    fast, g, graphs = _fake_fit(monkeypatch, lambda plan: next(sizes))
    fast._fit_memory(1.2)
    assert fast.stats.graph_pool_bytes == 150 << 20 and fast._cuda_graph is graphs[1]
    assert [x for x in graphs if not x.released] == [graphs[1]]


def test_memory_limit_must_be_positive():
    m = torchvision.models.googlenet(aux_logits=False, init_weights=True).eval()
    with pytest.raises(NimbleError, match="memory_limit"):
        Nimble(m).prepare(torch.randn(1, 3, 64, 64), memory_limit=0)


class _FakeStream:
    """Stands in for torch.cuda.Stream on the CPU: records waits."""
    log: list = []

    def __init__(self, device=None):
        self.cuda_stream = id(self)
        self.device = device

    def wait_stream(self, other):
        self.log.append(("wait_stream", self, other))

    def wait_event(self, event):
        self.log.append(("wait_event", self, event))


class _FakeEvent:
    def record(self, stream=None):
        pass


def test_conv_backward_split_gives_the_same_gradients(monkeypatch):
    """ConvBackwardSplitter's arithmetic and waits, with CUDA streams faked on the CPU."""
    import contextlib

    from nimble.training import ConvBackwardSplitter, _backward_on_streams
    main = _FakeStream()
    _FakeStream.log = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, bias=True))
    x = torch.randn(2, 3, 10, 10)
    net(x).square().sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    splitter = ConvBackwardSplitter()
    for p in net.parameters():          # accumulate into existing grads: an op reads them
        p.grad.zero_()
    _backward_on_streams([net(x).square().sum()], None, [main], splitter)
    assert splitter.splits == 1         # the first conv needs no input gradient
    for p, w in zip(net.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-6)
    side = splitter.side[main.cuda_stream]
    assert ("wait_stream", side, main) in _FakeStream.log            # fork after the inputs
    assert any(k == "wait_event" and s is main for k, s, _ in _FakeStream.log)  # grads read
    assert ("wait_stream", main, side) in _FakeStream.log            # joined at the end


def test_eager_peak_is_weights_plus_what_the_block_allocated_at_its_peak(monkeypatch):
    from types import SimpleNamespace
    from nimble.allocator import measure_eager_peak
    counters = {"allocated": 100, "reserved": 300, "max_allocated": 0, "max_reserved": 0}
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: counters["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: counters["max_allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: counters["max_reserved"])
    stats = SimpleNamespace(weights_bytes=40, eager_peak_bytes=0, eager_reserved_bytes=0)
    with measure_eager_peak(stats):
        counters.update(max_allocated=175, max_reserved=420)   # what the eager run reached
    assert (stats.eager_peak_bytes, stats.eager_reserved_bytes) == (40 + 75, 40 + 120)


def test_node_priority_graph_instantiates_with_the_flag_and_launches_on_the_current_stream(monkeypatch):
    import ctypes
    from types import SimpleNamespace
    from nimble import priority

    calls = []

    class FakeDriver:
        def cuGraphInstantiateWithFlags(self, out, graph, flags):
            calls.append(("instantiate", graph.value, flags.value))
            ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0xE1
            return 0

        def cuGraphLaunch(self, exec_, stream):
            calls.append(("launch", exec_.value, stream.value))
            return 0

        def cuGraphExecDestroy(self, exec_):
            calls.append(("destroy", exec_.value))
            return 0

    monkeypatch.setattr(priority, "_libcuda", lambda: FakeDriver())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0x5))
    captured = SimpleNamespace(raw_cuda_graph=lambda: 0xA0)
    g = priority.NodePriorityGraph(captured)
    g.replay()
    assert calls == [("instantiate", 0xA0, priority.USE_NODE_PRIORITY), ("launch", 0xE1, 0x5)]
    assert g.graph is captured                   # the pool's owner stays alive
    del g
    import gc
    gc.collect()
    assert calls[-1] == ("destroy", 0xE1)


def test_a_failed_instantiation_says_which_call(monkeypatch):
    from types import SimpleNamespace
    from nimble import priority
    fake = SimpleNamespace(cuGraphInstantiateWithFlags=lambda *a: 1, cuGraphLaunch=None,
                           cuGraphExecDestroy=None)
    monkeypatch.setattr(priority, "_libcuda", lambda: fake)
    with pytest.raises(RuntimeError, match=r"cuGraphInstantiateWithFlags\(USE_NODE_PRIORITY\) failed with CUresult 1"):
        priority.NodePriorityGraph(SimpleNamespace(raw_cuda_graph=lambda: 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA the setting comes from the environment")
def test_expandable_segments_are_read_from_either_allocator_variable(monkeypatch):
    from nimble.allocator import allocator_conf, expandable_segments
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert allocator_conf() == "" and not expandable_segments()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    assert expandable_segments()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")   # the newer name wins
    assert allocator_conf() == "expandable_segments:False" and not expandable_segments()
    assert expandable_segments("expandable_segments: true")


def test_allocator_environment_sets_both_variables_and_refuses_contradictions():
    from nimble.allocator import allocator_environment
    assert allocator_environment("native", {"PATH": "/bin"}) == {"PATH": "/bin"}   # the default
    env = allocator_environment("cudaMallocAsync", {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"})
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"] == \
        "max_split_size_mb:64,backend:cudaMallocAsync"
    assert allocator_environment("cudaMallocAsync", env) == env            # asked twice: unchanged
    older = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}         # the older name alone
    with pytest.raises(ValueError, match="environment asks for the 'cudaMallocAsync' allocator"):
        allocator_environment("native", older)
    with pytest.raises(ValueError, match="expected one of native, cudaMallocAsync, got 'async'"):
        allocator_environment("async", {})


def test_span_bytes_counts_overlapping_ranges_once():
    from nimble.allocator import span_bytes
    assert span_bytes([]) == 0
    assert span_bytes([(100, 50), (0, 10), (120, 10), (140, 20), (200, 1)]) == 10 + 60 + 1


def test_one_device_and_the_current_one_are_required():
    """Nimble's streams and capture are on the current device: a model on another GPU must
    say so before anything runs (torch.device objects need no GPU)."""
    from nimble.capture import check_one_device
    check_one_device({torch.device("cuda:1")}, current=1)
    check_one_device({torch.device("cuda")}, current=3)       # no index: the current device
    with pytest.raises(NimbleError, match=r"on cuda:1, but the current CUDA device is cuda:0.*set_device\(1\)"):
        check_one_device({torch.device("cuda:1")}, current=0)
    with pytest.raises(NimbleError, match="one CUDA device"):
        check_one_device({torch.device("cuda:0"), torch.device("cuda:1")}, current=0)


def test_an_optimizer_is_capturable_when_its_step_count_stays_on_the_device():
    """SGD keeps no step count; Adam keeps it on the host unless capturable or fused (then on
    the device, so a CUDA graph can hold the update); every param group must say so."""
    from nimble.training import check_capturable, is_capturable
    lin, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert is_capturable(torch.optim.SGD(lin.parameters(), lr=0.1))
    assert not is_capturable(torch.optim.Adam(lin.parameters()))
    assert is_capturable(torch.optim.Adam(lin.parameters(), capturable=True))
    assert is_capturable(torch.optim.Adam(lin.parameters(), fused=True))
    mixed = torch.optim.Adam([{"params": lin.parameters(), "capturable": True},
                              {"params": other.parameters()}])
    assert not is_capturable(mixed)
    with pytest.raises(ValueError, match=r"capturable=True \(or fused=True\)"):
        check_capturable(mixed)
