"""tensile.pace: when a streamed optimizer's row slices update (CPU)."""
from __future__ import annotations

import pytest
import torch

import tensile
from tensile.pace import SliceTimes, pace_slices, replay_pace, spread_pace
from tensile.resident import install_streamed
from tensile.step import training_step

from test_tensile_streamed import LOSS, assert_same_training, head_batches, make_head, train_head


def vgg_like(kept: int = 7, streamed: int = 8, copy_ms: float = 1.25) -> SliceTimes:
    """Backward as on VGG-16 at b=16 (the 70th session's snapshot, rounded): the classifier's
    hooks come fast (0.3 ms apart), then 26 convolution hooks whose work grows towards the
    input; the slices' gradient comes at hook 3, each update 0.45 ms, each copy 1.25 ms."""
    gaps = [0.0, 0.3, 0.3, 0.3] + [0.15] * 6 + [0.5] * 6 + [0.55] * 6 + [0.7] * 4 + [0.8] * 4
    n = kept + streamed
    return SliceTimes(gaps, 0.3, [3] * n, [False] * streamed + [True] * kept, [0.45] * n,
                      [copy_ms] * streamed + [0.0] * kept, [copy_ms] * streamed + [0.0] * kept)


def test_the_pace_interleaves_kept_slices_and_empties_the_ring_early():
    """The default runs the 7 kept updates before any streamed one and spreads the streamed
    ones over hooks; the pace starts the first streamed one as soon as its state lands,
    fills the waits with kept ones, and so ends the ring's copies earlier and backward no
    later."""
    times = vgg_like()
    paced = pace_slices(times, slots=3)
    spread = replay_pace(times, spread_pace(times.arrival, times.kept, len(times.gaps_ms)), 3)
    first_streamed = min(paced.due[i] for i in range(8))
    last_kept = max(paced.due[i] for i in range(8, 15))
    assert first_streamed < last_kept                      # interleaved
    assert paced.ring_done_ms < spread.ring_done_ms - 2.0   # the ring empties well before
    assert paced.end_ms <= spread.end_ms + 1e-9
    assert paced.wait_ms <= spread.wait_ms + 1e-9
    # the replay of the pace is the pace's own figures
    again = replay_pace(times, paced.due, 3)
    assert (again.end_ms, again.wait_ms, again.ring_done_ms) == pytest.approx(
        (paced.end_ms, paced.wait_ms, paced.ring_done_ms))


@pytest.mark.parametrize("copy_ms", [0.2, 1.25, 3.0])
@pytest.mark.parametrize("kept", [0, 3, 7])
def test_every_slice_goes_after_its_gradient_and_the_streamed_ones_in_the_rings_order(kept, copy_ms):
    times = vgg_like(kept=kept, copy_ms=copy_ms)
    paced = pace_slices(times, slots=3)
    assert all(h >= a for (h, _), a in zip(paced.due, times.arrival))
    assert sorted(r for _, r in paced.due) == list(range(len(paced.due)))   # ranks: one order
    streamed = sorted((d, i) for i, d in enumerate(paced.due) if not times.kept[i])
    assert [i for _, i in streamed] == list(range(8))
    assert sorted(paced.due, key=lambda d: d[1]) == sorted(paced.due)   # ranks grow with hooks
    # with a fast link nothing waits; with a slow one the ring ends later
    if copy_ms == 0.2:
        assert paced.wait_ms == 0.0


def test_a_slow_link_waits_at_the_last_hook_rather_than_leave_slices_out():
    """A link too slow for backward: the slices still all go (at its last hook), the wait
    counted."""
    times = SliceTimes([0.0, 0.1, 0.1], 0.0, [0, 0, 0], [False, False, True], [0.1] * 3,
                       [5.0, 5.0, 0.0], [5.0, 5.0, 0.0])
    paced = pace_slices(times, slots=1)
    assert [h for h, _ in paced.due] == [2, 2, 0]   # the kept one at once, the rest at the end
    # one slot: in 0-5, update 5.0-5.1, out 5.1-10.1; the second in 10.1-15.1, update to
    # 15.2, out 15.2-20.2; the compute stream reached the last hook at 0.3
    assert paced.wait_ms == pytest.approx((5.0 - 0.3) + (15.1 - 5.1))
    assert paced.ring_done_ms == pytest.approx(20.2) and paced.end_ms == pytest.approx(15.2)


