"""tensile.defer_weight_grads on the CPU: large linear layers' weight gradients at backward's end."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tensile
from tensile.step import training_step

LOSS = nn.functional.cross_entropy


def make_model(seed: int = 0) -> nn.Module:
    """Convolutions, then a 256 KiB and a 10 KiB linear layer (a classifier head)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 256),
                         nn.ReLU(), nn.Dropout(0.0), nn.Linear(256, 10))


def batches(n: int, size: int = 8, batch: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def trained(data, defer_mb=None, streamed=None):
    """A fresh model and its Adam after ``data``; the handle, if any layer is deferred."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    handle = tensile.defer_weight_grads(model, min_mb=defer_mb) if defer_mb is not None else None
    s = tensile.stream_optimizer(opt, **streamed) if streamed is not None else None
    for b in data:
        training_step(model, opt, b, LOSS)
    return model, opt, handle, s


def assert_same(m0, o0, m1, o1):
    for p0, p1 in zip(m0.parameters(), m1.parameters(), strict=True):
        assert torch.equal(p0, p1)
        for k, v in o0.state[p0].items():
            assert torch.equal(v, o1.state[p1][k]), k


def test_gradients_are_bit_for_bit_autograds_and_the_weights_arrive_last():
    model, ref = make_model(), make_model()
    handle = tensile.defer_weight_grads(model, min_mb=0)
    assert handle.layers == ["6", "9"]
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    x, y = batches(1)[0]
    LOSS(model(x), y).backward()
    LOSS(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    # the two linear weights' gradients come after every other one, the convolutions' too
    assert order[-2:] == ["9.weight", "6.weight"] and handle.deferred == 2
    assert set(order) == {n for n, _ in model.named_parameters()}
    LOSS(model(x), y).backward()   # accumulated as autograd accumulates
    LOSS(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_adam_trains_bit_for_bit_like_without_it():
    data = batches(5)
    m0, o0, _, _ = trained(data)
    m1, o1, handle, _ = trained(data, defer_mb=0.2)   # the 256 KiB layer only
    assert handle.layers == ["6"] and handle.deferred == len(data)
    assert_same(m0, o0, m1, o1)


@pytest.mark.parametrize("resident", [0, 1, 3])
def test_a_streamed_optimizer_updates_the_deferred_group_last_and_trains_exactly(resident):
    """The deferred weights' post-accumulate hooks run at backward's end, so a streamed
    optimizer still updates every group in backward (none left to step()), with their
    state streamed or resident."""
    data = batches(5)
    m0, o0, _, _ = trained(data)
    m1, o1, handle, s = trained(data, defer_mb=0, streamed=dict(groups=3, prefetch=1, resident=resident))
    assert s.updates_in_backward == 3 * (len(data) - 1) and s.late_updates == 0
    assert handle.deferred == 2 * len(data)
    s.synchronize()
    assert_same(m0, o0, m1, o1)


def test_the_recorded_step_holds_the_weight_gradient_at_backwards_end_not_its_start():
    """The timeline TENSILE plans from sees the 256 KiB gradient made by the last op and the
    streamed update of its group after it: backward's start holds that much less."""
    data = batches(3)
    recs = {}
    for defer in (None, 0.2):
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if defer is not None:
            tensile.defer_weight_grads(model, min_mb=defer)
        tensile.stream_optimizer(opt, groups=3, prefetch=1, resident=3)
        for b in data[:-1]:
            training_step(model, opt, b, LOSS)
        recs[defer] = tensile.record_step(model, opt, data[-1], LOSS)
    grad = 256 * 256 * 4
    made = {}
    for defer, rec in recs.items():
        nodes = rec.graph.nodes
        mm = [n.index for n in nodes if n.phase == "backward" and n.name == "aten.mm.default"]
        backward = [n.index for n in nodes if n.phase == "backward"]
        made[defer] = (mm, backward)
    mm, backward = made[0.2]
    # the deferred product comes after the convolutions' backward, not before it
    conv_bwd = [n.index for n in recs[0.2].graph.nodes if n.name == "aten.convolution_backward.default"]
    assert max(mm) > max(conv_bwd)
    mm0, _ = made[None]
    conv0 = [n.index for n in recs[None].graph.nodes if n.name == "aten.convolution_backward.default"]
    assert max(mm0) < min(conv0)
    tl = {d: r.timeline([1.0] * len(r.graph.nodes)) for d, r in recs.items()}
    start = {d: t.vanilla_curve()[[k for k in range(t.num_ops) if t.phases[k] == "backward"][0]:
                                  [k for k in range(t.num_ops) if t.phases[k] == "backward"][0] + 12].max()
             for d, t in tl.items()}
    assert start[None] - start[0.2] >= grad // 2


def test_a_scheduler_plans_and_runs_it_with_a_streamed_optimizer_exactly():
    """TENSILE records, plans (swaps, simulation) and runs the step with the weight
    gradients deferred and the update streamed into backward: trained as without either.
    (At 32x32 the activations, not the 256 KiB weight, make the peak: some can move.)"""
    data = batches(6, size=32, batch=8)
    m0, o0, _, _ = trained(data)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    handle = tensile.defer_weight_grads(model, min_mb=0)
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1)
    with pytest.warns(UserWarning, match="no plan meets the budget of 1 B"):  # swaps all it can
        sched = tensile.Scheduler(model, opt, data[0], LOSS, budget=1, allow_cross_iteration=False,
                                  allow_recompute=False, d2h_bw=1e10, h2d_bw=1e10,
                                  peak_flops=1e12, peak_bytes_per_s=1e11)
    for b in data:
        sched.step(*b)
    assert sched.plan.swaps and sched.runner.stats.swap_ins > 0
    assert streamed.late_updates == 0 and handle.deferred >= 2 * len(data)
    streamed.synchronize()
    assert_same(m0, o0, model, opt)


