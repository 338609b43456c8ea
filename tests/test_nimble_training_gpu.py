"""Nimble training capture (fwd-bwd and whole step) against eager training. GPU only."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from experiments.models import build_model
from nimble import Nimble, NimbleError

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("strict_fp32"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# TF32 off. cuDNN's backward kernels are not bitwise deterministic (atomics), so two eager
# runs already drift apart slightly over 20 steps: the stated tolerance is a relative L2
# error of 1e-3 per parameter tensor after 20 steps.
TOL = 1e-3
CIFAR = ["mobilenet_v2", "efficientnet_b0", "resnet50"]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def cifar_model(name):
    return build_model(name, num_classes=10).cuda().train()


def batches(n, batch=32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(batch, 3, 32, 32, device="cuda", generator=g),
             torch.randint(0, 10, (batch,), device="cuda", generator=g)) for _ in range(n)]


def make_opt(kind, model, capturable=False):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-3, capturable=capturable)


def eager_train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def assert_close_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert rel_err(q, p) < TOL, name
    for (name, t), u in zip(a.named_buffers(), b.buffers()):
        if t.is_floating_point():
            assert rel_err(u, t) < TOL, name


@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
@pytest.mark.parametrize("name", CIFAR)
def test_fwd_bwd_training_matches_eager(name, opt_kind):
    data = batches(20)
    ref = cifar_model(name)
    model = copy.deepcopy(ref)
    eager_train(ref, make_opt(opt_kind, ref), data)
    fast = Nimble(model).prepare(data[0][0], training=True, use_multi_stream=True)
    opt = make_opt(opt_kind, model)
    for x, y in data:                       # the ordinary loop: zero_grad() sets .grad to None
        opt.zero_grad()
        loss = F.cross_entropy(fast(x), y)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
    assert_close_params(ref, model)


@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
@pytest.mark.parametrize("name", CIFAR)
def test_whole_step_matches_eager(name, opt_kind):
    data = batches(20)
    ref = cifar_model(name)
    model = copy.deepcopy(ref)
    eager_train(ref, make_opt(opt_kind, ref), data)
    opt = make_opt(opt_kind, model, capturable=True)
    step = Nimble(model).prepare_step(data[0][0], data[0][1], F.cross_entropy, opt)
    for x, y in data:
        loss = step((x,), y)
        assert torch.isfinite(loss)
    assert_close_params(ref, model)


def test_prepare_leaves_parameters_buffers_and_grads():
    model = cifar_model("resnet50")
    x = torch.randn(8, 3, 32, 32, device="cuda")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Nimble(model).prepare(x, training=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_batchnorm_statistics_update_on_every_replay():
    model = cifar_model("mobilenet_v2")
    ref = copy.deepcopy(model)
    fast = Nimble(model).prepare(torch.randn(8, 3, 32, 32, device="cuda"), training=True)
    for x, _ in batches(3, batch=8):
        fast(x)
        ref(x)
    for (name, t), u in zip(ref.named_buffers(), model.buffers()):
        if "running" in name:
            assert rel_err(u, t) < TOL, name


class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_dropout_draws_new_masks_on_every_replay():
    model = Dropper().cuda().train()
    x = torch.randn(16, 64, device="cuda")
    fast = Nimble(model).prepare(x, training=True)
    first = (fast(x) == 0).clone()
    second = (fast(x) == 0).clone()
    assert 0.3 < first.float().mean().item() < 0.7
    assert not torch.equal(first, second)


def test_wrong_shapes_are_rejected():
    model = cifar_model("mobilenet_v2")
    x, y = batches(1, batch=8)[0]
    fast = Nimble(model).prepare(x, training=True)
    with pytest.raises(NimbleError, match="prepared for shape"):
        fast(torch.randn(4, 3, 32, 32, device="cuda"))
    step = Nimble(cifar_model("mobilenet_v2")).prepare_step(
        x, y, F.cross_entropy, make_opt("sgd", model))
    with pytest.raises(ValueError, match="target: prepared for shape"):
        step((x,), y[:4])


def test_adam_without_capturable_is_refused_for_whole_step():
    model = cifar_model("mobilenet_v2")
    x, y = batches(1, batch=8)[0]
    with pytest.raises(ValueError, match="capturable=True"):
        Nimble(model).prepare_step(x, y, F.cross_entropy, torch.optim.Adam(model.parameters()))
