"""tensile.stream_optimizer on the CPU: updates inside backward, state in host regions."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tensile
from tensile.resident import install_streamed
from nimble.training import put_back_step_state, save_step_state, step_state_kept
from tensile.step import training_step

LOSS = nn.functional.cross_entropy


class WithSpare(nn.Module):
    """A model with a layer it never calls: that layer never gets a gradient."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.spare = body, nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


def make_model(unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    return WithSpare(model) if unused else model


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
            for _ in range(n)]


def states(model, opt):
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        out += [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def assert_same_training(m0, o0, model, opt):
    """Every parameter and optimizer state tensor equal, bit for bit."""
    for a, b in zip(states(m0, o0), states(model, opt), strict=True):
        assert torch.equal(a, b)


def streamed_model(groups: int, unused: bool = False, prefetch: int = 1, resident: int = 0, **adam):
    """A fresh model and its Adam, streamed in ``groups`` groups."""
    model = make_model(unused)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **adam)
    return model, opt, tensile.stream_optimizer(opt, groups=groups, prefetch=prefetch,
                                                resident=resident)


def train_plain(data, **adam):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **adam)
    for b in data:
        training_step(model, opt, b, LOSS)
    return model, opt


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_updates_in_backward_train_bit_for_bit_like_one_step_after_it(prefetch, fused):
    data = batches(6)
    m0, o0 = train_plain(data, weight_decay=0.01, fused=fused)
    model, opt, streamed = streamed_model(3, prefetch=prefetch, weight_decay=0.01, fused=fused)
    for b in data:
        training_step(model, opt, b, LOSS)
    assert len(streamed.groups) == 3
    # the first step creates the state after backward; every later one updates in backward
    assert streamed.updates_in_backward == 3 * (len(data) - 1) and streamed.late_updates == 0
    assert_same_training(m0, o0, model, opt)


def test_gradients_are_gone_when_backward_ends_and_the_state_lives_in_host_regions():
    data = batches(3)
    model, opt, streamed = streamed_model(2)
    training_step(model, opt, data[0], LOSS)          # creates the state
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    LOSS(model(data[1][0]), data[1][1]).backward()
    assert all(p.grad is None for p in model.parameters())      # freed by each group's update
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # updated
    opt.step()                                                   # finishes the step: nothing left
    assert streamed.late_updates == 0
    regions = {g.host.untyped_storage().data_ptr() for g in streamed.groups}
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert streamed.homes(p, key)
            assert opt.state[p][key].untyped_storage().data_ptr() in regions
        assert not streamed.homes(p, "step")


def test_a_parameter_without_a_gradient_is_left_to_step_and_still_exact():
    """A group whose parameters did not all get a gradient updates after backward."""
    data = batches(4)
    m0 = make_model(unused=True)
    o0 = torch.optim.Adam(m0.parameters(), lr=1e-2)
    model, opt, streamed = streamed_model(4, unused=True)
    for b in data:
        training_step(m0, o0, b, LOSS)
        training_step(model, opt, b, LOSS)
    spare = streamed._group_of[id(model.spare.weight)]
    assert streamed.late_updates == len(data) - 1            # the spare's group, every step
    assert streamed.updates_in_backward == (len(streamed.groups) - 1) * (len(data) - 1)
    assert model.spare.weight not in opt.state and spare == 0   # first in backward's order
    assert_same_training(m0, o0, model, opt)


def test_state_dict_round_trip_and_remove():
    data = batches(3)
    model, opt, streamed = streamed_model(2)
    for b in data[:2]:
        training_step(model, opt, b, LOSS)
    saved = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    sd = opt.state_dict()
    opt.load_state_dict(sd)                          # back in host regions, same values
    p0 = next(model.parameters())
    assert streamed.homes(p0, "exp_avg")
    for k, v in saved.items():
        assert torch.equal(opt.state[p0][k], v)
    training_step(model, opt, data[2], LOSS)
    streamed.remove()
    assert not hasattr(opt, "_tensile_streamed") and opt.step.__func__ is torch.optim.Adam.step
    training_step(model, opt, data[0], LOSS)         # a plain optimizer again


