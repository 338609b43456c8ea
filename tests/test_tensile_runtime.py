"""TENSILE runtime in simulation mode (CPU tensors): the bookkeeping of a real training job.

Swap-only plans must train bit-identically to vanilla; recomputation within tolerance;
a swap-in planned too late must be done on demand and counted as passive.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics

import pytest
import torch
from torch import nn

import tensile
from tensile.runtime import PlanMismatchError
from tensile.step import training_step

from resnet_block import make_densenet, make_resnet

STEPS = 20
FAST = dict(peak_flops=1e10, peak_bytes_per_s=1e10, copy_latency_ms=0.0)
RTOL, ATOL = 1e-5, 1e-6  # the stated tolerance for plans with recomputation


def make_cnn(dropout: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
              nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()]
    if dropout:
        layers.append(nn.Dropout(0.3))
    layers.append(nn.Linear(16 * 4 * 4, 10))
    return nn.Sequential(*layers)


def batches(n: int = STEPS, batch: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def vanilla(n: int = STEPS, dropout: bool = False):
    model = make_cnn(dropout)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(123)
    losses = [training_step(model, opt, b, nn.functional.cross_entropy) for b in batches(n)]
    return model, opt, losses


def scheduled(n: int = STEPS, dropout: bool = False, **kwargs):
    model = make_cnn(dropout)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(n)
    torch.manual_seed(123)
    sched = tensile.Scheduler(model, opt, data[0], nn.functional.cross_entropy, **(FAST | kwargs))
    losses = [sched.step(*b) for b in data]
    sched.restore_parameters()
    return model, opt, losses, sched


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for p in model.parameters():
        out += [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


@pytest.fixture(scope="module")
def reference():
    return vanilla()


def test_swap_only_plan_is_bit_identical_after_20_adam_steps(reference):
    model0, opt0, losses0 = reference
    model, opt, losses, sched = scheduled(budget=None, allow_recompute=False,
                                          d2h_bw=1e12, h2d_bw=1e12)
    kinds = {s.cross_iteration for s in sched.plan.swaps}
    assert kinds == {True, False}, "the plan should move activations and parameters/state"
    for a, b in zip(state_tensors(model0, opt0), state_tensors(model, opt)):
        assert torch.equal(a, b)
    assert [float(x) for x in losses] == [float(x) for x in losses0]
    rep = sched.report()
    assert rep.steps == STEPS and rep.swap_outs > STEPS and rep.swap_ins > STEPS
    assert rep.passive_swap_ins == 0 and rep.recomputes == 0
    assert rep.ineffective_releases == 0  # every released activation was really freed
    assert rep.replans >= 1               # after the first measured step
    # a copy-out whose next step never came (the last step, a re-plan) is not copied back
    assert rep.bytes_d2h >= rep.bytes_h2d > 0


def test_timed_steps_time_every_copy_of_their_step():
    """A timed step's copies are what the report's measured bandwidth is made of: exactly
    the bytes that step moved, each direction on its own, none from untimed steps."""
    _, _, _, sched = scheduled(n=3, budget=None, allow_recompute=False, d2h_bw=1e12, h2d_bw=1e12,
                               replan=False)
    runner, stats = sched.runner, sched.runner.stats
    assert sched.plan.swaps
    data = batches(2)
    before = dataclasses.replace(stats)
    runner.step(data[0])                       # untimed: moves bytes, times none
    assert stats.timed_steps == before.timed_steps
    assert stats.timed_d2h_bytes == before.timed_d2h_bytes and stats.bytes_d2h > before.bytes_d2h
    mid = dataclasses.replace(stats)
    runner.step(data[1], measure_ops=True)     # timed: every copy it made is counted
    assert stats.timed_steps == mid.timed_steps + 1
    assert stats.timed_d2h_bytes - mid.timed_d2h_bytes == stats.bytes_d2h - mid.bytes_d2h > 0
    assert stats.timed_h2d_bytes - mid.timed_h2d_bytes == stats.bytes_h2d - mid.bytes_h2d > 0
    assert stats.timed_d2h_ms > mid.timed_d2h_ms and stats.timed_h2d_ms > mid.timed_h2d_ms
    sched.restore_parameters()
    rep = sched.report()
    assert rep.plan_iteration_ms == sched.plan.iteration_ms > 0
    assert rep.plan_d2h_bytes_per_s == 1e12
    text = str(rep)
    assert f"plan made for a {sched.plan.iteration_ms:.2f} ms iteration" in text
    assert "1000.0 GB/s D2H" in text and f"timed steps ({rep.timed_steps}) measured" in text


def test_recompute_plan_matches_within_tolerance(reference):
    model0, opt0, _ = reference
    model, opt, _, sched = scheduled(budget=0.9, allow_cross_iteration=False,
                                     d2h_bw=1e3, h2d_bw=1e3, replan=False)
    assert sched.plan.recomputes and not sched.plan.swaps
    assert sched.report().recomputes == STEPS * len(sched.plan.recomputes)
    for a, b in zip(state_tensors(model0, opt0), state_tensors(model, opt)):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    # batch norm writes its running statistics: a recompute reruns it on scratch copies
    tl = sched.timeline
    for r in sched.plan.recomputes:
        assert ("batch_norm" in tl.names[r.producer_op]) == bool(r.scratch)


def test_an_overhead_allowance_recomputes_without_a_budget_and_trains_the_same(reference):
    model0, opt0, _ = reference
    model, opt, _, sched = scheduled(budget=None, max_overhead=0.2, allow_cross_iteration=False,
                                     d2h_bw=1e3, h2d_bw=1e3, replan=False)
    assert sched.plan.recomputes and sched.plan.budget_bytes is None
    assert sched.plan.est_overhead_ms <= 0.2 * sched.timeline.iteration_ms
    assert sched.plan.peak_after < sched.plan.peak_before
    for a, b in zip(state_tensors(model0, opt0), state_tensors(model, opt)):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="max_overhead=0.1 is an option of TENSILE's own planner"):
        tensile.Scheduler(make_cnn(), torch.optim.Adam(make_cnn().parameters()), batches(1)[0],
                          nn.functional.cross_entropy, max_overhead=0.1, planner=lambda *a, **k: None)
    with pytest.raises(ValueError, match="allow_swaps=False is an option of TENSILE's own planner"):
        tensile.Scheduler(make_cnn(), torch.optim.Adam(make_cnn().parameters()), batches(1)[0],
                          nn.functional.cross_entropy, allow_swaps=False, planner=lambda *a, **k: None)


def test_a_recompute_only_scheduler_plans_no_swaps_and_trains_the_same(reference):
    """``allow_swaps=False`` under a budget that swaps would help reach (fast copies): the
    plan recomputes only and training matches the reference (the planner's tests show the
    contrast with swaps allowed)."""
    model0, opt0, _ = reference
    model, opt, _, sched = scheduled(budget=300_000, allow_cross_iteration=False,
                                     d2h_bw=1e12, h2d_bw=1e12, replan=False, allow_swaps=False)
    assert sched.plan.recomputes and not sched.plan.swaps
    assert sched.plan.peak_after < sched.plan.peak_before
    for a, b in zip(state_tensors(model0, opt0), state_tensors(model, opt)):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def test_late_swap_in_is_done_on_demand_and_counted(reference):
    n = 4
    model0, opt0, _ = vanilla(n)
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(n)
    torch.manual_seed(123)
    sched = tensile.Scheduler(model, opt, data[0], nn.functional.cross_entropy, replan=False,
                              allow_recompute=False, d2h_bw=1e12, h2d_bw=1e12, **FAST)
    last = sched.plan.num_ops - 1
    late = copy.deepcopy(sched.plan)
    # Every swap-in deliberately after the op that needs it back.
    late.swaps = [dataclasses.replace(s, in_issue_op=last) for s in late.swaps]
    sched.runner.set_plan(late)
    for b in data:
        sched.step(*b)
    sched.restore_parameters()
    rep = sched.report()
    transient = sum(not s.cross_iteration for s in late.swaps)
    cross = sum(s.cross_iteration for s in late.swaps)
    assert transient and cross
    # Transient: every step. Cross-iteration: step 1 creates the optimizer state (run
    # unplanned), step 2 copies out for the first time, steps 3.. bring back on demand.
    assert rep.passive_swap_ins == n * transient + (n - 2) * cross
    assert rep.passive_share == 1.0
    for a, b in zip(state_tensors(model0, opt0), state_tensors(model, opt)):
        assert torch.equal(a, b)


def test_dropout_model_is_bit_identical_and_never_recomputes_dropout():
    model0, opt0, _ = vanilla(6, dropout=True)
    model, opt, _, sched = scheduled(6, dropout=True, budget=0.8, d2h_bw=1e12, h2d_bw=1e12)
    tl = sched.timeline
    assert any(tl.random)
    assert not any(tl.random[r.producer_op] for r in sched.plan.recomputes)
    for a, b in zip(state_tensors(model0, opt0), state_tensors(model, opt)):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def test_construction_leaves_model_optimizer_and_rng_untouched():
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    sched = tensile.Scheduler(model, opt, batches(1)[0], nn.functional.cross_entropy, **FAST,
                              d2h_bw=1e9, h2d_bw=1e9)
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(opt.state) == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert sched.recording.graph.num_nodes == sched.plan.num_ops


def test_a_batch_of_other_shapes_is_rejected_before_running():
    model, opt, _, sched = scheduled(2, d2h_bw=1e12, h2d_bw=1e12)
    x, y = batches(1, batch=4)[0]
    with pytest.raises(ValueError, match="differs from the example batch"):
        sched.step(x, y)


def test_data_dependent_model_raises_plan_mismatch_and_stays_usable():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = make_cnn()

        def forward(self, x):
            out = self.net(x)
            return out.relu() if x.sum() > 0 else out.tanh()

    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.Adam(model.parameters())
    pos, neg = batches(1)[0], batches(1)[0]
    pos = (pos[0].abs(), pos[1])
    neg = (-neg[0].abs(), neg[1])
    sched = tensile.Scheduler(model, opt, pos, nn.functional.cross_entropy, d2h_bw=1e12,
                              h2d_bw=1e12, replan=False, **FAST)
    sched.step(*pos)
    sched.step(*pos)
    with pytest.raises(PlanMismatchError, match="op sequence changed"):
        sched.step(*neg)
    for p in model.parameters():  # swapped parameters were brought back from the host
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    sched.step(*pos)              # the recorded branch still works


def test_model_that_returns_its_loss():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = make_cnn()

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.net(x), y)

    torch.manual_seed(0)
    model = WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = batches(3)
    sched = tensile.Scheduler(model, opt, data[0], None, d2h_bw=1e12, h2d_bw=1e12, **FAST)
    losses = [sched.step(*b) for b in data]
    assert all(torch.isfinite(x) for x in losses)
    assert "TENSILE after 3 steps" in str(sched.report())


@pytest.mark.parametrize("budget, err", [(True, TypeError), ("1GB", TypeError),
                                         (1.5, ValueError), (0.0, ValueError), (-5, ValueError)])
def test_bad_budgets_are_rejected(budget, err):
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(err):
        tensile.Scheduler(model, opt, batches(1)[0], nn.functional.cross_entropy, budget=budget,
                          d2h_bw=1e9, h2d_bw=1e9, **FAST)


def test_a_budget_no_plan_meets_is_said_once_with_what_holds_the_peak():
    """Adam's state staying put (no moves across iterations), a budget of a tenth of the
    peak is out of reach: said at the cold start, not again on the re-plan."""
    import warnings
    data = batches(3)
    for allow_recompute in (True, False):
        model = make_cnn()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with pytest.warns(UserWarning, match="no plan meets the budget") as said:
            sched = tensile.Scheduler(model, opt, data[0], nn.functional.cross_entropy,
                                      budget=0.1, d2h_bw=1e9, h2d_bw=1e9,
                                      allow_recompute=allow_recompute,
                                      allow_cross_iteration=False, **FAST)
        text = str(said[0].message)
        assert len(said) == 1 and not sched.plan.feasible
        assert f"the budget of {sched.budget_bytes / 2**10:.1f} KiB" in text   # a small model
        assert f"peaks at {sched.plan.peak_after / 2**10:.1f} KiB" in text
        assert "optimizer state" in text and "tensile.stream_optimizer" in text
        assert ("allow_recompute=True" in text) is not allow_recompute
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # the re-plan after the timed step misses it too
            for b in data:
                sched.step(*b)
        assert sched.replans == 1 and not sched.plan.feasible
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # a budget the plan meets: nothing to say
        tensile.Scheduler(make_cnn(), torch.optim.Adam(make_cnn().parameters()), data[0],
                          nn.functional.cross_entropy, budget=1.0, d2h_bw=1e9, h2d_bw=1e9, **FAST)


def test_cuda_runtime_refuses_a_cpu_model():
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="simulate=True"):
        tensile.Scheduler(model, opt, batches(1)[0], nn.functional.cross_entropy,
                          simulate=False, d2h_bw=1e9, h2d_bw=1e9, **FAST)


# --------------------------------------------------------------------------- host cost
# The runtime intercepts ops (a Python dispatch mode, ~15 us per op) only on checked
# steps (the first after every plan) and around ops that need it; other steps run the
# plan from hooks. These tests check that fast steps do exactly what checked steps do.

from tensile.estimate import estimate_op_times  # noqa: E402
from tensile.plan import Plan  # noqa: E402
from tensile.planner import plan as make_plan  # noqa: E402
from tensile.record import record_step  # noqa: E402
from tensile.runtime import PlanRunner, _Mode  # noqa: E402


class Residual(nn.Module):
    """Conv-BN blocks, a skip connection (functional add) and one ReLU module used twice."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.relu(self.stem(x))
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.head((x + y).relu().mean((2, 3)))