def test_spread_pace_is_what_the_optimizer_does_with_no_pace():
    """The replay's model of the default spread agrees with the runtime's order (the tests
    of tensile.streamed pin it: slices at hooks seen 4, 4, 5, 6, 6 and, with 3 kept,
    4, 5, 4, 6, 6)."""
    for kept, seen in ((0, [4, 4, 5, 6, 6]), (3, [4, 5, 4, 6, 6])):
        flags = [False] * (5 - kept) + [True] * kept
        due = spread_pace([3, 3, 3, 5, 5], flags, 6)
        assert [h + 1 for h, _ in due] == seen


def _spy(streamed) -> list[tuple[int, int]]:
    order = []
    update = streamed._update
    streamed._update = lambda g: (order.append((g, streamed._hooks_seen - 1)), update(g))[-1]
    return order


def test_tune_pace_sets_a_pace_the_optimizer_follows_and_training_stays_exact():
    """On the CPU (wall-clock marks): tune_pace times a step, sets a pace, and the slices
    then update at the pace's hooks in its order; parameters and state match plain Adam."""
    data = head_batches(5)
    m0, o0, _, _ = train_head(data, slice_mb=False)
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, resident=3, slice_mb=4 / 1024,
                                        slice_resident=2)
    training_step(model, opt, data[0], LOSS)   # the state
    training_step(model, opt, data[1], LOSS)
    before = [p.detach().clone() for p in model.parameters()]
    figures = tensile.tune_pace(streamed, model, data[1], LOSS, h2d_bw=1e9, d2h_bw=1e9)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # it did not train
    assert streamed.paced is figures and len(figures["hooks"]) == 5
    assert {"paced_end", "spread_end", "paced_ring_done", "spread_wait"} <= set(figures)
    order = _spy(streamed)
    for b in data[2:]:
        training_step(model, opt, b, LOSS)
    slices = [g for g, grp in enumerate(streamed.groups) if grp.rows is not None]
    last = [(g, h) for g, h in order[-len(streamed.groups):] if g in slices]
    assert [g for g, _ in last] == sorted(slices, key=lambda g: streamed._pace[g])
    assert all(h == max(streamed._pace[g][0], streamed._arrived[id(streamed.groups[g].params[0])])
               for g, h in last)
    assert streamed.late_updates == 0
    assert_same_training(m0, o0, model, opt)


def test_install_streamed_paces_on_request_and_pace_needs_slices():
    data = head_batches(2)
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="needs slice_mb"):
        install_streamed(model, opt, data[0], LOSS, groups=3, prefetch=1, pace=True)
    streamed = install_streamed(model, opt, data[0], LOSS, groups=3, prefetch=1, resident=3,
                                slice_mb=4 / 1024, slice_resident=1, pace=True,
                                h2d_bw=1e9, d2h_bw=1e9)
    assert streamed.paced is not None and streamed._pace is not None


def test_what_tune_pace_and_set_pace_refuse():
    data = head_batches(2)
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    plain = tensile.stream_optimizer(opt, groups=3, prefetch=1, resident=3)
    with pytest.raises(ValueError, match="has none"):
        tensile.tune_pace(plain, model, data[0], LOSS)
    plain.remove()
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, resident=3, slice_mb=4 / 1024)
    with pytest.raises(ValueError, match="no state yet"):
        tensile.tune_pace(streamed, model, data[0], LOSS)
    training_step(model, opt, data[0], LOSS)
    streamed.set_resident(1)   # two other groups stream: the replay would not see their copies
    with pytest.raises(ValueError, match="models the slices' copies alone"):
        tensile.tune_pace(streamed, model, data[0], LOSS)
    slices = [g for g, grp in enumerate(streamed.groups) if grp.rows is not None]
    with pytest.raises(ValueError, match="an entry for each"):
        streamed.set_pace({slices[0]: (0, 0)})
    with pytest.raises(ValueError, match="pairs of ints"):
        streamed.set_pace({g: (-1, 0) for g in slices})