@pytest.mark.parametrize("make, match", [
    (lambda m: torch.optim.LBFGS(m.parameters()), "LBFGS"),
    (lambda m: "adam", "must be a torch.optim.Optimizer"),
])
def test_what_cannot_update_in_backward_is_refused(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        tensile.stream_optimizer(make(make_model()))


def test_bad_groups_twice_and_a_closure_are_refused():
    opt = torch.optim.Adam(make_model().parameters())
    with pytest.raises(ValueError, match="groups: expected an int >= 1, got 0"):
        tensile.stream_optimizer(opt, groups=0)
    with pytest.raises(ValueError, match=r"prefetch: expected an int >= 1 \(groups copied in ahead\), got 0"):
        tensile.stream_optimizer(opt, prefetch=0)
    tensile.stream_optimizer(opt)
    with pytest.raises(ValueError, match="streamed already"):
        tensile.stream_optimizer(opt)
    with pytest.raises(ValueError, match="takes no closure"):
        opt.step(lambda: 0.0)


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("chunk", [None, 1 / 1024], ids=["whole", "sliced"])
def test_a_scheduler_plans_and_runs_the_streamed_step_exactly(chunk, fused):
    """The step TENSILE records has the updates and copies in backward and no optimizer state
    among its device tensors; planned and run (simulation), it trains like the plain step,
    also with its updates on 1 KiB slices (the 2.3 KiB conv weights sliced), and with fused
    Adam (one update kernel per call) as with the foreach one."""
    data = batches(8)
    m0, o0 = train_plain(data, fused=fused)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, update_chunk_mb=chunk)
    sched = tensile.Scheduler(model, opt, data[0], LOSS, budget=1, allow_cross_iteration=False,
                              allow_recompute=False, d2h_bw=1e10, h2d_bw=1e10,
                              peak_flops=1e12, peak_bytes_per_s=1e11)
    # Adam's moments are host memory now: what stays optimizer state are the step counts
    assert {key for _, key in sched.recording.opt_state_keys.values()} == {"step"}
    nodes = sched.recording.graph.nodes
    assert not [n for n in nodes if n.phase == "optimizer"]   # every update ran in backward
    copies = [n for n in nodes if n.phase == "backward" and n.name == "aten.copy_.default"
              and n.input_dtypes[0] == "torch.uint8"]            # the state's regions, as bytes
    assert len(copies) == 2 * len(streamed.groups)            # each group's state in and out
    for b in data:
        sched.step(*b)
    assert sched.plan.swaps and sched.runner.stats.swap_ins > 0
    assert streamed.updates_in_backward == 3 * len(data)      # the recording's step, then 7
    assert_same_training(m0, o0, model, opt)
    # fused: one update op per call (a group, or a slice of a parameter); else none
    fused_calls = sum(n.name == "aten._fused_adam_.default" for n in nodes)
    assert fused_calls >= len(streamed.groups) if fused else fused_calls == 0


def test_more_prefetch_holds_more_state_on_the_device():
    """``prefetch`` groups come in ahead of the one updating: with all of them ahead, all the
    moments are on the device at backward's start (the recording's memory says so)."""
    peaks = {}
    for prefetch in (1, 4):
        model, opt, streamed = streamed_model(4, prefetch=prefetch)
        data = batches(2)
        training_step(model, opt, data[0], LOSS)            # creates the state
        rec = tensile.record_step(model, opt, data[1], LOSS)
        peaks[prefetch] = int(rec.timeline([1.0] * len(rec.graph.nodes)).vanilla_curve().max())
    moments = 2 * sum(p.numel() * p.element_size() for p in make_model().parameters())
    assert peaks[4] - peaks[1] >= moments / 4


def test_state_a_later_first_update_creates_moves_to_the_host_too():
    """A parameter whose first gradient comes after the state exists (a branch used from the
    third step on): its state is created on the device by that update, then homed."""
    class LateBranch(WithSpare):
        use_spare = False

        def forward(self, x):
            out = self.body(x)
            return out + self.spare(out[:, :4]).sum() if self.use_spare else out

    def make(opt_cls=torch.optim.Adam):
        model = LateBranch(make_model())
        return model, opt_cls(model.parameters(), lr=1e-2)

    data = batches(5)
    m0, o0 = make()
    model, opt = make()
    streamed = tensile.stream_optimizer(opt, groups=3)
    for i, b in enumerate(data):
        m0.use_spare = model.use_spare = i >= 2
        training_step(m0, o0, b, LOSS)
        training_step(model, opt, b, LOSS)
        if i == 2:
            assert streamed.homes(model.spare.weight, "exp_avg")
    assert_same_training(m0, o0, model, opt)