@pytest.fixture
def intercepted(monkeypatch):
    """Ops the runtime's dispatch mode sees, one count per step (append 0 to start one)."""
    counts: list[int] = []
    original = _Mode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        counts[-1] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(_Mode, "__torch_dispatch__", counting)
    return counts


def run_runner(kind: str, counts: list[int], *, check_every_step: bool = False, n: int = 6,
               evaluate_between: bool = False):
    """Train ``Residual`` (``kind="chain"``: :func:`make_resnet`) under a plan of ``kind``
    with :class:`PlanRunner` directly."""
    torch.manual_seed(0)
    model = make_resnet() if kind == "chain" else Residual()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)  # as on a GPU
    data = batches(n)
    ce = nn.functional.cross_entropy
    training_step(model, opt, data[0], ce)  # the optimizer state exists from here on
    rec = record_step(model, opt, data[0], ce)
    tl = rec.timeline(estimate_op_times(rec.graph, 1e10, 1e10))
    peak = int(tl.vanilla_curve().max())
    if kind == "empty":
        p = Plan(num_ops=tl.num_ops, budget_bytes=None, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12)
    elif kind == "swap":
        p = make_plan(tl, budget_bytes=None, d2h_bw=1e12, h2d_bw=1e12, copy_latency_ms=0.0,
                      allow_recompute=False)
    else:  # slow copies: recomputation (chain: of in-place updates and dropped inputs too)
        p = make_plan(tl, budget_bytes=1 if kind == "chain" else int(0.9 * peak), d2h_bw=1e3,
                      h2d_bw=1e3, copy_latency_ms=0.0, allow_cross_iteration=False)
    runner = PlanRunner(rec, model, opt, ce, p, simulate=True)
    runner.check_every_step = check_every_step
    torch.manual_seed(123)
    for x, y in data:
        counts.append(0)
        runner.step((x, y))
        if evaluate_between:  # outside a step: the runtime's module hooks must ignore it
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
    runner.restore_all()
    return state_tensors(model, opt), runner.stats, p, runner


