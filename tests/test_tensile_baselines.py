"""The methods of the TENSILE experiment (tensile.baselines) and the vDNN/Capuchin policies.

Every method trains a small CNN on CPU; the ones that only move or recompute tensors must
train exactly like vanilla. vDNN and Capuchin plans are checked against the simulator.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import tensile
from tensile.baselines import METHODS, LayerRuns, checkpoint_blocks, make_method, random_ops
from tensile.plan import Recompute
from tensile.api import Scheduler
from tensile.policies import capuchin_plan, is_conv, vdnn_plan
from tensile.simulate import simulate
from tensile.timeline import AccessTimeline

RATES = dict(peak_flops=1e10, peak_bytes_per_s=1e10, d2h_bw=1e10, h2d_bw=1e10)
SCHEDULED = ("tensile", "vdnn", "vdnn_all", "capuchin")
STEPS = 3


def make_cnn(dropout: float = 0.3) -> nn.Module:
    """Three conv blocks (BatchNorm, an in-place ReLU right after a conv, dropout) and a head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Dropout(dropout)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def make_vgg_like() -> nn.Module:
    """VGG's layout: one flat nn.Sequential of conv / in-place ReLU / pool, then a head."""
    torch.manual_seed(0)
    layers = []
    for i, o in [(3, 8), (8, 8), (8, 16), (16, 16)]:
        layers += [nn.Conv2d(i, o, 3, padding=1), nn.ReLU(inplace=True)]
        if o == 16:
            layers.append(nn.MaxPool2d(2))
    model = nn.Module()
    model.features = nn.Sequential(*layers)
    model.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 10))
    model.forward = lambda x: model.classifier(model.features(x))
    return model


def make_densenet() -> nn.Module:
    """A tiny torchvision DenseNet: its blocks append to the list of features they pass on."""
    torch.manual_seed(0)
    return torchvision.models.densenet.DenseNet(growth_rate=4, block_config=(2, 2),
                                                num_init_features=8, bn_size=2, num_classes=10)


def batches(n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))
            for _ in range(n)]


def opts_for(name: str) -> dict:
    if name in SCHEDULED:
        budget = {"budget": 0.7} if name == "capuchin" else {}
        return dict(RATES, simulate=True, copy_latency_ms=0.0, **budget)
    return {}


def train(name: str, make=make_cnn, **opts):
    """``STEPS`` SGD steps of ``name``; returns (model, losses, step)."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches()
    step = make_method(name, model, opt, F.cross_entropy, data[0], **(opts or opts_for(name)))
    torch.manual_seed(123)  # the same dropout masks for every method
    losses = [float(step(b)) for b in data]
    return model, losses, step


@pytest.fixture(scope="module")
def vanilla():
    return {make: train("vanilla", make) for make in (make_cnn, make_vgg_like, make_densenet)}


# --------------------------------------------------------------------------- every method

CAPTURED = ("graph", "tensile_graph", "checkpoint_graph", "streamed_graph")  # CUDA graphs: GPU tests


@pytest.mark.parametrize("name", [m for m in METHODS if m != "compile_budget" and m not in CAPTURED])
def test_every_method_takes_three_finite_steps(name):
    _, losses, step = train(name)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert isinstance(step.stats(), dict)


@pytest.mark.parametrize("name, match", [
    ("graph", "a CUDA graph needs a CUDA model; the model is on cpu"),
    ("checkpoint_graph", "a CUDA graph needs a CUDA model; the model is on cpu"),
    ("tensile_graph", r"tensile_graph captures a CUDA graph: it needs a CUDA model and no "
                      r"simulation \(model on cpu, simulate=None\)"),
    ("streamed_graph", r"streamed_graph captures a CUDA graph: it needs a CUDA model \(model on cpu\)"),
])
def test_captured_methods_say_they_need_cuda(name, match):
    model = make_cnn(dropout=0.0)   # checkpoint_graph refuses dropout first (below)
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    opts = {k: v for k, v in RATES.items()} if name == "tensile_graph" else {}
    with pytest.raises(ValueError, match=match):
        make_method(name, model, opt, F.cross_entropy, batches(1)[0], **opts)
    assert not hasattr(opt, "_tensile_streamed")   # refused before anything changed


def test_captured_checkpointing_refuses_a_model_that_draws_random_numbers():
    """Inside a capture, checkpoint cannot restore the RNG for a recompute: dropout would
    get another mask. Said before any CUDA work; the model's state is left as it was."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 10))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    with pytest.raises(ValueError, match=r"checkpoint_graph needs a model that draws no random "
                                         r"numbers .* this one runs bernoulli_"):
        make_method("checkpoint_graph", model, opt, F.cross_entropy, batches(1)[0])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert random_ops(make_cnn(dropout=0.3), batches(1)[0]) == {"bernoulli_"}
    assert random_ops(make_cnn(dropout=0.0), batches(1)[0]) == set()