def test_resident_groups_keep_their_state_on_the_device_and_train_exactly():
    """``resident=k``: the first k groups backward updates (the output side) keep their state
    on the device, updated in backward without copies; the others stream; training is exact
    and the recording holds the resident state's bytes through the step."""
    data = batches(6)
    m0, o0 = train_plain(data)
    model, opt, streamed = streamed_model(4, resident=2)
    for b in data:
        training_step(model, opt, b, LOSS)
    assert_same_training(m0, o0, model, opt)
    for i, g in enumerate(streamed.groups):
        for p in g.params:
            for key in ("exp_avg", "exp_avg_sq"):
                assert streamed.homes(p, key) == (i >= 2), (i, key)
    assert streamed.updates_in_backward == 4 * (len(data) - 1)
    resident_bytes = sum(2 * p.numel() * p.element_size() for g in streamed.groups[:2] for p in g.params)
    starts = {}
    for resident in (0, 2):
        model, opt, _ = streamed_model(4, resident=resident)
        training_step(model, opt, data[0], LOSS)
        rec = tensile.record_step(model, opt, data[1], LOSS)
        starts[resident] = int(rec.timeline([1.0] * len(rec.graph.nodes)).vanilla_curve()[0])
    assert starts[2] - starts[0] == resident_bytes


def _linear_chain(dims: list[int], steps: int, seed: int, bias: bool = True, lr: float = 1e-2):
    """``make()`` for a chain of linear layers of widths ``dims`` with its Adam, ``steps``
    random batches, and a plain model trained on them (the reference)."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(a, b, bias=bias) for a, b in zip(dims, dims[1:])])
        return model, torch.optim.Adam(model.parameters(), lr=lr)

    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(4, dims[0], generator=g), torch.randint(0, dims[-1], (4,), generator=g))
            for _ in range(steps)]
    m0, o0 = make()
    for b in data:
        training_step(m0, o0, b, LOSS)
    return make, data, (m0, o0)


def test_the_ring_reuses_prefetch_plus_one_slots_and_copies_each_group_once():
    """Six equal layers in six groups: during backward the state comes in through
    ``prefetch + 1`` device slots, each reused in turn, and each group's state comes in once
    and goes out once; training stays exact."""
    make, data, (m0, o0) = _linear_chain([16] * 7, steps=4, seed=2)
    for prefetch in (1, 2):
        model, opt = make()
        streamed = tensile.stream_optimizer(opt, groups=6, prefetch=prefetch)
        for b in data[:-1]:
            training_step(model, opt, b, LOSS)
        rec = tensile.record_step(model, opt, data[-1], LOSS)
        assert_same_training(m0, o0, model, opt)
        copies = [n for n in rec.graph.nodes if n.phase == "backward" and n.name == "aten.copy_.default"]
        assert len(copies) == 2 * len(streamed.groups) == 12
        # the copies in write device slots (host regions count no device bytes)
        slots = [sid for n in copies for sid in n.writes if n.storage_bytes[sid]]
        assert len(slots) == 6 and len(set(slots)) == prefetch + 1
        assert slots[:prefetch + 1] * 2 == slots[:2 * (prefetch + 1)]   # in turn
        # the recording lists them as the step's own copies, for the planner's channels
        assert rec.transfers == sorted((n.index, "h2d" if n.writes[0] in slots else "d2h",
                                        streamed.groups[0].host.numel()) for n in copies)
        assert [d for _, d, _ in rec.transfers].count("h2d") == 6
        assert rec.timeline([1.0] * len(rec.graph.nodes)).transfers == tuple(rec.transfers)


def test_a_far_larger_first_group_does_not_size_the_slots_of_the_small_ones():
    """VGG-16's shape: backward first updates two large layers, then many small ones. The
    small groups' state comes in through slots of their own size, not the large ones'."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 256), nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    streamed = tensile.stream_optimizer(opt, groups=6, prefetch=1)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 8, (4,), generator=g)) for _ in range(2)]
    training_step(model, opt, data[0], LOSS)
    rec = tensile.record_step(model, opt, data[1], LOSS)
    needs = [grp.host.numel() for grp in streamed.groups]
    copies = [n for n in rec.graph.nodes if n.phase == "backward" and n.name == "aten.copy_.default"]
    slot_bytes = [n.storage_bytes[sid] for n in copies for sid in n.writes if n.storage_bytes[sid]]
    assert len(slot_bytes) == len(needs)
    large = max(needs)
    for need, got in zip(needs, slot_bytes):
        assert need <= got <= 2 * max(need, max(n for n in needs if n < large)), (needs, slot_bytes)


