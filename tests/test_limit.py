"""The limit of a training step (experiments/limit.py) on the CPU; the GPU profile is tested
by tests/test_nimble_training_gpu.py's sweep rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from experiments.limit import step_limit, step_op_times_ms


class TwoBranches(nn.Module):
    """Two independent convolution branches: the critical path is one branch, not both."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        y = torch.cat([self.a(x).mean((2, 3)), self.b(x).mean((2, 3))], 1)
        return self.head(y)


def _job():
    torch.manual_seed(0)
    model = TwoBranches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, (torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,)))


def test_limit_is_the_heaviest_path_not_the_sum():
    model, opt, batch = _job()
    ones = lambda *args: [1.0] * n_ops  # noqa: E731 - every op costs 1 ms
    step_op_times_ms(model, opt, batch, F.cross_entropy, repeats=1)  # creates momentum buffers
    n_ops = len(step_op_times_ms(model, opt, batch, F.cross_entropy, repeats=1))
    got = step_limit(model, opt, batch, F.cross_entropy, median_ms=30.0, op_times=ones)
    assert got["kernel_sum_ms"] == n_ops
    # Parallel branches (and the optimizer's independent per-parameter updates) are off the path.
    assert 0 < got["critical_path_ms"] < got["kernel_sum_ms"]
    assert got["over_critical_path"] == round(30.0 / got["critical_path_ms"], 3)


def test_cpu_op_times_are_measured_per_op():
    model, opt, batch = _job()
    times = step_op_times_ms(model, opt, batch, F.cross_entropy, repeats=3)
    assert len(times) > 20 and all(t >= 0 for t in times) and sum(times) > 0


def test_a_step_that_changes_its_ops_is_refused():
    model, opt, batch = _job()
    with pytest.raises(RuntimeError, match="the timed step ran 3 ops, the recorded one"):
        step_limit(model, opt, batch, F.cross_entropy, median_ms=1.0, op_times=lambda *a: [1.0] * 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_profile_times_every_recorded_op():
    from experiments.models import build_model
    torch.manual_seed(0)
    model = build_model("resnet50", num_classes=10).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = (torch.randn(32, 3, 32, 32, device="cuda"), torch.randint(0, 10, (32,), device="cuda"))
    got = step_limit(model, opt, batch, F.cross_entropy, median_ms=5.0)   # refuses a count mismatch
    # ResNet-50's step is nearly a chain; its optimizer updates are not: the path is shorter.
    assert 0.3 * got["kernel_sum_ms"] < got["critical_path_ms"] < got["kernel_sum_ms"]


def test_cached_limit_is_computed_once_per_key_and_a_failure_is_a_note():
    from experiments.limit import cached_step_limit
    model, _, batch = _job()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    first = cached_step_limit(("two", 4), model, make, batch, F.cross_entropy, median_ms=10.0)
    again = cached_step_limit(("two", 4), model, make, batch, F.cross_entropy, median_ms=20.0)
    assert again["critical_path_ms"] == first["critical_path_ms"]          # not re-measured
    assert again["over_critical_path"] == round(20.0 / first["critical_path_ms"], 3)
    assert all(p.grad is None for p in model.parameters())                  # a copy trained
    bad = cached_step_limit(("bad", 4), model, make, (batch[0],), F.cross_entropy, 1.0)
    assert "ValueError" in bad["limit_error"]


def test_a_cpu_profile_has_one_time_per_recorded_op_and_no_workspaces():
    """``step_op_profile`` on the CPU: the op times of :func:`step_op_times_ms`, one per op the
    recorder counts, and no workspaces (the CPU allocator keeps no statistics)."""
    from tensile.optimes import step_op_profile
    from tensile.record import record_step
    model, opt, batch = _job()
    step_op_times_ms(model, opt, batch, F.cross_entropy, repeats=1)  # creates momentum buffers
    profile = step_op_profile(model, opt, batch, F.cross_entropy, repeats=1)
    rec = record_step(model, opt, batch, F.cross_entropy)
    assert len(profile.op_ms) == len(rec.graph.nodes) and profile.scratch == {}
