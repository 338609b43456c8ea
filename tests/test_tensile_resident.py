"""tensile.resident: how many streamed groups keep their state on the device (CPU)."""
from __future__ import annotations

import pytest
import torch

import tensile
from tensile.resident import (UpdateTimes, choose_resident, measure_update_times,
                              streaming_delay_ms)
from tensile.step import training_step

from test_tensile_streamed import LOSS, assert_same_training, batches, streamed_model, train_plain

GB = 1e9   # bytes/s: one byte per ns, so 1e6 bytes take 1 ms


def delay(times, resident=0, prefetch=1, jobs=1, bw=GB):
    return streaming_delay_ms(times, resident, prefetch=prefetch, h2d_bw=bw, d2h_bw=bw,
                              latency_ms=0.0, jobs=jobs)


def test_a_copy_hidden_behind_backward_costs_nothing():
    # copy-in 0 -> 1 ms, update at 10, copy-out 10 -> 11, step ends at 20
    assert delay(UpdateTimes(0.0, [10.0], 20.0, [1_000_000])) == pytest.approx(0.0)


def test_an_update_waits_for_its_copy_and_the_step_for_its_last_copy_out():
    # update due at 0.5 waits for the copy-in (ends at 1): everything after runs 0.5 late
    assert delay(UpdateTimes(0.0, [0.5], 20.0, [1_000_000])) == pytest.approx(0.5)
    # the copy-out (10 -> 11) outlasts the step (10.5)
    assert delay(UpdateTimes(0.0, [10.0], 10.5, [1_000_000])) == pytest.approx(0.5)


def test_jobs_sharing_the_link_make_each_copy_longer():
    times = UpdateTimes(0.0, [0.5], 20.0, [1_000_000])
    assert delay(times, jobs=2) == pytest.approx(1.5)    # copy-in takes 2 ms
    assert delay(times, jobs=3) == pytest.approx(2.5)


def test_a_slot_is_refilled_only_after_its_copy_out():
    # prefetch 1: two slots, filled at 0 (copy-ins end at 1 and 2); the third group's copy-in
    # waits for group 0's update (at 1) and copy-out (1 -> 2), then the channel: 2 -> 3
    times = UpdateTimes(0.0, [1.0, 2.0, 2.5], 20.0, [1_000_000] * 3)
    assert delay(times) == pytest.approx(0.5)    # group 2 starts at 3 instead of 2.5
    assert delay(times, prefetch=2) == pytest.approx(0.5)   # three slots: copy-ins end 1, 2, 3


def test_resident_groups_are_not_copied_and_all_resident_costs_nothing():
    times = UpdateTimes(0.0, [0.1, 0.2, 10.0], 20.0, [5_000_000, 1_000_000, 1_000_000])
    assert delay(times, resident=0) > delay(times, resident=1) > 0
    assert delay(times, resident=2) == pytest.approx(0.0)
    assert delay(times, resident=3) == 0.0
    assert delay(UpdateTimes(0.0, [0.1], 1.0, [0])) == 0.0   # a group without state


def test_choose_keeps_the_fewest_groups_that_fit_the_allowance():
    # backward's first groups come at once; the later ones leave time for their copies
    times = UpdateTimes(0.0, [0.1, 0.2, 0.3, 8.0, 9.0, 10.0], 20.0, [2_000_000] * 6)
    pick = lambda **kw: choose_resident(times, prefetch=2, h2d_bw=GB, d2h_bw=GB,  # noqa: E731
                                        latency_ms=0.0, **kw)
    k = pick(max_overhead=0.0)
    assert k == 3 and delay(times, resident=3, prefetch=2) == 0.0
    assert delay(times, resident=2, prefetch=2) > 0.0         # one fewer would cost time
    assert pick(max_overhead=0.5) == 0                       # 10 ms allowed: stream them all
    assert pick(max_overhead=0.0, jobs=4) > k                # a shared link: keep more
    slow = choose_resident(times, prefetch=2, h2d_bw=1e3, d2h_bw=1e3, max_overhead=0.05)
    assert slow == 6                                         # nothing can be streamed


def test_bad_inputs_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="one entry per group"):
        UpdateTimes(0.0, [1.0], 2.0, [1, 2])
    with pytest.raises(ValueError, match="begin_ms <= every update_ms <= step_ms"):
        UpdateTimes(0.0, [3.0], 2.0, [1])
    times = UpdateTimes(0.0, [1.0], 2.0, [1])
    with pytest.raises(ValueError, match=r"max_overhead must be a fraction of the step in \[0, 1\)"):
        choose_resident(times, prefetch=1, max_overhead=1.5, h2d_bw=GB, d2h_bw=GB)
    with pytest.raises(ValueError, match="jobs and prefetch must be >= 1"):
        delay(times, jobs=0)
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        delay(times, bw=0.0)