def _wide(seed: int = 0) -> nn.Module:
    """A 256x256 layer (256 KiB of weights) between small ones."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _wide_batches(n: int):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 16, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, fused=True),
], ids=["adam", "amsgrad", "adamw", "sgd", "adam_fused"])
@pytest.mark.parametrize("resident", [0, 3])
def test_a_chunked_update_trains_bit_for_bit_and_steps_on_at_most_the_chunk(make_opt, resident):
    """``update_chunk_mb``: every call of the optimizer's own step takes at most that many
    bytes of parameters (the 256 KiB weight in 16 KiB slices), and training is exact."""
    data = _wide_batches(5)
    m0 = _wide()
    o0 = make_opt(m0.parameters())
    for b in data:
        training_step(m0, o0, b, LOSS)
    model = _wide()
    opt = make_opt(model.parameters())
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, resident=resident,
                                        update_chunk_mb=1 / 64)
    calls = []
    original = streamed._original["step"]

    def counting_step():
        calls.append([p for g in opt.param_groups for p in g["params"]])
        return original()

    streamed._original["step"] = counting_step
    for b in data:
        training_step(model, opt, b, LOSS)
    assert_same_training(m0, o0, model, opt)
    later = calls[1:]   # the first step creates the state whole, after backward
    assert max(sum(p.numel() * p.element_size() for p in c) for c in later) <= 16 * 1024
    own = {id(p) for p in model.parameters()}
    slices = [p for c in later for p in c if id(p) not in own]
    assert len(slices) == 16 * (len(data) - 1)   # 65536 weights in slices of 4096, each step
    assert not any(p in opt.state for p in slices)   # their state was the weight's, lent


def test_a_chunked_update_lowers_the_recorded_peak_by_the_temporaries_it_bounds():
    """Adam's update makes a temporary as large as the parameters it updates: the 256 KiB
    weight's sits on the recorded step's peak, and 16 KiB slices take about 240 KiB off it,
    or up to the weight's size more: a whole update also holds the weight's gradient beside
    that temporary (it goes when the group's update is done; ``AccessTimeline.held_to``)."""
    data = _wide_batches(3)
    peaks = {}
    for chunk in (None, 1 / 64):
        model = _wide()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        tensile.stream_optimizer(opt, groups=3, prefetch=1, update_chunk_mb=chunk)
        for b in data[:-1]:
            training_step(model, opt, b, LOSS)
        rec = tensile.record_step(model, opt, data[-1], LOSS)
        peaks[chunk] = max(rec.timeline([1.0] * len(rec.graph.nodes)).vanilla_curve())
    weight = 256 * 256 * 4
    assert weight - 2 * 16 * 1024 <= peaks[None] - peaks[1 / 64] <= 2 * weight


@pytest.mark.parametrize("chunk", [0, -1.0, True, "64"])
def test_a_bad_update_chunk_is_refused(chunk):
    opt = torch.optim.Adam(make_model().parameters())
    with pytest.raises(ValueError, match=r"update_chunk_mb: expected MiB > 0 .* got"):
        tensile.stream_optimizer(opt, update_chunk_mb=chunk)


def _train_streamed(dims: list[int], prefetch: int, seed: int, spy, bias: bool = True):
    """A chain of linear layers of ``dims``, one group each, trained three steps plain and
    streamed (bit for bit the same: asserted), ``spy(streamed)`` called before the steps."""
    make, data, (m0, o0) = _linear_chain(dims, steps=3, seed=seed, bias=bias)
    model, opt = make()
    streamed = tensile.stream_optimizer(opt, groups=len(dims) - 1, prefetch=prefetch)
    spy(streamed)
    for b in data:
        training_step(model, opt, b, LOSS)
    assert_same_training(m0, o0, model, opt)


def _give_backs(dims: list[int], prefetch: int, seed: int) -> list[tuple[int, bool, bool]]:
    """:func:`_train_streamed` without biases (one parameter a group). Returns per slot given
    back during backward: how many updates since its copy-out was issued, whether the group
    coming was more than twice its size, and whether no group was left to bring in (the tail)."""
    given_back = []

    def spy(s):
        assert [len(grp.params) for grp in s.groups] == [1] * (len(dims) - 1)
        retire = s._retire

        def retiring(slot):
            coming = s._needs[s._next_in] if s._next_in < len(s._needs) else 0
            given_back.append((s._updates - slot.freed_at, coming > 2 * slot.device.numel(),
                               not s._to_bring_in()))
            retire(slot)
        s._retire = retiring

    _train_streamed(dims, prefetch, seed, spy, bias=False)
    return given_back


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_too_small_slot_is_given_back_only_after_its_copy_out_had_time(prefetch):
    """Groups only about equal: a slot too small for the group that comes leaves the ring for
    a larger one, and is given back (the compute stream waiting for its copy-out) only
    ``prefetch + 1`` updates after that copy-out was issued, never at once (the code before
    gave it back with 0 updates between); training stays exact."""
    given_back = _give_backs([13, 7, 12, 12, 10, 10, 12], prefetch, seed=3)   # about equal
    # never at once; at backward's tail (nothing left to bring in) one update after the
    # copy-out, before it prefetch + 1 (six groups: with prefetch 2 all go at the tail)
    assert given_back and all(n >= 1 for n, _, _ in given_back), given_back
    before_tail = [n for n, _, tail in given_back if not tail]
    assert all(n >= prefetch + 1 for n in before_tail) and (before_tail or prefetch > 1), given_back


def _slots_at_backwards_end(prefetch: int) -> list[int]:
    """:func:`_train_streamed` on six equal layers; per step with state, the slots left when
    backward ends."""
    at_end = []

    def spy(s):
        finish = s._finish

        def finishing():
            at_end.append(len(s._slots))
            finish()
        s._finish = finishing

    _train_streamed([16] * 7, prefetch, seed=2, spy=spy)
    return at_end


@pytest.mark.parametrize("prefetch", [1, 2])
def test_at_backwards_tail_free_slots_are_given_back_not_kept_to_its_end(prefetch):
    """Once every group is in a slot, fewer than ``prefetch + 1`` updates remain: each slot
    freed then goes one update after its copy-out, so when backward ends only the last
    group's slot is left (the code before kept all ``prefetch + 1`` over backward's last
    layers). Training stays exact."""
    assert _slots_at_backwards_end(prefetch) == [1, 1]   # the first step has no state yet


def test_tail_wait_none_keeps_the_free_slots_to_backwards_end(monkeypatch):
    """``TAIL_WAIT = None`` turns the tail give-back off: all ``prefetch + 1`` slots are still
    there when backward ends, and training is the same."""
    monkeypatch.setattr(tensile.streamed, "TAIL_WAIT", None)
    assert _slots_at_backwards_end(prefetch=2) == [3, 3]


@pytest.mark.parametrize("groups", [4, 8, 16])
def test_from_eight_groups_the_first_and_last_are_a_quarter_of_the_others(groups):
    """Backward's first update waits for the first group's copy in and the step's end for the
    last group's copy out: from eight groups on those two are a quarter of the others' bytes;
    below, all are equal. Training stays exact either way."""
    make, data, (m0, o0) = _linear_chain([16] * 65, steps=3, seed=4, bias=False, lr=1e-3)
    model, opt = make()
    streamed = tensile.stream_optimizer(opt, groups=groups)
    for b in data:
        training_step(model, opt, b, LOSS)
    assert_same_training(m0, o0, model, opt)
    sizes = [len(grp.params) for grp in streamed.groups]   # equal layers: bytes go by count
    assert len(sizes) == groups and sum(sizes) == 64
    middle = sizes[1:-1]
    mean = sum(middle) / len(middle)
    assert max(middle) - min(middle) <= 1
    for end in (sizes[0], sizes[-1]):   # within one layer of the share
        if groups >= 8:
            assert abs(end - tensile.streamed.END_SHARE * mean) <= 1 and end < mean / 2, sizes
        else:
            assert abs(end - mean) <= 1, sizes


def test_a_slot_far_too_small_is_given_back_at_once_memory_first():
    """A group more than twice the size of the free slot (VGG-16's fully connected layers
    after a small group): that slot is given back at once, its memory before the wait; slots
    only a little too small still leave lazily. Training stays exact."""
    given_back = _give_backs([32, 4, 24, 32, 6, 32, 32], prefetch=1, seed=5)   # very unequal
    assert any(far and n < 2 for n, far, _ in given_back), given_back      # at once
    assert all(far or tail or n >= 2 for n, far, tail in given_back), given_back  # else lazily


# --------------------------------------------------------------------------- slices

def make_head() -> nn.Module:
    """A classifier whose middle layer (48 x 64 floats, 12 KiB) is far larger than the others."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 10))


def head_batches(n: int):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(n)]


def train_head(data, slice_mb=None, defer=False, resident=0, slice_resident=0, **adam):
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **adam)
    handle = tensile.defer_weight_grads(model, min_mb=0.005) if defer else None
    streamed = None if slice_mb is False else \
        tensile.stream_optimizer(opt, groups=3, prefetch=1, resident=resident, slice_mb=slice_mb,
                                 slice_resident=slice_resident)
    for b in data:
        training_step(model, opt, b, LOSS)
    return model, opt, streamed, handle


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("defer", [False, True], ids=["gradient", "deferred"])
@pytest.mark.parametrize("resident", [0, 3])
def test_a_sliced_parameter_trains_bit_for_bit_with_its_state_on_the_host(defer, resident, fused):
    """``slice_mb``: the two larger weights (12 and 8 KiB) stream their state in 4 KiB slices
    of whole rows, each its own group, updated from the gradient's rows (or the deferred
    product's rows) one at a time over the rest of backward; ``resident`` counts the other
    groups. Parameters, moments and step counts match one ``step()`` after backward."""
    data = head_batches(6)
    m0, o0, _, _ = train_head(data, slice_mb=False, weight_decay=0.01, fused=fused)
    model, opt, streamed, handle = train_head(data, slice_mb=4 / 1024, defer=defer,
                                              resident=resident, weight_decay=0.01, fused=fused)
    slices = [(g.params[0].shape, g.rows) for g in streamed.groups if g.rows is not None]
    assert slices == [((48, 64), (0, 1024)), ((48, 64), (1024, 2048)), ((48, 64), (2048, 3072)),
                      ((64, 32), (0, 1024)), ((64, 32), (1024, 2048))]
    # the other parameters in groups = 3 groups, in backward's order around the slices
    whole = [[tuple(p.shape) for p in g.params] for g in streamed.groups if g.rows is None]
    assert whole == [[(10,), (10, 48)], [(48,)], [(64,)]] and streamed.resident == resident
    assert_same_training(m0, o0, model, opt)
    for layer in (model[2], model[0]):   # a sliced weight's state lives on the host, whole
        assert streamed.homes(layer.weight, "exp_avg") and streamed.homes(layer.weight, "exp_avg_sq")
        assert opt.state[layer.weight]["exp_avg"].device.type == "cpu"
        assert layer.weight.grad is None
    # every slice updated in backward in the five steps after the first (that one makes state)
    assert streamed.updates_in_backward == 5 * len(streamed.groups) and streamed.late_updates == 0
    if defer:   # the deferred product went to the slices, row slice by row slice (the first
        assert handle.deferred == len(data)   # layer's input needs no gradient: not deferred)


def test_slices_go_one_at_a_time_over_the_gradients_still_to_come():
    """Queued slices are due evenly over the hooks backward still has to run (counted in the
    step before), not all at once where the gradient lands."""
    data = head_batches(3)
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, slice_mb=4 / 1024)
    order = []
    update = streamed._update
    streamed._update = lambda g: (order.append((g, streamed._hooks_seen)), update(g))[-1]
    for b in data:
        training_step(model, opt, b, LOSS)
    last = order[-len(streamed.groups):]          # the last step's updates, with the hook count
    seen = {g: h for g, h in last}
    slices = [i for i, g in enumerate(streamed.groups) if g.rows is not None]
    # the 12 KiB weight's gradient comes at hook 4 of 6, two more to come: its 3 slices go
    # at hooks 4, 4 and 5 (slice k at 4 + k * 2 // 3); the 8 KiB weight's at the last hook
    assert [seen[g] for g in slices] == [4, 4, 5, 6, 6]
    assert streamed._hooks_total == 6


def test_kept_slices_go_at_once_and_the_streamed_ones_spread_over_the_rest():
    """With the last 3 slices kept, the 12 KiB weight's last slice updates at once (hook 4)
    and its two streamed slices spread over the two hooks still to come (4 and 5, where
    with none kept all three share them); the 8 KiB weight's kept slices go at hook 6."""
    data = head_batches(3)
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, slice_mb=4 / 1024,
                                        slice_resident=3)
    order = []
    update = streamed._update
    streamed._update = lambda g: (order.append((g, streamed._hooks_seen)), update(g))[-1]
    for b in data:
        training_step(model, opt, b, LOSS)
    seen = dict(order[-len(streamed.groups):])
    slices = [i for i, g in enumerate(streamed.groups) if g.rows is not None]
    assert [seen[g] for g in slices] == [4, 5, 4, 6, 6]