@pytest.mark.parametrize("make", [make_cnn, make_vgg_like, make_densenet],
                         ids=["cnn", "vgg_like", "densenet"])
@pytest.mark.parametrize("name", ["checkpoint", "sac", "save_on_cpu", *SCHEDULED])
def test_memory_methods_train_like_vanilla(vanilla, name, make):
    model0, losses0, _ = vanilla[make]
    model, losses, _ = train(name, make)
    assert losses == pytest.approx(losses0, rel=1e-5)
    for (n, a), b in zip(model0.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{name}: parameter {n}")


def test_checkpoint_reports_its_blocks_and_scheduled_methods_their_report():
    assert train("checkpoint")[2].stats() == {"blocks": 3}
    rep = train("tensile")[2].stats()
    assert rep["steps"] == STEPS and rep["swaps_planned"] > 0 and rep["passive_swap_ins"] == 0


@pytest.mark.slow
def test_compile_budget_trains():
    """torch.compile with an activation memory budget (compiles on CPU: ~20 s). No dropout:
    compiled code draws its random numbers differently."""
    def make():
        return make_cnn(dropout=0.0)
    _, losses0, _ = train("vanilla", make)
    _, losses, step = train("compile_budget", make, activation_memory_budget=0.3)
    assert step.stats() == {"activation_memory_budget": 0.3}
    assert losses == pytest.approx(losses0, rel=1e-3)


def test_unknown_method_and_option_are_refused():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="unknown method 'bogus'; valid: vanilla, checkpoint"):
        make_method("bogus", model, opt, F.cross_entropy, batches(1)[0])
    with pytest.raises(ValueError, match=r"'checkpoint' takes options \['layers_per_block'\]"):
        make_method("checkpoint", model, opt, F.cross_entropy, batches(1)[0], budget=0.5)
    with pytest.raises(ValueError, match="capuchin needs a budget"):
        make_method("capuchin", model, opt, F.cross_entropy, batches(1)[0], simulate=True, **RATES)
    with pytest.raises(ValueError, match="activation_memory_budget must be in"):
        make_method("compile_budget", model, opt, F.cross_entropy, batches(1)[0],
                    activation_memory_budget=2)


# --------------------------------------------------------------------------- blocks

def test_checkpoint_blocks_of_torchvision_models():
    resnet = torchvision.models.resnet18(weights=None)
    units = checkpoint_blocks(resnet)  # 21 layers -> up to 5 per block: the 4 stages
    assert units == [resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4]
    units = checkpoint_blocks(resnet, layers_per_block=3)
    assert [type(u).__name__ for u in units] == ["BasicBlock"] * 8
    dense = torchvision.models.densenet121(weights=None)
    kinds = {type(u).__name__ for u in checkpoint_blocks(dense)}
    assert kinds == {"_DenseLayer", "_Transition"}
    assert len(checkpoint_blocks(dense)) == 58 + 3


def test_flat_sequentials_are_cut_into_runs_that_start_at_a_layer():
    model = make_vgg_like()
    units = checkpoint_blocks(model, layers_per_block=2)
    runs = [u for u in units if isinstance(u, LayerRuns)]
    assert len(runs) == 1 and runs[0].seq is model.features
    # conv relu conv relu | conv relu pool conv relu pool
    assert [len(r) for r in runs[0].runs] == [4, 6]
    assert all(isinstance(r[0], nn.Conv2d) for r in runs[0].runs)
    with pytest.raises(ValueError, match="layers_per_block must be >= 1"):
        checkpoint_blocks(model, layers_per_block=0)
    with pytest.raises(ValueError, match="no conv or linear layers"):
        checkpoint_blocks(nn.Sequential(nn.ReLU()))


# --------------------------------------------------------------------------- vDNN / Capuchin plans

@pytest.fixture(scope="module")
def timeline() -> AccessTimeline:
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters())
    sched = tensile.Scheduler(model, opt, batches(1)[0], F.cross_entropy, simulate=True,
                              replan=False, **RATES)
    return sched.timeline


def _conv_inputs(tl: AccessTimeline) -> set[int]:
    return {sid for k, name in enumerate(tl.names) if is_conv(name) and tl.phases[k] == "forward"
            for sid in tl.reads[k] if tl.tensors[sid].role == "activation"}


def _check_swaps(tl: AccessTimeline, plan) -> None:
    for s in plan.swaps:
        i, j = tl.backward_gap(s.sid)
        assert s.out_issue_op <= s.release_after_op and i <= s.release_after_op
        assert s.release_after_op <= s.in_issue_op < s.use_op == j
        assert s.out_start_ms <= s.out_end_ms and s.in_start_ms <= s.in_end_ms
    assert simulate(tl, plan).peak == plan.peak_after <= plan.peak_before


