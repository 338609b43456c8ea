"""tensile.compact on the CPU: identity, values, training after it, shared storages, graphs."""
import copy

import pytest
import torch
from torch import nn

import tensile
from tensile.compact import _long_lived
from tensile.graph import GraphStep, memory_changes


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 4))


def _train(model, opt, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 4, (2,), generator=g)
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_every_long_lived_tensor_moves_and_keeps_its_identity_and_values():
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    tensors = list(_long_lived(model, opt))
    before = [(t, t.data_ptr(), t.clone()) for t in tensors]
    count = tensile.compact_count()
    result = tensile.compact(model, opt)
    assert result.moved == len(tensors) and result.kept == 0
    assert result.moved_bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert tensile.compact_count() == count + 1
    for t, ptr, value in before:
        assert t.data_ptr() != ptr                 # new memory ...
        assert torch.equal(t, value)               # ... same bits
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_training_after_a_compaction_is_bit_identical():
    a = _net()
    b = copy.deepcopy(a)
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    _train(a, opt_a, 1)
    _train(b, opt_b, 1)
    state_ids = {id(v) for s in opt_b.state.values() for v in s.values()}
    tensile.compact(b, opt_b)
    assert {id(v) for s in opt_b.state.values() for v in s.values()} == state_ids
    _train(a, opt_a, 3)
    _train(b, opt_b, 3)
    for p, q in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(p, q)
    for sa, sb in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_tensor_that_shares_its_storage_stays_where_it_is():
    model = _net()
    alias = model[4].weight.data.view(-1)      # someone else's view of the weight
    model.register_buffer("part", model[1].running_mean.data[:4])   # a view of a buffer
    result = tensile.compact(model)
    assert result.kept >= 3                    # the weight, the running mean and the view
    with torch.no_grad():
        model[4].weight[0, 0] = 42.0
        model[1].running_mean[0] = 7.0
    assert alias[0] == 42.0                    # still the same memory
    assert model.part[0] == 7.0


def test_nothing_to_move_counts_nothing_and_a_model_without_parameters_is_refused():
    model = _net()
    views = [t.data.view_as(t) for t in [*model.parameters(), *model.buffers()]]
    count = tensile.compact_count()
    result = tensile.compact(model)
    assert result.moved == 0 and result.kept == len(views)
    assert tensile.compact_count() == count
    with pytest.raises(ValueError, match="no parameters: pass device="):
        tensile.compact(nn.ReLU())
    assert tensile.compact(nn.ReLU(), device="cpu").moved == 0


def test_a_graph_captured_before_a_compaction_refuses_to_replay():
    """GraphStep's guard, without a GPU: the graph itself is never touched."""
    graph = GraphStep.__new__(GraphStep)      # what __init__ leaves, less the CUDA graph
    graph.static_batch, graph.graph = (torch.zeros(2),), None
    graph.changes_at_capture = memory_changes()
    assert not graph.stale
    tensile.compact(_net())
    assert graph.stale
    with pytest.raises(RuntimeError, match=r"tensile.compact\(\).*capture the step again"):
        graph(torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="gives back CUDA allocator segments: "
                                                          "needs a CUDA GPU")
def test_on_the_gpu_the_holes_between_long_lived_tensors_go_back():
    """Ten 4 MiB buffers allocated between ten 4 MiB temporaries share 20 MiB segments with
    them; with the temporaries freed the segments stay, half empty. After the compaction the
    buffers fill whole segments: the reservation halves, and the buffers keep their values."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    holder, junk = nn.Module(), []
    for i in range(10):
        holder.register_buffer(f"b{i}", torch.full((1 << 20,), float(i), device="cuda"))
        junk.append(torch.empty(1 << 20, device="cuda"))
    del junk
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved() - base
    assert held >= 80 << 20                         # every segment still holds a buffer
    result = tensile.compact(holder, device="cuda")
    assert result.moved == 10 and result.moved_bytes == 40 << 20
    assert torch.cuda.memory_reserved() - base <= 40 << 20
    assert result.reserved_before - result.reserved_after >= 40 << 20
    assert all(torch.equal(b, torch.full_like(b, float(i))) for i, b in enumerate(holder.buffers()))