def test_a_sliced_state_round_trips_and_remove_brings_it_back_whole():
    data = head_batches(4)
    m0, o0, _, _ = train_head(data, slice_mb=False)
    model, opt, streamed, _ = train_head(data[:2], slice_mb=4 / 1024, defer=True)
    saved = opt.state_dict()
    opt.load_state_dict(saved)           # homes the state again, in the same host regions' shape
    for b in data[2:]:
        training_step(model, opt, b, LOSS)
    assert_same_training(m0, o0, model, opt)
    streamed.remove()
    assert all(v.device.type == "cpu" and v.is_contiguous()   # CPU run: the device is the CPU too
               for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    assert not hasattr(model[2].weight, "_tensile_rows")
    assert_same_training(m0, o0, model, opt)


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("defer", [False, True], ids=["gradient", "deferred"])
@pytest.mark.parametrize("kept", [2, 3])
def test_kept_slices_train_bit_for_bit_with_no_copies_and_their_rows_on_the_device(kept, defer,
                                                                                   fused):
    """``slice_resident``: the last slices backward updates keep their state on the device.
    With 2 that is every slice of the first layer's weight: its state stays on the device whole.
    With 3 it is also the last slice of the 12 KiB weight, whose other rows still stream: its
    rows live in device buffers, and the host region has them only after ``synchronize()``."""
    data = head_batches(5)
    m0, o0, _, _ = train_head(data, slice_mb=False, fused=fused)
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    tensile.defer_weight_grads(model, min_mb=0.005) if defer else None
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, slice_mb=4 / 1024,
                                        slice_resident=kept)
    brought_in = []
    bring_in = streamed._bring_in
    streamed._bring_in = lambda g, slot: (brought_in.append(g), bring_in(g, slot))[-1]
    for b in data:
        training_step(model, opt, b, LOSS)
    slices = [i for i, g in enumerate(streamed.groups) if g.rows is not None]
    assert streamed.slice_resident == kept and streamed._kept == set(slices[-kept:])
    assert brought_in and not set(brought_in) & streamed._kept   # the kept ones never copied
    assert not streamed.homes(model[0].weight, "exp_avg")          # every slice kept: on the device
    assert streamed.homes(model[2].weight, "exp_avg")              # some rows still stream
    partial = [g for g in streamed._kept if streamed.groups[g].params[0] is model[2].weight]
    if partial:   # the host region's kept rows are stale until synchronize() writes them
        (a, b), = [streamed.groups[g].rows for g in partial]
        ref = o0.state[m0[2].weight]["exp_avg"].view(-1)
        host = opt.state[model[2].weight]["exp_avg"].view(-1)
        assert torch.equal(host[:a], ref[:a]) and not torch.equal(host[a:b], ref[a:b])
        assert torch.equal(streamed.groups[partial[0]].dev[0], ref[a:b])
    streamed.synchronize()
    assert_same_training(m0, o0, model, opt)
    assert streamed.updates_in_backward == 4 * len(streamed.groups) and streamed.late_updates == 0