def test_empty_plan_intercepts_no_op_once_checked(intercepted):
    _, stats, _, runner = run_runner("empty", intercepted)
    assert intercepted[0] > runner.plan.num_ops  # checked step: every op (and view)
    assert intercepted[1:] == [0] * (len(intercepted) - 1)
    assert stats.steps == len(intercepted)


@pytest.mark.parametrize("kind", ["swap", "recompute", "chain"])
def test_fast_steps_match_checked_steps(kind, intercepted):
    fast_states, fast_stats, p, runner = run_runner(kind, intercepted)
    fast_counts = list(intercepted)
    intercepted.clear()
    checked_states, checked_stats, _, _ = run_runner(kind, intercepted, check_every_step=True)
    if kind == "swap":
        assert {s.cross_iteration for s in p.swaps} == {True, False}
    else:
        assert p.recomputes and (kind != "chain" or any(r.then_ops for r in p.recomputes))
    for a, b in zip(checked_states, fast_states):
        assert torch.equal(a, b)
    assert fast_stats == checked_stats
    assert fast_stats.swap_outs + fast_stats.recomputes > 0
    # Fast steps intercept a small part of the ops: windows around the ops that need the
    # mode, plus the optimizer phase where it has actions (it has no anchors).
    assert fast_counts[0] == intercepted[0]
    assert all(c < intercepted[0] / 2 for c in fast_counts[1:]), (fast_counts, intercepted)
    assert "forward" not in runner.sched.full_phases and "backward" not in runner.sched.full_phases