def test_vdnn_offloads_conv_inputs_and_prefetches_one_layer_ahead(timeline):
    tl = timeline
    plan = vdnn_plan(tl, d2h_bw=1e10, h2d_bw=1e10)
    swapped = {s.sid for s in plan.swaps}
    assert swapped and swapped == {s for s in _conv_inputs(tl) if tl.tensors[s].swappable}
    _check_swaps(tl, plan)
    uses = sorted(s.use_op for s in plan.swaps)
    bwd_start = tl.phases.index("backward")
    for s in plan.swaps:  # issued when backward reaches the previous offloaded tensor
        prev = [u for u in uses if u < s.use_op]
        assert s.in_issue_op == (prev[-1] if prev else bwd_start) - 1
    every = vdnn_plan(tl, d2h_bw=1e10, h2d_bw=1e10, layers="all")
    assert swapped < {s.sid for s in every.swaps}
    _check_swaps(tl, every)
    with pytest.raises(ValueError, match="'conv' .* or 'all'"):
        vdnn_plan(tl, d2h_bw=1e10, h2d_bw=1e10, layers="fc")


def test_copies_queue_on_one_stream_per_direction(timeline):
    plan = vdnn_plan(timeline, d2h_bw=1e6, h2d_bw=1e6, layers="all")  # slow: copies overlap
    outs = sorted((s.out_start_ms, s.out_end_ms) for s in plan.swaps)
    ins = sorted((s.in_start_ms, s.in_end_ms) for s in plan.swaps)
    for chan in (outs, ins):
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(chan, chan[1:]))
    assert plan.est_overhead_ms > 0  # swap-ins ending after their use stall compute


def test_capuchin_meets_a_budget_with_hidden_swaps_or_says_it_cannot(timeline):
    tl = timeline
    vanilla = int(tl.vanilla_curve().max())
    plan = capuchin_plan(tl, budget_bytes=int(0.95 * vanilla), d2h_bw=1e10, h2d_bw=1e10,
                         copy_latency_ms=0.0)
    assert plan.feasible and plan.peak_after <= 0.95 * vanilla and plan.swaps
    assert not plan.recomputes and plan.est_overhead_ms == 0
    _check_swaps(tl, plan)
    # TENSILE also moves parameters across the iteration boundary; Capuchin cannot follow.
    tight = tensile.plan(tl, d2h_bw=1e10, h2d_bw=1e10, copy_latency_ms=0.0).peak_after
    plan = capuchin_plan(tl, budget_bytes=tight, d2h_bw=1e10, h2d_bw=1e10, copy_latency_ms=0.0)
    assert not plan.feasible and plan.peak_after > tight
    _check_swaps(tl, plan)


def test_capuchin_recomputes_when_swaps_cannot_be_hidden(timeline):
    tl = timeline
    slow = capuchin_plan(tl, budget_bytes=int(0.85 * tl.vanilla_curve().max()),
                         d2h_bw=1e3, h2d_bw=1e3)
    assert slow.recomputes and not slow.swaps
    moved = {r.sid for r in slow.recomputes}
    for r in slow.recomputes:
        assert not set(r.sources) & moved and r.producer_op in tl.tensors[r.sid].writes
        assert not tl.random[r.producer_op]
    assert simulate(tl, slow).peak == slow.peak_after < slow.peak_before
    with pytest.raises(ValueError, match="Capuchin plans to a memory budget"):
        capuchin_plan(tl, budget_bytes=None, d2h_bw=1e10, h2d_bw=1e10)


def test_capuchin_swaps_the_tensor_with_the_most_free_time_first():
    # A and B are equally large; A's forward->backward gap is longer, so its free time is.
    ms = 1.0
    ops = [("aten.a", "forward", ms, [], [1]), ("aten.b", "forward", ms, [1], [2]),
           ("aten.c", "forward", ms, [2], [3]), ("aten.d", "forward", ms, [3], [4]),
           ("aten.loss", "loss", ms, [4], [5]), ("aten.gb", "backward", ms, [5, 2], [6]),
           ("aten.ga", "backward", ms, [6, 1], [7])]
    sizes = {1: 100, 2: 100, 3: 10, 4: 10, 5: 1, 6: 1, 7: 1}
    tl = AccessTimeline.from_ops(ops, sizes)
    peak = int(tl.vanilla_curve().max())
    plan = capuchin_plan(tl, budget_bytes=peak - 5, d2h_bw=1e9, h2d_bw=1e9, copy_latency_ms=0.0)
    assert [s.sid for s in plan.swaps] == [1] and not plan.recomputes and plan.feasible


def test_policy_scheduler_replans_with_measured_times():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches()
    sched = Scheduler(model, opt, data[0], F.cross_entropy, simulate=True, planner=vdnn_plan, **RATES)
    for b in data:
        sched.step(*b)
    rep = sched.report()
    assert rep.replans == 1 and rep.swaps_planned > 0
    assert rep.swap_ins == rep.swap_outs > 0 and rep.passive_swap_ins == 0
    assert all(isinstance(r, Recompute) for r in sched.plan.recomputes) and not sched.plan.recomputes