@pytest.mark.parametrize("kept", [0, 3])
def test_kept_slices_round_trip_through_state_dict_and_remove(kept):
    """``state_dict()`` gives the kept rows' newest values, ``load_state_dict`` of an older
    state puts its values back (in a new host region, the kept rows on the device), and
    ``remove()`` brings the whole state back: training goes on exactly. With none kept this
    caught the CPU run taking loaded tensors for views of the old region."""
    data = head_batches(5)
    m0, o0, _, _ = train_head(data, slice_mb=False)
    model, opt, streamed, _ = train_head(data[:2], slice_mb=4 / 1024, slice_resident=kept)
    saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    training_step(model, opt, data[2], LOSS)   # moves everything on, the kept rows too
    opt.load_state_dict(saved_opt)             # ... and back: the kept rows from what was saved
    model.load_state_dict(saved_model)
    for b in data[2:]:
        training_step(model, opt, b, LOSS)
    streamed.remove()
    assert all(g.dev is None for g in streamed.groups)
    assert_same_training(m0, o0, model, opt)


@pytest.mark.parametrize("kept", [0, 3])
def test_steps_inside_step_state_kept_leave_no_trace_on_the_kept_rows(kept):
    """``nimble.training.step_state_kept`` (around a capture's warm-up and timing replays)
    puts back the rows kept slices hold on the device too, not only ``optimizer.state``:
    training goes on as if the steps inside had not run. Before the fix the kept rows kept
    those steps' moments (an H100 run of the captured GPU test caught it)."""
    data = head_batches(6)
    m0, o0, _, _ = train_head(data[:2] + data[3:], slice_mb=False)
    model, opt, streamed, _ = train_head(data[:2], slice_mb=4 / 1024, slice_resident=kept)
    rows_before = [t.clone() for t in streamed.device_rows()]
    assert len(rows_before) == (2 if kept else 0)   # one partly kept weight: Adam's two moments
    with step_state_kept(model, opt):
        training_step(model, opt, data[2], LOSS)
        assert kept == 0 or not torch.equal(streamed.device_rows()[0], rows_before[0])
    assert all(torch.equal(a, b) for a, b in zip(rows_before, streamed.device_rows()))
    for b in data[3:]:
        training_step(model, opt, b, LOSS)
    streamed.synchronize()
    assert_same_training(m0, o0, model, opt)