def test_evaluating_the_model_between_steps_changes_nothing(intercepted):
    plain, plain_stats, _, _ = run_runner("recompute", intercepted)
    evaluated, eval_stats, _, _ = run_runner("recompute", intercepted, evaluate_between=True)
    for a, b in zip(plain, evaluated):
        assert torch.equal(a, b)
    assert plain_stats == eval_stats


def test_changed_backward_graph_raises_on_a_fast_step():
    class Switch(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = make_cnn()
            self.tanh = False

        def forward(self, x):
            out = self.net(x)
            return out.tanh() if self.tanh else out.sigmoid()

    torch.manual_seed(0)
    model = Switch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(3)
    ce = nn.functional.cross_entropy
    training_step(model, opt, data[0], ce)
    rec = record_step(model, opt, data[0], ce)
    p = Plan(num_ops=rec.graph.num_nodes, budget_bytes=None, d2h_bytes_per_s=1e12,
             h2d_bytes_per_s=1e12)
    runner = PlanRunner(rec, model, opt, ce, p, simulate=True)
    runner.step(data[0])  # checked
    runner.step(data[1])  # fast
    model.tanh = True     # same number of ops and saved tensors, another backward node
    with pytest.raises(PlanMismatchError, match="backward node .*recorded SigmoidBackward0, "
                                                "now TanhBackward0"):
        runner.step(data[2])
    model.tanh = False
    runner.step(data[2])


def test_overhead_benchmark_prints_every_mode(capsys):
    from tensile.overhead import main

    timings = main(["--model", "resnet18", "--batch", "2", "--steps", "1", "--rounds", "1"])
    assert [t.mode for t in timings] == ["vanilla", "empty plan", "real plan", "checked"]
    assert all(t.ms_per_step > 0 for t in timings)
    out = capsys.readouterr().out
    assert "us/op" in out and "counted ops" in out


def test_capturing_a_step_is_refused_where_it_cannot_work():
    """A CUDA graph needs CUDA and a capturable optimizer: clear errors before anything runs."""
    _, _, _, sched = scheduled(n=2, budget=None, allow_cross_iteration=False, replan=False)
    with pytest.raises(ValueError, match="capture needs CUDA; this scheduler simulates on the CPU"):
        sched.capture(*batches(1)[0])
    with pytest.raises(ValueError, match="a captured step needs CUDA"):
        sched.runner.step(batches(1)[0], capturing=True)
    assert sched.runner.capturing is False
    model = make_cnn()
    with pytest.raises(ValueError, match="create it with capturable=True"):
        tensile.GraphStep(lambda b, c: None, batches(1)[0], model, torch.optim.Adam(model.parameters()))
    for graph_safe in ({"capturable": True}, {"fused": True}):   # step count on the device
        with pytest.raises(ValueError, match="a CUDA graph needs a CUDA model; the model is on cpu"):
            tensile.GraphStep(lambda b, c: None, batches(1)[0], model,
                              torch.optim.Adam(model.parameters(), **graph_safe))
    with pytest.raises(ValueError, match="tensile_graph captures a CUDA graph: it needs a CUDA model"):
        tensile.make_method("tensile_graph", model, torch.optim.Adam(model.parameters()),
                            nn.functional.cross_entropy, batches(1)[0], simulate=True)


def test_a_graphs_time_is_the_quietest_of_its_rounds(monkeypatch):
    """GraphStep.replay_ms over rounds, without a GPU (the replays patched): the least round
    mean, as a burst of another process slows some rounds; the step's state is put back."""
    from tensile import graph as graph_module
    step = graph_module.GraphStep.__new__(graph_module.GraphStep)   # __init__ less the capture
    step.model = make_cnn()
    step.optimizer = torch.optim.SGD(step.model.parameters(), lr=0.1)
    step.changes_at_capture = graph_module.memory_changes()
    weight = next(step.model.parameters())
    before = weight.detach().clone()
    rounds = iter([9.0, 11.4, 7.7, 8.1])
    calls = []

    def fake_replay_ms(graph, replays):
        calls.append(replays)
        with torch.no_grad():
            weight.add_(1.0)          # a replay trains
        return next(rounds)
    monkeypatch.setattr(graph_module, "replay_ms", fake_replay_ms)
    step.graph = None
    assert step.replay_ms(3, rounds=4) == 7.7 and calls == [3, 3, 3, 3]
    assert torch.equal(weight, before)                         # put back
    rounds = iter([6.5])
    assert step.replay_ms() == 6.5 and calls[-1] == 20         # one round of 20, as before
    with pytest.raises(ValueError, match="expected at least 1, got 3 and 0"):
        step.replay_ms(3, rounds=0)
    with pytest.raises(ValueError, match="gap_s: expected seconds >= 0, got -1"):
        step.replay_ms(3, rounds=2, gap_s=-1)


def test_the_recording_knows_the_gradients_live_until_the_step_ends():
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(2)
    training_step(model, opt, data[0], nn.functional.cross_entropy)   # Adam's state exists
    rec = record_step(model, opt, data[1], nn.functional.cross_entropy)
    assert len(rec.held_to_end) == len(list(model.parameters()))     # one gradient each
    tl = rec.timeline([1.0] * rec.graph.num_nodes)
    for sid in rec.held_to_end:
        t = tl.tensors[sid]
        assert t.role == "activation" and t.held_to_end
        assert tl.phases[t.first] == "backward" and tl.phases[t.last] == "optimizer"
        assert tl.vanilla_range(sid) == (t.first, tl.num_ops - 1)


def test_the_recording_knows_how_long_the_step_holds_what_it_no_longer_reads():
    """A storage Python keeps past its last access takes memory until it is let go (a
    streamed optimizer's ring slot, given back some updates after its last copy-out): the
    recording sees it go and the timeline counts it to there (``held_to``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stash, kept = {}, []
    model[0].register_forward_hook(lambda _m, _a, out: stash.__setitem__("let go", out * 3))
    model[3].register_forward_hook(lambda _m, _a, out: stash.clear())
    model[2].register_forward_hook(lambda _m, _a, out: kept.append(out + 1))
    data = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    rec = record_step(model, opt, data, nn.functional.cross_entropy)
    names = [n.name for n in rec.graph.nodes]
    let_go = rec.out_sids[names.index("aten.mul.Tensor")][0]
    still = rec.out_sids[names.index("aten.add.Tensor")][0]
    popped_at = next(a.ops for a in rec.anchors if a.key == ("post", 4, 0))   # model[3]'s hook
    tl = rec.timeline([1.0] * len(names))
    assert tl.tensors[let_go].last == names.index("aten.mul.Tensor")   # never read again
    assert tl.tensors[let_go].held_to == popped_at - 1
    assert tl.vanilla_range(let_go) == (tl.tensors[let_go].first, popped_at - 1)
    assert tl.tensors[still].held_to == tl.num_ops - 1                   # still in the list
    # a tensor freed right after its last access (the ReLU's output, read by the next
    # Linear and by backward) is not held
    assert all(h > tl.tensors[s].last for s, h in rec.held_to.items())
    assert let_go in rec.held_to and len(rec.held_to) < len(tl.tensors)


def test_the_recording_knows_a_module_input_is_held_until_the_call_returns():
    """A block reads its input in its first op only, but its caller references the input
    until the block returns: the input's backward gap (where a plan may move it) starts
    at the block's last op (``forward_hold``), not at that first read."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return torch.relu(self.b(torch.relu(self.a(x)))) * 2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Block(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = record_step(model, opt, (torch.randn(4, 8), torch.randint(0, 4, (4,))),
                      nn.functional.cross_entropy)
    block = [m for m in model.modules()].index(model[1])
    start = next(a.ops for a in rec.anchors if a.key == ("pre", block, 0))
    end = next(a.ops for a in rec.anchors if a.key == ("post", block, 0)) - 1
    x = rec.out_sids[start - 1][0]           # the first Linear's output, the block's input
    tl = rec.timeline([1.0] * rec.graph.num_nodes)
    assert start in tl.tensors[x].accesses and end not in tl.tensors[x].accesses
    assert rec.forward_hold[x] == end and tl.backward_gap(x)[0] == end
    rec.forward_hold = {}
    assert rec.timeline([1.0] * rec.graph.num_nodes).backward_gap(x)[0] == start