def test_what_it_does_not_defer_runs_as_usual():
    model = make_model()
    handle = tensile.defer_weight_grads(model, min_mb=0)
    x, _ = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(x), make_model()(x))
    lin = model[6]
    out = lin(torch.randn(2, 3, 256)).sum()    # three dimensions: autograd's own gradient
    out.backward()
    assert lin.weight.grad is not None and handle.deferred == 0
    handle.remove()
    assert "forward" not in vars(lin) and "forward" not in vars(model[9])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"no nn.Linear layer .* at least 1 MiB .*6 0.2, 9 0.0"):
        tensile.defer_weight_grads(make_model(), min_mb=1)
    with pytest.raises(ValueError, match=r"min_mb: expected MiB >= 0"):
        tensile.defer_weight_grads(make_model(), min_mb=-1)
    with pytest.raises(TypeError, match=r"torch.nn.Module"):
        tensile.defer_weight_grads(lambda x: x)
    model = make_model()
    tensile.defer_weight_grads(model, min_mb=0)
    with pytest.raises(ValueError, match=r"deferred twice"):
        tensile.defer_weight_grads(model, min_mb=0)
    model = make_model()
    model[6].weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match=r"register_hook"):
        tensile.defer_weight_grads(model, min_mb=0)


def test_a_backward_that_fails_leaves_nothing_for_the_next_one():
    """A backward that raises after a deferred layer's node ran never reaches its end: the
    next backward makes only its own gradients, as autograd would."""
    model, ref = make_model(), make_model()
    handle = tensile.defer_weight_grads(model, min_mb=0)
    x, y = batches(1)[0]

    def fail(grad):
        raise RuntimeError("boom")
    h = model[0].weight.register_hook(fail)      # the first layer's: after the head's nodes
    with pytest.raises(RuntimeError, match="boom"):
        LOSS(model(x), y).backward()
    h.remove()
    for p in model.parameters():
        p.grad = None
    LOSS(model(x), y).backward()
    LOSS(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert handle.deferred == 2
    with pytest.raises(RuntimeError, match="boom"):    # and remove() drops what it left
        h = model[0].weight.register_hook(fail)
        LOSS(model(x), y).backward()
    h.remove()
    before = [p.grad.clone() for p in model.parameters()]
    handle.remove()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))


def test_a_backward_that_builds_a_graph_through_a_deferred_layer_is_refused():
    model = make_model()
    tensile.defer_weight_grads(model, min_mb=0)
    x, y = batches(1)[0]
    x.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"create_graph=True .* not supported; remove\(\) the handle"):
        torch.autograd.grad(LOSS(model(x), y), x, create_graph=True)