def test_put_back_refuses_kept_rows_that_changed_since_the_save():
    """``remove()`` between ``save_step_state`` and ``put_back_step_state`` takes the kept rows
    away: putting back says so instead of restoring only part of the state."""
    model, opt, streamed, _ = train_head(head_batches(2), slice_mb=4 / 1024, slice_resident=3)
    saved = save_step_state(model, opt)
    streamed.remove()
    with pytest.raises(RuntimeError, match=r"device rows changed since the save \(shapes "
                                           r"\[\(\d+,\), \(\d+,\)\] then, \[\] now\)"):
        put_back_step_state(model, opt, saved, [p.grad for p in model.parameters()])


def test_slices_refuse_a_bad_size_and_resident_auto():
    model = make_head()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"slice_mb: expected MiB > 0 \(larger parameters stream"):
        tensile.stream_optimizer(opt, slice_mb=0)
    with pytest.raises(ValueError, match=r"resident='auto' times whole groups: it cannot go with "
                                         r"slice_mb"):
        install_streamed(model, opt, head_batches(1)[0], LOSS, groups=3, prefetch=1,
                                 resident="auto", slice_mb=1.0)
    with pytest.raises(ValueError, match=r"slice_resident=2 keeps slices' state on the device: "
                                         r"it needs slice_mb"):
        tensile.stream_optimizer(opt, groups=3, slice_resident=2)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"slice_resident: expected an int >= 0"):
            tensile.stream_optimizer(opt, groups=3, slice_mb=4 / 1024, slice_resident=bad)
    streamed = tensile.stream_optimizer(opt, groups=3, slice_mb=4 / 1024)
    with pytest.raises(ValueError, match=r"resident: expected an int from 0 to 3 \(the groups "
                                         r"that are not a parameter's slices\)"):
        streamed.set_resident(4)
    with pytest.raises(ValueError, match=r"tune_resident times whole groups"):
        tensile.tune_resident(streamed, model, head_batches(1)[0], LOSS)