def _vanilla_and_scheduled(factory, steps: int, **plan_kwargs):
    """``steps`` SGD steps of ``factory()``, vanilla and scheduled with recomputation only
    (copies too slow to hide): both runs' state tensors, and the scheduler."""
    data = batches(steps)
    states = []
    for planned in (False, True):
        model = factory()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if planned:
            sched = tensile.Scheduler(model, opt, data[0], nn.functional.cross_entropy, **FAST,
                                      allow_cross_iteration=False, d2h_bw=1e3, h2d_bw=1e3,
                                      replan=False, **plan_kwargs)
            for b in data:
                sched.step(*b)
        else:
            for b in data:
                training_step(model, opt, b, nn.functional.cross_entropy)
        states.append(state_tensors(model, opt))
    return states, sched


def test_chained_recomputes_rebuild_in_place_updates_and_train_bit_identically():
    """Batch norm outputs that ReLU(inplace=True) overwrote and residual sums (``add_``)
    are rebuilt by rerunning their in-place updates; batch norm reruns on scratch running
    statistics; a recompute whose input was itself dropped rebuilds that input first, to
    keep it or for this recompute alone."""
    steps = 5
    states, sched = _vanilla_and_scheduled(make_resnet, steps, budget=1)
    p, tl = sched.plan, sched.timeline
    rebuilt = {r.sid for r in p.recomputes}
    assert any(r.then_ops for r in p.recomputes), "no in-place update rerun"
    assert {tl.names[k] for r in p.recomputes for k in r.then_ops} >= {"aten.relu_.default",
                                                                      "aten.add_.Tensor"}
    assert any(r.scratch for r in p.recomputes), "no batch norm recomputed"
    assert any(set(r.sources) & rebuilt for r in p.recomputes), "no chain of recomputes"
    assert any(r.transient for r in p.recomputes), "no input rebuilt for one recompute alone"
    assert p.peak_after < p.peak_before and not p.swaps
    report = sched.report()
    assert report.recomputes == steps * len(p.recomputes) and report.ineffective_releases == 0
    figures = report.plan_figures()     # what the experiment's rows carry
    assert figures["recomputes_in_place"] == sum(bool(r.then_ops) for r in p.recomputes) > 0
    assert figures["recomputes_transient"] > 0 and "with in-place updates" in p.summary()
    for a, b in zip(*states):   # parameters, running statistics, momentum: all the same
        assert torch.equal(a, b)