def test_all_groups_resident_updates_in_backward_and_set_resident_moves_state_exactly():
    """resident=groups streams nothing; set_resident(k) later homes the other groups' state;
    training stays bit for bit that of one Adam step after backward."""
    data = batches(6)
    m0, o0 = train_plain(data)
    model, opt, streamed = streamed_model(4, resident=4)
    for b in data[:3]:
        training_step(model, opt, b, LOSS)
    assert all(g.host is None for g in streamed.groups) and streamed.updates_in_backward > 0
    streamed.set_resident(1)
    assert streamed.groups[0].host is None and all(g.host is not None for g in streamed.groups[1:])
    for b in data[3:5]:
        training_step(model, opt, b, LOSS)
    streamed.set_resident(3)                     # and back: state on the device again
    assert all(g.host is None for g in streamed.groups[:3]) and streamed.groups[3].host is not None
    training_step(model, opt, data[5], LOSS)
    assert_same_training(m0, o0, model, opt)
    with pytest.raises(ValueError, match="resident: expected an int from 0 to 4"):
        streamed.set_resident(5)


def test_measure_and_tune_on_the_cpu_do_not_train_and_pick_from_the_bandwidth():
    data = batches(4)
    m0, o0 = train_plain(data)
    model, opt, streamed = streamed_model(4, resident=4, prefetch=2)
    with pytest.raises(ValueError, match="no state yet"):
        measure_update_times(streamed, model, data[0], LOSS)
    training_step(model, opt, data[0], LOSS)
    before = [p.detach().clone() for p in model.parameters()]
    times = measure_update_times(streamed, model, data[1], LOSS, repeats=3)
    assert len(times.update_ms) == 4 and times.begin_ms <= min(times.update_ms)
    assert max(times.update_ms) <= times.step_ms
    assert times.group_bytes == [sum(2 * p.numel() * 4 for p in g.params) for g in streamed.groups]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # put back
    # a link far slower than the step keeps everything; one far faster streams everything
    assert tensile.tune_resident(streamed, model, data[1], LOSS, h2d_bw=1.0, d2h_bw=1.0) == 4
    assert tensile.tune_resident(streamed, model, data[1], LOSS, h2d_bw=1e18, d2h_bw=1e18,
                                 latency_ms=0.0) == 0
    assert streamed.tuned["resident"] == 0 and streamed.tuned["delay_ms"] == 0.0
    assert all(g.host is not None for g in streamed.groups)
    with pytest.raises(ValueError, match="every group resident"):
        measure_update_times(streamed, model, data[1], LOSS)
    for b in data[1:]:
        training_step(model, opt, b, LOSS)
    assert_same_training(m0, o0, model, opt)


def test_verification_bisects_towards_all_resident_until_the_measured_delay_fits(monkeypatch):
    """tune_resident's GPU check (_verified), with the captured step's time stood in for: the
    fewest resident groups whose measured delay fits is found by bisection from the replay's
    choice, each candidate timed once, and the choice is never below the replay's."""
    from tensile import resident
    model, opt, streamed = streamed_model(8, resident=8)
    every = len(streamed.groups)
    assert every >= 4 and streamed.resident == every
    training_step(model, opt, batches(1)[0], LOSS)
    fits_from = every - 2      # measured delay (ms) by resident groups: <= 0.5 from here on
    timed = []

    def step_ms(s, *_args):
        timed.append(s.resident)
        r = s.resident
        return 10.0 + (0.0 if r == every else 0.3 if r >= fits_from else 1.0 + fits_from - r)
    monkeypatch.setattr(resident, "_captured_step_ms", step_ms)
    k, base, measured = resident._verified(streamed, model, None, LOSS, 0, max_overhead=0.05)
    assert (k, base) == (fits_from, 10.0) and timed[0] == every   # all resident first: the base
    assert set(measured) == set(timed[1:]) and len(timed) - 1 <= 1 + every.bit_length()
    assert measured[0] == pytest.approx(1.0 + fits_from) and measured[fits_from] == pytest.approx(0.3)
    assert streamed.resident == every                       # the caller sets the choice
    assert resident._verified(streamed, model, None, LOSS, every - 1, max_overhead=0.05)[0] == every - 1