@pytest.mark.parametrize("kept", [0, 3])
def test_a_scheduler_plans_and_runs_a_sliced_deferred_step_exactly(kept):
    """Recorded, planned and run by TENSILE (simulation), the step with the deferred weight's
    state streamed in slices trains like the plain step (the last ``kept`` slices' state on
    the device too); the moments of the sliced weights are no device tensors of the
    recording."""
    data = head_batches(8)
    m0, o0, _, _ = train_head(data, slice_mb=False)
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tensile.defer_weight_grads(model, min_mb=0.005)
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, resident=3, slice_mb=4 / 1024,
                                        slice_resident=kept)
    sched = tensile.Scheduler(model, opt, data[0], LOSS, budget=1, allow_cross_iteration=False,
                              allow_recompute=False, d2h_bw=1e10, h2d_bw=1e10,
                              peak_flops=1e12, peak_bytes_per_s=1e11)
    params = list(model.parameters())
    moments = {(tuple(params[i].shape), key) for i, key in sched.recording.opt_state_keys.values()
               if key != "step"}
    on_device = [(10, 48), (10,), (48,), (64,)] + ([(64, 32)] if kept >= 2 else [])
    assert moments == {(shape, key) for shape in on_device   # the resident groups' only, and
                       for key in ("exp_avg", "exp_avg_sq")}   # a weight whose slices are all kept
    for b in data:
        sched.step(*b)
    assert streamed.late_updates == 0
    streamed.synchronize()
    assert_same_training(m0, o0, model, opt)


def test_a_later_parameters_slices_do_not_wait_behind_an_earlier_ones_spread():
    """Where a second sliced weight's gradient comes while the first's slices are still
    queued, every queued slice is spread again over the hooks left: the new ones do not
    wait behind the old ones' later due hooks (the queue is the ring's order)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    streamed = tensile.stream_optimizer(opt, groups=1, prefetch=1, slice_mb=4 / 1024)
    counts = []
    update = streamed._update
    streamed._update = lambda g: (counts.append(streamed._hooks_seen), update(g))[-1]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        training_step(model, opt, (x, y), LOSS)
    per_hook = [counts[-len(streamed.groups):].count(h) for h in range(1, 7)]
    # hooks: 4.bias, 4.weight, 2.bias, 2.weight, 0.bias, 0.weight. The last layer's 4 slices
    # come at hook 2 and are spread over hooks 2-5; the middle layer's 4 join at hook 4 with
    # two of them left: six over hooks 4 and 5 (without the spread again, the new ones would
    # wait behind the old ones' hook 5); the biases' group at hook 5; the first layer's 2 at 6
    assert per_hook == [0, 1, 1, 3, 4, 2]


class LateLayer(nn.Module):
    """A head whose large extra layer first runs in the third step: its first gradient (and
    state) comes when the other parameters' state is streamed already."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head, self.extra = make_head(), nn.Linear(32, 64)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.head(x + self.extra(x)[:, :32] if self.calls >= 3 else x)


def test_a_sliced_parameters_first_gradient_in_a_later_step_makes_its_state_and_homes_it():
    data = head_batches(6)
    plain = LateLayer()
    o0 = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for b in data:
        training_step(plain, o0, b, LOSS)
    model = LateLayer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, slice_mb=4 / 1024)
    for b in data:
        training_step(model, opt, b, LOSS)
    assert_same_training(plain, o0, model, opt)
    assert opt.state[model.extra.weight]["exp_avg"].device.type == "cpu"
    assert streamed.homes(model.extra.weight, "exp_avg")