def test_rebuilds_ahead_of_need_run_at_their_issue_op_and_train_bit_identically(monkeypatch):
    """``rebuild_ahead``: rebuilds (chains included) run after their ``issue_op``, before
    backward needs them (on a side stream on CUDA), within the plan's peak; training is
    unchanged."""
    from tensile.runtime import PlanRunner
    issued = []
    real = PlanRunner._rebuild_ahead

    def counting(self, e):
        issued.append((self.k, e.sid))
        return real(self, e)
    monkeypatch.setattr(PlanRunner, "_rebuild_ahead", counting)
    steps = 4
    states, sched = _vanilla_and_scheduled(make_resnet, steps, budget=1, rebuild_ahead=2.0)
    p, tl = sched.plan, sched.timeline
    ahead = {r.sid: r for r in p.recomputes if r.issue_op is not None}
    assert ahead and len(ahead) < len(p.recomputes)   # some ahead, some on demand
    assert any(set(r.sources) & set(ahead) for r in ahead.values()), "no chain went ahead"
    for r in ahead.values():
        assert r.release_after_op < r.issue_op < r.before_op - 1 and not r.transient
    assert tensile.simulate(tl, p).peak == p.peak_after
    assert "rebuilt ahead" in p.summary()
    assert any("ahead, on a side stream" in a for acts in p.actions().values() for a in acts)
    # each step rebuilds every group ahead once, before the op after its issue_op
    first = {r.issue_op for r in ahead.values()}
    assert len(issued) >= steps * len(first)
    assert all(k <= ahead[sid].issue_op + 1 for k, sid in issued)
    report = sched.report()
    assert report.recomputes == steps * len(p.recomputes) and report.ineffective_releases == 0
    for a, b in zip(*states):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="rebuild_ahead must be a number of rerun times"):
        tensile.planner.plan(tl, d2h_bw=1e9, h2d_bw=1e9, rebuild_ahead=-1)


def test_batch_norm_rebuilt_from_its_batch_statistics_trains_within_tolerance(monkeypatch):
    """With ``batch_norm_from_stats`` the runtime rebuilds a training-mode batch norm from
    the mean and inverse std the op returned: the plan's batch-norm recomputes all run that
    way, and training matches vanilla to rounding."""
    from tensile import runtime
    applied = []
    real = runtime._batch_norm_apply

    def counting(*args):
        applied.append(args[0].shape)
        return real(*args)
    monkeypatch.setattr(runtime, "_batch_norm_apply", counting)
    monkeypatch.setattr(tensile.api, "batch_norm_rerun_shares", lambda *a: {})  # no timing calls
    fused = []
    real_fused = runtime.batch_norm_act
    monkeypatch.setattr(runtime, "batch_norm_act",
                        lambda *a, **kw: fused.append(tuple(kw.items())) or real_fused(*a, **kw))
    steps = 5
    # statistics too small to plan (as on a GPU, where nothing under 64 KiB moves): a plan
    # that moved them would rerun the op instead (the recipe holds them by reference)
    states, sched = _vanilla_and_scheduled(make_resnet, steps, budget=1, min_swap_bytes=1024,
                                           batch_norm_from_stats=True)
    bn = [r for r in sched.plan.recomputes if r.scratch]   # the batch norms the plan rebuilds
    # each runs once for good, and again for every recompute that rebuilds it for itself alone
    bn_sids = {r.sid for r in bn}
    again = sum(len(set(r.transient) & bn_sids) for r in sched.plan.recomputes)
    assert bn and len(applied) == steps * (len(bn) + again)
    # a rebuild takes the residual add_ and the ReLU(inplace=True) after it along (one kernel
    # on CUDA): every batch norm of this net has one or both
    names = sched.timeline.names
    joined = {r.sid: [names[k] for k in r.then_ops] for r in bn}
    assert {tuple(v) for v in joined.values()} <= {("aten.relu_.default",),
                                                   ("aten.add_.Tensor", "aten.relu_.default")}
    assert ("aten.add_.Tensor", "aten.relu_.default") in {tuple(v) for v in joined.values()}
    assert len(fused) == len(applied)              # each rebuild went through the fused path
    residual = sum(1 for kw in fused if dict(kw)["residual"] is not None)
    assert residual == steps * sum(1 for r in bn if len(joined[r.sid]) == 2) + steps * sum(
        1 for r in sched.plan.recomputes for s in r.transient if s in joined and len(joined[s]) == 2)
    by_op = sched.report().plan_figures()["recomputes_by_op"]    # what the rows carry
    assert sum(by_op.values()) == len(sched.plan.recomputes) and by_op["native_batch_norm"] == len(bn)
    assert sched.report().recomputes == steps * len(sched.plan.recomputes)
    for a, b in zip(*states):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_batch_norm_rerun_shares_price_each_training_batch_norm_once_per_shape(monkeypatch):
    """The share of a batch norm's time its rebuild from statistics costs: one entry per
    forward training-mode batch norm, measured once per shape (and per whether a
    ReLU(inplace=True) joins the rebuild: that relu_ then costs nothing more); an eval-mode
    one (no batch statistics) has none. A Scheduler with ``batch_norm_from_stats`` plans
    with them."""
    from tensile import optimes
    from tensile.record import record_step
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8),
                          nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
    training_step(model, opt, batch, nn.functional.cross_entropy)   # the lazy layer's shape
    model[8].eval()                                                  # batch statistics: none
    rec = record_step(model, opt, batch, nn.functional.cross_entropy)
    bn = [n.index for n in rec.graph.nodes
          if "batch_norm" in n.name and n.phase == "forward"]
    measured = []
    real = optimes._apply_share

    def counting(shape, dtype, joined, *args):
        measured.append((shape, joined))
        return real(shape, dtype, joined, *args)
    monkeypatch.setattr(optimes, "_apply_share", counting)
    shares = optimes.batch_norm_rerun_shares(rec.graph, "cpu")
    relu_ = [n.index for n in rec.graph.nodes if n.name == "aten.relu_.default"]
    assert len(relu_) == 1 and relu_[0] > bn[0]
    assert sorted(shares) == sorted(bn[:3] + relu_) and len(bn) == 4   # eval-mode one left out
    assert shares[relu_[0]] == 0.0 and all(shares[k] > 0 for k in bn[:3])
    # three kinds, each once: the first rebuild takes its ReLU along, the second does not
    assert sorted(measured) == [((4, 4, 8, 8), ()), ((4, 4, 8, 8), ("relu_",)), ((4, 8, 4, 4), ())]

    net = make_resnet()
    sched = tensile.Scheduler(net, torch.optim.SGD(net.parameters(), lr=0.1), batches(1)[0],
                              nn.functional.cross_entropy, **FAST, d2h_bw=1e3, h2d_bw=1e3,
                              replan=False, batch_norm_from_stats=True)
    tl = sched.timeline
    assert tl.rerun_share == sched.rerun_share and tl.rerun_share
    in_place = {"aten.relu_.default", "aten.add_.Tensor"}     # joined into a rebuild: free
    assert all(tl.phases[k] == "forward" and ("batch_norm" in tl.names[k] or
                                              (tl.names[k] in in_place and v == 0))
               for k, v in tl.rerun_share.items())
    assert "aten.add_.Tensor" in {tl.names[k] for k in tl.rerun_share}   # the residual's
    share = sched.report().plan_figures()["bn_rerun_share_median"]   # what the rows carry
    assert share == statistics.median(v for k, v in tl.rerun_share.items() if "batch_norm" in tl.names[k])


