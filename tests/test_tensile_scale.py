"""tensile.scale: a step recorded at small batches and scaled equals the step recorded whole;
what does not scale is refused; a Scheduler planned from it trains like vanilla."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tensile
from tensile.record import record_step
from tensile.scale import ScaleError, _slots, _structure, batch_size_of, scale_recording, slice_batch
from tensile.step import training_step

from resnet_block import make_densenet, make_resnet

LOSS = nn.functional.cross_entropy
FAST = dict(peak_flops=1e10, peak_bytes_per_s=1e10, copy_latency_ms=0.0)


def data(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)


def recorded(model: nn.Module, batch) -> tensile.Recording:
    """A steady-state step of ``model`` recorded (the optimizer's state made first)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    training_step(model, opt, batch, LOSS)
    return record_step(model, opt, batch, LOSS)


@pytest.mark.parametrize("make", [make_resnet, make_densenet])
def test_a_scaled_recording_equals_the_whole_one(make):
    full = data(16)
    whole = recorded(make(), full)
    small = [(b, recorded(make(), slice_batch(full, b))) for b in (2, 3, 5)]
    scaled = scale_recording(small, 16)
    assert _structure(scaled) == _structure(whole)
    assert [get() for get, _ in _slots(scaled)] == [get() for get, _ in _slots(whole)]
    # the numbers really moved: the input's storage is the full batch's, not the first's
    (x_sid,) = [s for s in whole.graph.inputs if whole.graph.nodes[0].storage_bytes.get(s)][:1]
    assert scaled.graph.nodes[0].storage_bytes[x_sid] == full[0].numel() * 4


@pytest.mark.parametrize("name, hw", [("resnet18", 32), ("mobilenet_v2", 32), ("googlenet", 64)])
def test_torchvision_models_scale_exactly(name, hw):
    import torchvision

    def make():
        torch.manual_seed(0)
        kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
        return getattr(torchvision.models, name)(num_classes=10, **kwargs)
    full = (torch.randn(8, 3, hw, hw), torch.randint(0, 10, (8,)))
    whole = recorded(make(), full)
    scaled = scale_recording([(b, recorded(make(), slice_batch(full, b))) for b in (2, 3, 4)], 8)
    assert _structure(scaled) == _structure(whole)
    assert [get() for get, _ in _slots(scaled)] == [get() for get, _ in _slots(whole)]


class BatchDependent(nn.Module):
    """Takes another path for batches above 3: its op sequence depends on the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_resnet()

    def forward(self, x):
        if x.shape[0] > 3:
            x = x * 2
        return self.net(x)


def test_a_step_that_changes_with_the_batch_is_refused():
    full = data(16)
    small = [(b, recorded(BatchDependent(), slice_batch(full, b))) for b in (2, 3, 4)]
    with pytest.raises(ScaleError, match="differs from the step at batch 2 in its op sequence"):
        scale_recording(small, 16)


def test_a_size_off_its_line_is_refused():
    full = data(16)
    small = [(b, recorded(make_resnet(), slice_batch(full, b))) for b in (2, 3, 4)]
    node = small[2][1].graph.nodes[0]
    sid = sorted(node.storage_bytes)[0]
    node.storage_bytes[sid] += 4                 # as a size that is not linear in the batch
    with pytest.raises(ScaleError, match="not linear in the batch size"):
        scale_recording(small, 16)


def test_bad_batch_sizes_are_refused():
    rec = recorded(make_resnet(), data(2))
    with pytest.raises(ScaleError, match=r"three or more different batch sizes.*\[2, 4\]"):
        scale_recording([(2, rec), (4, rec)], 16)
    with pytest.raises(ScaleError, match=r"got batch sizes \[2, 2, 4\]"):
        scale_recording([(2, rec), (2, rec), (4, rec)], 16)
    with pytest.raises(ScaleError, match="found sizes \\[3, 8\\]"):
        batch_size_of((torch.zeros(8, 2), torch.zeros(3)))
    assert batch_size_of((torch.zeros(8, 2), torch.zeros(8), "label")) == 8
    model = make_resnet()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"record_batches: expected three or more .* got \[2, 4, 16\]"):
        tensile.Scheduler(model, opt, data(16), LOSS, record_batches=(2, 4, 16), **FAST)


def test_a_scheduler_planned_from_small_batches_trains_like_vanilla():
    steps = [data(8, seed) for seed in range(4)]
    reference = make_resnet()
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    want = [float(training_step(reference, opt_ref, b, LOSS)) for b in steps]

    model = make_resnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = tensile.Scheduler(model, opt, steps[0], LOSS, record_batches=(2, 3, 4), budget=None,
                              allow_recompute=False, d2h_bw=1e12, h2d_bw=1e12, **FAST)
    whole = recorded(make_resnet(), steps[0])
    assert [get() for get, _ in _slots(sched.recording)] == [get() for get, _ in _slots(whole)]
    got = [float(sched.step(*b)) for b in steps]
    sched.restore_parameters()
    assert sched.plan.swaps, "the plan should move something"
    assert got == want
    for a, b in zip(reference.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