@pytest.mark.parametrize("bad, match", [
    (dict(arrival=[0, 5]), "expected hooks from 0 to 2"),
    (dict(kept=[True]), "one entry per slice"),
    (dict(update_ms=[0.1, -1.0]), "times must be >= 0"),
    (dict(gaps_ms=[]), "gaps_ms is empty"),
])
def test_bad_slice_times_are_refused(bad, match):
    good = dict(gaps_ms=[0.0, 1.0, 1.0], tail_ms=0.0, arrival=[0, 1], kept=[False, True],
                update_ms=[0.1, 0.1], in_ms=[1.0, 0.0], out_ms=[1.0, 0.0])
    if bad.get("gaps_ms") == []:
        good["arrival"] = [0, 0]
    with pytest.raises(ValueError, match=match):
        SliceTimes(**{**good, **bad})


def test_replay_refuses_streamed_slices_out_of_the_rings_order_and_a_wrong_length():
    times = vgg_like(kept=0, streamed=3)
    times = SliceTimes(times.gaps_ms, 0.0, [3, 3, 3], [False] * 3, [0.1] * 3, [1.0] * 3, [1.0] * 3)
    with pytest.raises(ValueError, match="ring's order"):
        replay_pace(times, [(5, 0), (4, 1), (6, 2)], 2)
    with pytest.raises(ValueError, match="one \\(hook, rank\\) per slice"):
        replay_pace(times, [(5, 0)], 2)


def test_slice_times_take_the_copies_as_long_as_the_timed_step_made_them():
    """On the GPU the timed step's marks time each streamed slice's copies (both ways busy,
    beside backward's kernels): the replay's copies take as long per byte as their median,
    not the link's one-way bandwidth. Here synthetic marks on a CPU optimizer said to be on
    CUDA: every copy in takes 2 ms, every copy out 3 ms."""
    from tensile.pace import slice_times
    from tensile.streamed import _slot_bytes
    data = head_batches(2)
    model = make_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    streamed = tensile.stream_optimizer(opt, groups=3, prefetch=1, resident=3, slice_mb=4 / 1024,
                                        slice_resident=2)
    for b in data:
        training_step(model, opt, b, LOSS)
    hooks = streamed._hooks_total
    marks = {}
    for h in range(hooks):
        marks[("hook", h)], marks[("hooked", h)] = 10.0 * h, 10.0 * h + 5.0
    slices = [g for g, grp in enumerate(streamed.groups) if grp.rows is not None]
    for g in slices:
        h = streamed._arrived[id(streamed.groups[g].params[0])]
        marks[g], marks[("run", g)], marks[("ran", g)] = 10.0 * h + 1, 10.0 * h + 1, 10.0 * h + 1.5
        marks[("in", g)], marks[("in_end", g)] = 0.0, 2.0
        marks[("out", g)], marks[("out_end", g)] = 3.0, 6.0
    streamed.cuda = True
    try:
        times = slice_times(streamed, marks, h2d_bw=1e12, d2h_bw=1e12)
    finally:
        streamed.cuda = False
    nbytes = {g: _slot_bytes(streamed.groups[g]) for g in slices if streamed.groups[g].streams}
    per_byte = sorted(1.0 / n for n in nbytes.values())[len(nbytes) // 2]   # ms per byte, in
    assert times.kept == [g not in nbytes for g in slices]
    for g, i, o in zip(slices, times.in_ms, times.out_ms):
        if g in nbytes:   # the median ms per byte, times the slice's own bytes
            assert (i, o) == pytest.approx((2.0 * per_byte * nbytes[g], 3.0 * per_byte * nbytes[g]))
        else:
            assert i == o == 0
    assert times.update_ms == [pytest.approx(0.5)] * len(slices)
    # the work between hooks is what the hooks did not do: 5 ms gaps, 5 ms hooks less slices
    assert times.gaps_ms[0] >= 0 and all(g >= 5.0 for g in times.gaps_ms[1:])