def test_batch_norm_act_without_its_kernel_is_the_separate_passes():
    """On the CPU (no Triton) the fused rebuild is the rebuild, then the add, then ReLU, exactly."""
    from tensile.fused import batch_norm_act, fused_available
    from tensile.runtime import _batch_norm_apply
    torch.manual_seed(0)
    x, w, b, res = torch.randn(4, 6, 5, 5), torch.rand(6) + 0.5, torch.randn(6), torch.randn(4, 6, 5, 5)
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, torch.zeros(6), torch.ones(6),
                                                       True, 0.1, 1e-5)
    assert not fused_available(x)
    bn = _batch_norm_apply(x, w, b, mean, invstd, 1e-5)
    assert torch.equal(batch_norm_act(x, w, b, mean, invstd, 1e-5), bn)
    assert torch.equal(batch_norm_act(x, w, b, mean, invstd, 1e-5, relu=True), bn.relu())
    assert torch.equal(batch_norm_act(x, w, b, mean, invstd, 1e-5, residual=res, relu=True),
                       (bn + res).relu_())


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_batch_norm_apply_is_the_ops_output(affine, channels_last):
    from tensile.runtime import _batch_norm_apply
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 5)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = (torch.rand(6) + 0.5, torch.randn(6)) if affine else (None, None)
    y, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, torch.zeros(6), torch.ones(6),
                                                       True, 0.1, 1e-5)
    got = _batch_norm_apply(x, w, b, mean, invstd, 1e-5)
    assert got.stride() == y.stride()   # the runtime views the bytes with the op's strides
    torch.testing.assert_close(got, y, rtol=1e-5, atol=1e-5)


def test_concatenations_rebuilt_from_kept_inputs_train_bit_identically():
    """A plan that drops DenseNet-like concatenations and keeps the tensors they joined
    (``Recompute.kept``): the runtime's recipes hold those inputs until the rebuild."""
    steps = 5
    states, sched = _vanilla_and_scheduled(make_densenet, steps, max_overhead=1.0)
    p, tl = sched.plan, sched.timeline
    kept = [r for r in p.recomputes if r.kept]
    assert kept and all(tl.names[r.producer_op] == "aten.cat.default" for r in kept), p
    assert p.peak_after < p.peak_before
    report = sched.report()
    assert report.recomputes == steps * len(p.recomputes) and report.ineffective_releases == 0
    for a, b in zip(*states):
        assert torch.equal(a, b)


def test_a_budget_on_cuda_without_expandable_segments_gets_a_hint():
    from tensile.api import fragmentation_hint
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def asked():
        raise AssertionError("the allocator is asked only for a budget on CUDA")
    hint = fragmentation_hint(2**30, cuda, lambda: False)
    assert "1024 MiB" in hint and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in hint
    assert fragmentation_hint(2**30, cuda, lambda: True) is None
    assert fragmentation_hint(None, cuda, asked) is None         # no budget: nothing to overrun
    assert fragmentation_hint(2**30, cpu, asked) is None         # the CPU has no caching allocator


def test_rerun_shares_time_each_call_on_inputs_out_of_the_l2_cache():
    """A timing loop cycles through enough copies of a batch norm's input to fill the L2
    cache twice over (a step's input was written long before the rerun); on the CPU one copy,
    timed by the wall clock, still gives a share for every training-mode batch norm."""
    from nimble.graph import OpNode, TaskGraph
    from tensile.optimes import batch_norm_rerun_shares, cold_copies
    mib = 2 ** 20
    assert cold_copies(12 * mib, 50 * mib) == 9        # 12 MiB inputs: 108 MiB cycled
    assert cold_copies(49 * mib, 50 * mib) == 3
    assert cold_copies(200 * mib, 50 * mib) == 2       # larger than the cache: two alternate
    assert cold_copies(64 * 1024, 50 * mib) == 64      # tiny inputs: the most, still cached
    assert cold_copies(12 * mib, 0) == 1 and cold_copies(0, 50 * mib) == 1
    shape = (4, 8, 16, 16)
    nodes = [OpNode(0, "aten.native_batch_norm.default", phase="forward", input_shapes=[shape, (8,)],
                    input_dtypes=["torch.float32"], output_shapes=[shape, (8,), (8,)], reads=[0],
                    writes=[1]),
             OpNode(1, "aten.relu_.default", phase="forward", input_shapes=[shape], reads=[1], writes=[1])]
    shares = batch_norm_rerun_shares(TaskGraph(nodes=nodes, edges=[]), "cpu", repeats=3)
    assert set(shares) == {0, 1} and shares[0] >= 1e-3 and shares[1] == 0.0


def test_rerun_shares_time_the_op_on_a_warm_input_and_the_rebuild_on_cold_ones(monkeypatch):
    """As a step finds them: the batch norm right after the convolution that wrote its input
    (one input, cached), the rebuild in backward long after (each call on the next copy)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from nimble.graph import OpNode, TaskGraph
    from tensile import optimes
    shape = (4, 8, 16, 16)                                  # 32 KiB of float32
    monkeypatch.setattr(optimes, "_l2_bytes", lambda device: 64 * 1024)   # 4 copies fill it twice
    rebuilt, ran = [], []

    def apply(x, *args):
        rebuilt.append(x.data_ptr())
        return x.clone()
    monkeypatch.setattr(optimes, "_batch_norm_apply", apply)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "_batch_norm_with_update" in str(func):
                ran.append(args[0].data_ptr())
            return func(*args, **(kwargs or {}))
    node = OpNode(0, "aten.native_batch_norm.default", phase="forward", input_shapes=[shape, (8,)],
                  input_dtypes=["torch.float32"], output_shapes=[shape, (8,), (8,)], reads=[0], writes=[1])
    with Ops():
        shares = optimes.batch_norm_rerun_shares(TaskGraph(nodes=[node], edges=[]), "cpu", repeats=8)
    assert set(shares) == {0}
    assert len(ran) > 1 and len(set(ran)) == 1                # the op: always the same input
    assert len(set(rebuilt)) == 4                             # the rebuild: each of the 4 copies


def test_a_budgeted_scheduler_says_how_little_any_plan_could_cost():
    """Scheduler.bound: on the timeline its plan was priced with, no plan of its moves fits
    the budget for less than the bound, so the greedy plan's estimate is at least that."""
    _, _, _, sched = scheduled(n=1, budget=300_000, allow_cross_iteration=False, d2h_bw=1e12,
                               h2d_bw=1e12, replan=False, allow_swaps=False)
    bound = sched.bound()
    assert sched.plan.feasible and sched.plan.recomputes
    assert 0 < bound["bound_ms"] <= sched.plan.est_overhead_ms + 1e-9
    assert bound["bound_swaps_ms"] <= bound["bound_ms"] + 1e-9    # swaps only add moves
    _, _, _, free = scheduled(n=1, budget=None, allow_recompute=False, replan=False)
    assert free.bound() == {}


def with_a_rebuild_source_swapped(tl, p: Plan) -> Plan:
    """``p`` with one more swap: of a tensor that a rebuild of ``p`` reads and ``p`` keeps,
    from its last forward read until its copy-in, issued two ops before that rebuild,
    which is before the tensor's own backward use (``Swap.use_op``: the rebuild's op)."""
    from tensile.plan import Swap
    rebuilt = {r.sid for r in p.recomputes}
    once = [r for r in p.recomputes if not any(r.sid in q.transient for q in p.recomputes)]
    r, u = next((r, u) for r in once for u in r.sources
                if u not in rebuilt and u not in r.kept and not tl.tensors[u].persistent
                and tl.tensors[u].swappable and tl.backward_gap(u) is not None
                and tl.backward_gap(u)[0] < r.before_op - 2
                and r.before_op < tl.backward_gap(u)[1])
    i, _ = tl.backward_gap(u)
    w, k = tl.last_write_at_or_before(u, i), r.before_op - 2
    p.swaps.append(Swap(sid=u, nbytes=tl.tensors[u].nbytes, cross_iteration=False,
                        out_issue_op=w, out_start_ms=float(tl.end[w]), out_end_ms=float(tl.end[w]),
                        release_after_op=i, in_issue_op=k, in_start_ms=float(tl.end[k]),
                        in_end_ms=float(tl.end[k]), use_op=r.before_op))
    return p


def test_a_rebuild_reads_an_activation_swapped_back_in_for_it_and_trains_bit_identically():
    """A plan may swap out a tensor that a rebuild reads (``Swap.use_op``: that rebuild's
    op, before the tensor's own backward use): the copy-in issued before it has the bytes
    there, and training is unchanged."""
    torch.manual_seed(0)
    steps, ce = 4, nn.functional.cross_entropy
    data = batches(steps)
    states = []
    for planned in (False, True):
        torch.manual_seed(0)
        model = make_resnet()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        training_step(model, opt, data[0], ce)   # the momentum buffers exist from here on
        rec = record_step(model, opt, data[0], ce)
        if not planned:
            for b in data:
                training_step(model, opt, b, ce)
            states.append(state_tensors(model, opt))
            continue
        tl = rec.timeline(estimate_op_times(rec.graph, 1e10, 1e10))
        p = with_a_rebuild_source_swapped(tl, make_plan(
            tl, budget_bytes=1, d2h_bw=1e3, h2d_bw=1e3, copy_latency_ms=0.0, allow_cross_iteration=False))
        runner = PlanRunner(rec, model, opt, ce, p, simulate=True)
        torch.manual_seed(0)
        for b in data:
            runner.step(b)
        runner.restore_all()
        stats = runner.stats
        assert stats.swap_ins == steps and stats.passive_swap_ins == 0   # back in time
        assert stats.recomputes == steps * len(p.recomputes) and stats.ineffective_releases == 0
        states.append(state_tensors(model, opt))
    for a, b in zip(*states):
        assert torch.equal(a, b)


def test_a_missed_budget_says_the_peak_ops_workspace_is_its_own():
    """A peak set by an op's workspace: the warning says no plan moves that part, and says
    nothing of it where the peak op has none."""
    mib = 2**20
    ops = [("conv", "forward", 1.0, [], [1]), ("conv_backward", "backward", 1.0, [1], [2])]
    for scratch, said in (({1: 6 * mib}, True), ({}, False)):
        tl = tensile.AccessTimeline.from_ops(ops, {1: 4 * mib, 2: 4 * mib}, scratch=scratch)
        plan = tensile.plan(tl, budget_bytes=2 * mib, d2h_bw=1e9, h2d_bw=1e9)
        text = tensile.api.unmet_budget_message(tl, plan)
        assert not plan.feasible and "during op 1 (conv_backward, backward)" in text
        assert ("Its workspaces (6.0 MiB) are the op's own: no plan moves them." in text) is said
