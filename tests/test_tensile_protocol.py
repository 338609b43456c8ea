"""TENSILE scheduler process and protocol, end to end with CPU-only jobs (no CUDA).

Most tests run the server in a thread of the test process (fast); the fault tests run it
as ``python -m tensile.server`` in a subprocess and kill it, or kill a job process.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from polling import wait_until
import tensile.server as server_mod
from tensile.client import SchedulerError, TensileClient
from tensile.protocol import (HEADER, MAX_MESSAGE_BYTES, ProtocolError, decode, encode,
                              recv_message, timeline_from_wire, timeline_to_wire,
                              validate_job_message, validate_server_message)
from tensile.server import SchedulerServer
from tensile.timeline import AccessTimeline

MB = 1 << 20
BW = (20e9, 20e9)
EPS = 1e-6
REPO = Path(__file__).resolve().parents[1]


def job_timeline() -> AccessTimeline:
    """A small training step (33 MiB vanilla peak; hidden swaps bring it to 23 MiB)."""
    sizes = {1: 4 * MB, 2: 8 * MB, 3: 8 * MB, 4: 8 * MB, 5: 1 * MB, 6: 2 * MB, 7: 2 * MB}
    roles = {1: "input", 6: "param", 7: "opt_state"}
    ops = [("a", "forward", 1.0, [1, 6], [2]), ("b", "forward", 1.0, [2], [3]),
           ("c", "forward", 1.0, [3], [4]), ("l", "loss", 1.0, [4], [5]),
           ("d", "backward", 1.0, [5, 4], []), ("e", "backward", 1.0, [3], []),
           ("f", "backward", 1.0, [2, 6], []), ("o", "optimizer", 0.5, [6, 7], [6, 7])]
    return AccessTimeline.from_ops(ops, sizes, roles)


def register_msg(job_id: str = "raw", **extra) -> dict:
    tl = job_timeline()
    return {"type": "register", "job_id": job_id, "weight": 1.0, "seq": 1,
            "timeline": timeline_to_wire(tl), "op_times_ms": [float(x) for x in tl.op_ms],
            "bandwidths": {"d2h": BW[0], "h2d": BW[1]}, **extra}


def newer(client: TensileClient, version: int, timeout: float = 5.0) -> bool:
    """Heartbeat until the client holds a plan newer than ``version``."""
    return wait_until(lambda: (client.heartbeat(), client.version)[1] > version, timeout)


def no_overlap(copies) -> bool:
    return all(b[0] >= a[1] - EPS for a, b in zip(copies, copies[1:]))


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def sock_dir():
    """A short directory for sockets (AF_UNIX paths are limited to ~107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="tsl", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_server(sock_dir):
    """Start a scheduler in a thread of this process; stopped after the test."""
    started = []

    def start(**kw) -> SchedulerServer:
        srv = SchedulerServer(sock_dir / f"s{len(started)}.sock", **kw)
        th = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
        th.start()
        assert srv.ready.wait(10), "scheduler did not start"
        started.append((srv, th))
        return srv

    yield start
    for srv, th in started:
        srv.stop()
        th.join(10)
        assert not th.is_alive(), "scheduler thread did not stop"


@pytest.fixture
def clients():
    made: list[TensileClient] = []

    def make(srv, job_id=None, **kw) -> TensileClient:
        c = TensileClient(srv.path if isinstance(srv, SchedulerServer) else srv, job_id, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def raw(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def ask(s: socket.socket, payload: bytes) -> dict:
    s.sendall(payload)
    return recv_message(s, time.monotonic() + 5)


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


# --------------------------------------------------------------------------- protocol unit
def test_frames_round_trip_and_refuse_bad_json():
    msg = {"type": "heartbeat", "seq": 3}
    data = encode(msg)
    assert HEADER.unpack(data[:4])[0] == len(data) - 4
    assert decode(data[4:]) == msg
    with pytest.raises(ProtocolError, match="JSON"):
        encode({"x": float("nan")})
    with pytest.raises(ProtocolError, match="exceeds"):
        encode({"x": "y" * 100}, max_bytes=50)
    with pytest.raises(ProtocolError, match="JSON object"):
        decode(b"[1, 2]")
    with pytest.raises(ProtocolError, match="JSON"):
        decode(b"\xff\xfe")
    with pytest.raises(ProtocolError, match="NaN"):
        decode(b'{"iter_ms": NaN}')


@pytest.mark.parametrize("msg, match", [
    ({"type": "fly"}, "type: expected one of"),
    ({}, "type: expected one of"),
    ({"type": "heartbeat", "seq": True}, "heartbeat.seq: expected an int"),
    ({"type": "heartbeat", "sequence": 1}, "unknown fields"),
    ({"type": "measured"}, "missing field 'iter_ms'"),
    ({"type": "measured", "iter_ms": -1}, "measured.iter_ms: expected a positive"),
    ({"type": "measured", "iter_ms": 5, "op_times_ms": [1, "x"]}, r"op_times_ms\[1\]"),
    ({"type": "measured", "iter_ms": 5, "retimed": "yes"}, "measured.retimed: expected true or false"),
    ({"type": "measured", "iter_ms": 5, "op_scratch": [[0, -1]]}, r"measured.op_scratch\[0\]: expected"),
    ({"type": "measured", "iter_ms": 5, "op_scratch": {"0": 1}}, "measured.op_scratch: expected a list"),
    ({**register_msg(), "weight": "heavy"}, "register.weight"),
    ({**register_msg(), "job_id": "a b/c"}, "register.job_id"),
    ({**register_msg(), "bandwidths": {"d2h": 1e9}}, "register.bandwidths"),
    ({**register_msg(), "options": {"min_swap_bytes": 0}}, "min_swap_bytes"),
    ({**register_msg(), "options": {"recompute": True}}, "only the keys"),
    ({**register_msg(), "options": {"swap_cost_ms": -1}}, r"options.swap_cost_ms: expected a finite number >= 0"),
    ({**register_msg(), "options": {"swap_cost_ms": True}}, "swap_cost_ms"),
    ({**register_msg(), "options": {"swap_copy_share": 1.5}}, r"options.swap_copy_share: expected a number in \[0, 1\]"),
    ({**register_msg(), "options": {"swap_copy_share": "0.04"}}, "swap_copy_share"),
])
def test_job_messages_are_validated(msg, match):
    with pytest.raises(ProtocolError, match=match):
        validate_job_message(msg)


def test_valid_messages_pass():
    out = validate_job_message(register_msg(iter_ms=7.5, options={"allow_recompute": False}))
    assert out["bandwidths"] == BW and out["iter_ms"] == 7.5
    assert validate_server_message({"type": "ack", "reply_to": 2}) == {"type": "ack", "reply_to": 2}
    with pytest.raises(ProtocolError):
        validate_server_message({"type": "plan", "job_id": "a"})


def test_timeline_round_trip():
    tl = job_timeline()
    back = timeline_from_wire(timeline_to_wire(tl), list(tl.op_ms))
    assert back.names == tl.names and back.phases == tl.phases and back.random == tl.random
    assert back.reads == tl.reads and back.writes == tl.writes
    assert back.tensors == tl.tensors
    np.testing.assert_array_equal(back.start, tl.start)
    # a streamed optimizer's own copies travel too (older clients send none)
    streamed = AccessTimeline(tl.names, tl.phases, tl.op_ms, tl.random, tl.reads, tl.writes,
                              tl.tensors, ((2, "h2d", 4096), (5, "d2h", 4096)))
    assert timeline_from_wire(timeline_to_wire(streamed), list(tl.op_ms)).transfers == streamed.transfers
    wire = timeline_to_wire(tl)
    del wire["transfers"]
    assert timeline_from_wire(wire, list(tl.op_ms)).transfers == ()
    # so do the shares of an op's time its rerun costs (batch norms rebuilt from statistics)
    priced = AccessTimeline(tl.names, tl.phases, tl.op_ms, tl.random, tl.reads, tl.writes,
                            tl.tensors, rerun_share={1: 0.7, 2: 0.0})
    back = timeline_from_wire(json.loads(json.dumps(timeline_to_wire(priced))), list(tl.op_ms))
    assert back.rerun_share == {1: 0.7, 2: 0.0}
    del wire["rerun_share"]
    assert timeline_from_wire(wire, list(tl.op_ms)).rerun_share == {}
    # and the workspaces ops hold while they run (measured on a captured step)
    back = timeline_from_wire(json.loads(json.dumps(timeline_to_wire(tl.with_scratch({4: 3 * MB})))),
                              list(tl.op_ms))
    assert back.scratch == {4: 3 * MB}
    del wire["scratch"]
    assert timeline_from_wire(wire, list(tl.op_ms)).scratch == {}


@pytest.mark.parametrize("change, match", [
    (lambda w: w["names"].pop(), "timeline.names: expected a list of 8"),
    (lambda w: w["phases"].__setitem__(0, "sideways"), r"timeline.phases\[0\]"),
    (lambda w: w["reads"].__setitem__(0, ["x"]), r"timeline.reads\[0\]"),
    (lambda w: w["tensors"].append({"sid": 99, "nbytes": 1, "role": "activation",
                                    "swappable": False, "needed_by": None,
                                    "held_to_end": False}), "never accessed"),
    (lambda w: w["tensors"][0].__setitem__("held_to_end", "yes"), r"held_to_end: expected true or false"),
    (lambda w: w["tensors"][0].pop("held_to_end"), r"an object with keys"),
    (lambda w: w["tensors"][0].__setitem__("held_to", "later"), r"held_to: expected an op index"),
    (lambda w: w["tensors"][0].__setitem__("held_to", 8), r"held_to: expected an op index in \[0, 8\)"),
    (lambda w: w["tensors"][0].__setitem__("held_to", -1), r"held_to: expected an op index"),
    (lambda w: next(t for t in w["tensors"] if t["sid"] == 2).__setitem__("held_to", 3),
     r"timeline: held_to\[2\]: expected an op index from its last access \(6\)"),
    (lambda w: w["tensors"][0].__setitem__("kept", 1), r"an object with keys .* optionally \['forward_hold', 'held_to'\]"),
    (lambda w: w["tensors"][0].__setitem__("forward_hold", 8), r"forward_hold: expected an op index in \[0, 8\)"),
    (lambda w: next(t for t in w["tensors"] if t["sid"] == 2).__setitem__("forward_hold", 5),
     r"timeline: forward_hold\[2\]: expected the index of a forward op from its first access \(0\)"),
    (lambda w: w["tensors"][0].__setitem__("role", "weights"), r"role"),
    (lambda w: w["tensors"][0].__setitem__("nbytes", -5), r"nbytes"),
    (lambda w: w.pop("random"), "an object with names"),
    (lambda w: w.__setitem__("transfers", 3), r"timeline.transfers: expected a list of \[op"),
    (lambda w: w.__setitem__("transfers", [[0, "sideways", 8]]), r"transfers\[0\]: expected \(op index"),
    (lambda w: w.__setitem__("transfers", [[99, "h2d", 8]]), r"transfers\[0\]: expected \(op index"),
    (lambda w: w.__setitem__("rerun_share", {"1": 0.5}), r"timeline.rerun_share: expected a list"),
    (lambda w: w.__setitem__("rerun_share", [[[1], 0.5]]), r"timeline.rerun_share: expected a list"),
    (lambda w: w.__setitem__("rerun_share", [[1, -0.5]]), r"rerun_share: expected op index"),
    (lambda w: w.__setitem__("rerun_share", [[99, 0.5]]), r"rerun_share: expected op index"),
    (lambda w: w.__setitem__("scratch", {"1": 8}), r"timeline.scratch: expected a list of \[op, bytes"),
    (lambda w: w.__setitem__("scratch", [[1, -8]]), r"scratch: expected op index .* bytes >= 0"),
    (lambda w: w.__setitem__("scratch", [[99, 8]]), r"scratch: expected op index in \[0, 8\)"),
])
def test_malformed_timelines_are_refused(change, match):
    tl = job_timeline()
    wire = timeline_to_wire(tl)
    change(wire)
    with pytest.raises(ProtocolError, match=match):
        timeline_from_wire(wire, list(tl.op_ms))


# --------------------------------------------------------------------------- server, in a thread
def test_registration_gets_a_plan_and_the_socket_is_private(start_server, clients):
    srv = start_server()
    assert stat.S_IMODE(os.stat(srv.path).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(srv.path).st_mode)
    c = clients(srv)  # the scheduler names the job
    plan = c.register(job_timeline(), bandwidths=BW)
    assert plan is not None and c.plan is plan and c.version == 1
    assert c.job_id == "job-1" and c.reason == "arrival of job-1"
    # 33 MiB -> 23 MiB: activations, and the 2 MiB Adam state, whose copy-out runs into the next step
    assert plan.num_ops == 8 and plan.peak_before == 33 * MB and plan.peak_after == 23 * MB
    assert [s.sid for s in plan.swaps if s.cross_iteration] == [7]
    assert c.heartbeat() is plan  # nothing changed: the same object


def test_a_recompute_allowance_reaches_the_jobs_plans(start_server, clients):
    srv = start_server(max_overhead=0.2, d2h_bw=1e3, h2d_bw=1e3)   # copies far too slow
    plan = clients(srv).register(job_timeline(), bandwidths=BW)
    assert plan.recomputes and not plan.swaps and plan.budget_bytes is None
    assert plan.est_overhead_ms <= 0.2 * job_timeline().iteration_ms
    assert plan.peak_after < plan.peak_before
    with pytest.raises(ValueError, match="max_overhead must be a fraction of the iteration time"):
        SchedulerServer(srv.path.parent / "x.sock", max_overhead=-1)


def test_a_budget_share_follows_the_joint_peak_as_jobs_arrive(start_server, clients, caplog):
    """``budget_share``: at every re-plan the budget is that share of the jobs' joint peak
    without plans, so the plans move only what the cut needs (fewer swaps than none)."""
    caplog.set_level(logging.INFO, logger="tensile.server")
    srv = start_server(budget_share=0.9)
    a, b = clients(srv, "a"), clients(srv, "b")
    alone = a.register(job_timeline(), bandwidths=BW)
    assert alone.budget_bytes == int(0.9 * alone.peak_before) == int(0.9 * 33 * MB)
    assert alone.feasible and alone.peak_after <= alone.budget_bytes
    b.register(job_timeline(), bandwidths=BW)
    assert newer(a, 1)
    joint = srv.last_joint
    assert joint.budget_bytes == int(0.9 * joint.peak_before) > alone.budget_bytes
    assert joint.feasible and joint.peak_after <= joint.budget_bytes
    assert "(budget 0.9 of the joint peak)" in caplog.text       # listening
    assert f"budget {int(0.9 * 33 * MB) / MB:.1f} MiB, feasible True" in caplog.text  # re-plans
    unlimited = start_server()
    c = clients(unlimited, "c").register(job_timeline(), bandwidths=BW)
    assert 0 < len(alone.swaps) < len(c.swaps)   # hides every swap it can: 23 MiB
    for bad, match in (({"budget_share": 1.5}, r"budget_share must be a share of the joint "
                                               r"peak in \(0, 1\], got 1.5"),
                       ({"budget_share": 0.5, "budget_bytes": MB}, "not both")):
        with pytest.raises(ValueError, match=match):
            SchedulerServer(srv.path.parent / "x.sock", **bad)


def test_a_joint_plan_over_the_budget_is_logged_as_a_warning(start_server, clients, caplog):
    caplog.set_level(logging.INFO, logger="tensile.server")
    for budget, level in ((MB, logging.WARNING), (None, logging.INFO)):
        caplog.clear()
        srv = start_server(budget_bytes=budget)
        plan = clients(srv).register(job_timeline(), bandwidths=BW)
        (replan,) = [r for r in caplog.records if "re-plan v1" in r.getMessage()]
        assert plan.feasible is (budget is None)
        assert replan.levelno == level and f"feasible {plan.feasible}" in replan.getMessage()


@pytest.mark.parametrize("argv, expected", [
    (["--budget", "1G", "--budget-share", "0.5"],
     "give --budget or --budget-share, not both (got 1073741824 bytes and 0.5)"),
    (["--budget-share", "2"], "budget_share must be a share of the joint peak in (0, 1], got 2.0"),
])
def test_the_scheduler_command_refuses_a_bad_budget(argv, expected, sock_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        server_mod.main(["--socket", str(sock_dir / "s.sock"), *argv])
    assert exc.value.code == 2 and expected in capsys.readouterr().err
    assert not (sock_dir / "s.sock").exists()


@pytest.mark.parametrize("price", [{"swap_cost_ms": 1e-3}, {"swap_copy_share": 0.01}])
def test_a_jobs_swap_price_reaches_the_joint_plan(start_server, clients, price):
    """``options.swap_cost_ms`` (a captured job's joins) or ``swap_copy_share`` (a share of
    each swap's copy time): the scheduler prices that job's swaps with it; under a budget the
    other job, whose swaps are free, takes the swap."""
    srv = start_server(budget_bytes=2 * 33 * MB - 8 * MB)
    a = clients(srv, "a", options=price)
    b = clients(srv, "b")
    a.register(job_timeline(), bandwidths=BW)
    b.register(job_timeline(), bandwidths=BW)
    assert newer(a, 1)
    plans = srv.last_joint.plans
    assert srv.last_joint.feasible
    assert not plans["a"].swaps and len(plans["b"].swaps) == 1


def test_arrival_replans_both_jointly(start_server, clients):
    srv = start_server()
    a, b = clients(srv, "a"), clients(srv, "b")
    pa = a.register(job_timeline(), bandwidths=BW)
    assert b.register(job_timeline(), bandwidths=BW) is not None
    assert newer(a, 1)  # the arrival of b was pushed to a
    assert a.version == b.version == 2 and a.reason == "arrival of b"
    joint = a.joint
    assert joint["jobs"] == ["a", "b"]
    assert joint["peak_after"] <= joint["sum_of_peaks_before"]
    assert joint["peak_after"] <= a.plan.peak_after + b.plan.peak_after
    copies = srv.last_joint.channel_copies()
    assert copies["d2h"] and no_overlap(copies["d2h"]) and no_overlap(copies["h2d"])
    assert {c[2] for c in copies["d2h"]} == {"a", "b"}  # both jobs copy on the one channel
    assert pa is not None


def test_leave_replans_the_others(start_server, clients):
    srv = start_server()
    a, b = clients(srv, "a"), clients(srv, "b")
    a.register(job_timeline(), bandwidths=BW)
    b.register(job_timeline(), bandwidths=BW)
    assert newer(a, 1)
    b.close()
    assert newer(a, 2)
    assert a.reason == "departure of b (left)" and a.joint["jobs"] == ["a"]
    assert list(srv.jobs) == ["a"]


def test_drift_over_30_percent_replans_and_under_does_not(start_server, clients):
    # Single-sample behaviour before: one report of 11.25 ms re-planned. Now the median
    # of the last 5 reports must drift, from the 3rd report after the reference on.
    srv = start_server()
    c = clients(srv, "a")
    c.register(job_timeline(), bandwidths=BW)
    c.report(7.5, [1.0] * 7 + [0.5])  # first measured iteration: re-plan on measurements
    assert newer(c, 1) and c.reason.startswith("first measurement of a")
    v = c.version
    for ms in (8.0, 7.0, 9.5, 7.5, 7.5, 7.5):  # within 30 % of 7.5 ms (the reference)
        c.report(ms)
    quiet(c, v, srv)
    c.report(7.5 * 1.5)  # 50 % slower, e.g. a co-runner started: one report is noise ...
    quiet(c, v, srv)
    c.report(7.5 * 1.5)
    c.report(7.5 * 1.5)  # ... three of the last five are not
    assert newer(c, v)
    assert c.reason.startswith("drift of a: 11.25 ms per iteration (median of last 5), "
                               "planned for 7.50 ms"), c.reason
    assert c.plan.iteration_ms == pytest.approx(11.25)  # the plan uses the measured time


def test_a_retimed_job_is_replanned_at_once_with_its_new_op_times(start_server, clients):
    """A job that starts replaying its step as a CUDA graph (``Scheduler.capture``) sends
    the graph's op times with ``retimed``: the scheduler re-plans now, with those times
    as they are (not blended with the eager ones), and no drift test is needed."""
    srv = start_server()
    c = measured_job(srv, clients, 100.0)
    v = c.version
    with pytest.raises(ValueError, match="retimed=True needs op_times"):
        c.report(2.0, retimed=True)
    captured = [0.2] * 7 + [0.1]
    c.report(1.5, captured, retimed=True)
    assert c.wait_for_plan(v, timeout_s=5.0) is c.plan and c.version > v
    assert c.reason == "a retimed (1.50 ms per iteration)"
    assert c.plan.iteration_ms == pytest.approx(sum(captured))
    v = c.version
    for ms in (1.5, 1.6, 1.4):   # the new level is the drift test's reference from now on
        c.report(ms)
    quiet(c, v, srv)
    assert c.wait_for_plan(v, timeout_s=0.2) is c.plan and c.version == v   # none came: on time


def test_a_retimed_jobs_workspaces_reach_the_joint_plan_and_a_re_registration(start_server, clients):
    """With its captured op times a job sends what its ops hold while they run (``scratch``):
    the scheduler plans with them, and a re-registration (after a scheduler restart) brings
    them along. Only with ``retimed``: they belong to the step's new mode."""
    srv = start_server()
    c = measured_job(srv, clients, 100.0)
    with pytest.raises(ValueError, match="scratch goes with retimed=True"):
        c.report(2.0, [1.0] * 8, scratch={3: MB})
    peak = c.plan.peak_before
    v = c.version
    c.report(1.5, [0.2] * 7 + [0.1], retimed=True, scratch={3: 5 * MB})
    assert c.wait_for_plan(v, timeout_s=5.0) is c.plan and c.version > v
    assert srv.jobs["a"].timeline.scratch == {3: 5 * MB}
    assert c.plan.peak_before == peak + 5 * MB     # op 3 ("l") is the step's peak
    assert c._payload["timeline"]["scratch"] == [[3, 5 * MB]]


def test_workspaces_outside_a_retimed_report_or_the_timeline_are_refused(start_server):
    srv = start_server()
    s = raw(srv.path)
    assert ask(s, encode(register_msg("raw")))["type"] == "plan"
    reply = ask(s, encode({"type": "measured", "seq": 2, "iter_ms": 5.0, "op_times_ms": [1.0] * 8,
                           "op_scratch": [[1, 8]]}))
    assert reply["code"] == "bad_message" and "op_scratch goes with retimed" in reply["error"]
    reply = ask(s, encode({"type": "measured", "seq": 3, "iter_ms": 5.0, "op_times_ms": [1.0] * 8,
                           "retimed": True, "op_scratch": [[8, 8]]}))
    assert reply["code"] == "bad_message" and "op index in [0, 8)" in reply["error"]
    assert not srv.jobs["raw"].measured and srv.jobs["raw"].timeline.scratch == {}


# Per-iteration times of a job sharing a GPU with co-runners: -40 % .. +67 % around ~60 ms
# (as measured on an H200: ResNet-50 batch 2, p10 36 ms, median 59 ms, p90 101 ms).
NOISY = [60.0, 36.0, 100.0, 58.0, 40.0, 95.0]


def quiet(c: TensileClient, version: int, srv: SchedulerServer) -> None:
    """Assert that no re-plan followed (the scheduler had time to make one)."""
    time.sleep(0.3)
    c.heartbeat()
    assert c.version == version, f"re-planned without drift: {srv.replans}"


def measured_job(srv: SchedulerServer, clients, first_ms: float) -> TensileClient:
    c = clients(srv, "a")
    c.register(job_timeline(), bandwidths=BW)
    c.report(first_ms, [1.0] * 7 + [0.5])
    assert newer(c, 1) and c.reason.startswith("first measurement of a")
    return c


def test_noisy_iteration_times_do_not_replan(start_server, clients):
    srv = start_server()
    c = measured_job(srv, clients, 100.0)  # even an outlier as the first measurement
    v = c.version
    for ms in NOISY * 8:
        c.report(ms)
    quiet(c, v, srv)
    assert not any("drift" in r for r in srv.replans), srv.replans


def test_a_step_change_replans_once_and_the_new_level_becomes_the_reference(start_server,
                                                                             clients):
    srv = start_server()
    c = measured_job(srv, clients, NOISY[0])
    for ms in NOISY * 3:
        c.report(ms)
    v = c.version
    slower = itertools.cycle([1.6 * t for t in NOISY])  # +60 %, e.g. a co-runner started
    for _ in range(5):
        c.report(next(slower))
        if newer(c, v, timeout=0.5):
            break
    else:
        pytest.fail(f"no drift re-plan within 5 reports of a +60 % step: {srv.replans}")
    assert c.reason.startswith("drift of a: ") and "(median of last 5)" in c.reason, c.reason
    v = c.version
    for _ in range(36):
        c.report(next(slower))
    quiet(c, v, srv)
    assert sum("drift" in r for r in srv.replans) == 1, srv.replans
    assert srv.jobs["a"].reference_ms == pytest.approx(1.6 * 59.0, rel=0.05)


def test_a_plan_that_changes_the_iteration_time_is_not_drift(start_server, clients):
    """The reference is the new plan's own level: a plan that makes the step slower (its
    copies, its recomputes) must not count as drift from the level before it."""
    srv = start_server()
    c = measured_job(srv, clients, 60.0)
    for _ in range(6):
        c.report(60.0)
    v = c.version
    for _ in range(5):                  # a co-runner starts: +60 %, a drift re-plan
        c.report(96.0)
        if newer(c, v, timeout=0.5):
            break
    assert c.reason.startswith("drift of a: 96.00 ms"), c.reason
    v = c.version
    c.report(96.0)                      # measured under the old plan, in flight
    for _ in range(12):                 # the new plan's steps take longer: its own level
        c.report(150.0)
    quiet(c, v, srv)
    assert sum("drift" in r for r in srv.replans) == 1, srv.replans
    assert srv.jobs["a"].reference_ms == pytest.approx(150.0)


def test_weights_are_honoured_end_to_end(start_server, clients):
    srv = start_server(budget_bytes=2 * 33 * MB - 8 * MB)
    light, heavy = clients(srv, "light", weight=1.0), clients(srv, "heavy", weight=3.0)
    heavy.register(job_timeline(), bandwidths=BW)
    light.register(job_timeline(), bandwidths=BW)
    assert newer(heavy, 1)
    assert light.plan.feasible and heavy.plan.feasible
    assert light.plan.swaps or light.plan.recomputes
    assert not heavy.plan.swaps and not heavy.plan.recomputes


def test_malformed_messages_get_errors_and_the_server_keeps_serving(start_server, clients):
    srv = start_server()
    s = raw(srv.path)
    cases = [
        (frame(b"{not json"), "bad_message", "JSON"),
        (frame(b"[1, 2]"), "bad_message", "JSON object"),
        (encode({"type": "fly", "seq": 4}), "bad_message", "type"),
        (encode({"type": "heartbeat", "seq": 5}), "not_registered", "register"),
        (encode({**register_msg(), "weight": "heavy"}), "bad_message", "register.weight"),
        (encode({**register_msg(), "op_times_ms": [1.0] * 3}), "bad_message", "timeline.names"),
    ]
    for payload, code, text in cases:
        reply = ask(s, payload)
        assert reply["type"] == "error" and reply["code"] == code and text in reply["error"], reply
    assert ask(s, encode({"type": "fly", "seq": 4}))["reply_to"] == 4
    # The same connection can still register properly after its mistakes.
    reply = ask(s, encode(register_msg("raw")))
    assert reply["type"] == "plan" and reply["reply_to"] == 1 and reply["job_id"] == "raw"
    reply = ask(s, encode({"type": "measured", "seq": 9, "iter_ms": 5.0, "op_times_ms": [1.0]}))
    assert reply["code"] == "bad_message" and "expected 8 op times" in reply["error"]
    reply = ask(s, encode({"type": "measured", "seq": 9, "iter_ms": 5.0,
                           "op_start_ms": [3.0, 1.0] + [4.0] * 6}))
    assert reply["code"] == "bad_message" and "non-decreasing" in reply["error"]
    reply = ask(s, encode({"type": "measured", "seq": 9, "iter_ms": 5.0, "retimed": True}))
    assert reply["code"] == "bad_message" and "retimed needs op_times_ms" in reply["error"]
    assert not srv.jobs["raw"].measured   # a refused message changes nothing
    # A second registration under a live id is refused.
    s2 = raw(srv.path)
    assert ask(s2, encode(register_msg("raw")))["code"] == "id_in_use"
    # An oversized length prefix: error, then the connection is closed.
    s3 = raw(srv.path)
    reply = ask(s3, HEADER.pack(MAX_MESSAGE_BYTES + 1))
    assert reply["code"] == "too_large"
    assert s3.recv(1) == b""
    # A half-sent frame and a vanished peer do not hurt either.
    s4 = raw(srv.path)
    s4.sendall(HEADER.pack(100) + b"{")
    s4.close()
    # Still serving: a proper client registers and the raw job is still there.
    c = clients(srv, "ok")
    assert c.register(job_timeline(), bandwidths=BW) is not None
    assert sorted(srv.jobs) == ["ok", "raw"]
    for x in (s, s2, s3):
        x.close()


def test_client_checks_its_own_input(start_server, clients):
    srv = start_server()
    c = clients(srv, "a")
    c.register(job_timeline(), bandwidths=BW)
    with pytest.raises(ValueError, match="op_times has 2 entries"):
        c.report(7.5, [1.0, 1.0])
    with pytest.raises(ValueError, match="iter_ms"):
        c.report(0.0)
    with pytest.raises(ValueError, match="op_times has 3 entries"):
        clients(srv, "b").register(job_timeline(), [1.0] * 3, bandwidths=BW)


def test_planner_failure_affects_only_that_request(start_server, clients, monkeypatch):
    srv = start_server()
    a = clients(srv, "a")
    plan = a.register(job_timeline(), bandwidths=BW)

    def boom(*args, **kwargs):
        raise RuntimeError("planner exploded")

    monkeypatch.setattr(server_mod, "plan_jobs", boom)
    b = clients(srv, "b")
    with pytest.raises(SchedulerError, match="planner exploded") as err:
        b.register(job_timeline(), bandwidths=BW)
    assert err.value.code == "planner"
    assert list(srv.jobs) == ["a"] and a.heartbeat() is plan  # a keeps its plan
    monkeypatch.undo()
    assert clients(srv, "c").register(job_timeline(), bandwidths=BW) is not None


def test_silent_job_is_dropped_after_the_heartbeat_timeout(start_server, clients):
    srv = start_server(heartbeat_timeout_s=0.5)
    a = clients(srv, "a")
    a.register(job_timeline(), bandwidths=BW)
    s = raw(srv.path)
    assert ask(s, encode(register_msg("silent")))["type"] == "plan"
    assert newer(a, 1)
    assert newer(a, 2, timeout=5.0)  # a keeps heartbeating; "silent" does not
    assert a.reason == "departure of silent (silent for 0.5 s)"
    assert list(srv.jobs) == ["a"]
    s.close()


def test_killed_job_is_dropped_and_the_others_replanned(start_server, clients, sock_dir):
    srv = start_server()
    a = clients(srv, "a")
    a.register(job_timeline(), bandwidths=BW)
    blob = sock_dir / "register.bin"
    blob.write_bytes(encode(register_msg("victim")))
    # A stand-in job process, stdlib only (fast to start): registers, then trains forever.
    code = ("import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "s.sendall(open(sys.argv[2], 'rb').read()); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(srv.path), str(blob)])
    try:
        assert newer(a, 1, timeout=10) and "victim" in a.joint["jobs"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        t0 = time.monotonic()
        assert newer(a, 2)
        assert time.monotonic() - t0 < 5
        assert a.reason == "departure of victim (connection closed)"
        assert a.joint["jobs"] == ["a"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_no_scheduler_means_vanilla_without_waiting(sock_dir, clients):
    c = clients(sock_dir / "nobody.sock", "a", retry_s=(0.05, 0.1))
    t0 = time.monotonic()
    assert c.register(job_timeline(), bandwidths=BW) is None
    for _ in range(20):
        assert c.report(7.5) is None
    assert time.monotonic() - t0 < 1.0 and c.retries >= 1 and not c.connected


def test_hung_scheduler_costs_at_most_the_timeout(sock_dir, clients):
    """A scheduler that accepts connections but never answers (e.g. stopped with SIGSTOP)."""
    path = sock_dir / "hung.sock"
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(path))
    hung.listen(8)  # never accepts: connects succeed, replies never come
    try:
        c = clients(path, "a", timeout_s=0.2, register_timeout_s=0.3, retry_s=(0.05, 0.1))
        t0 = time.monotonic()
        assert c.register(job_timeline(), bandwidths=BW) is None
        assert time.monotonic() - t0 < 1.5
        for _ in range(5):
            t0 = time.monotonic()
            assert c.report(7.5) is None
            assert time.monotonic() - t0 < 1.0
            time.sleep(0.06)
        assert wait_until(lambda: c.report(7.5) is None and c.retries >= 3, timeout=5)
    finally:
        hung.close()


def test_a_second_scheduler_on_a_live_socket_is_refused(start_server, sock_dir):
    srv = start_server()
    with pytest.raises(RuntimeError, match="already listening"):
        asyncio.run(SchedulerServer(srv.path).serve())
    (sock_dir / "plain").write_text("x")
    with pytest.raises(FileExistsError, match="not a socket"):
        asyncio.run(SchedulerServer(sock_dir / "plain").serve())


# --------------------------------------------------------------------------- server process
def spawn_server(path: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return server_mod.spawn(path, "--log-level", "WARNING", *extra, env=env)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def fake_training(steps: int, client: TensileClient | None, lr: float = 0.1) -> tuple[np.ndarray, list]:
    """Gradient descent on a quadratic; reports to the scheduler after every step."""
    w = np.ones(4)
    plans = []
    for _ in range(steps):
        t0 = time.monotonic()
        w = w - lr * 2 * (w - np.arange(4))  # the step itself never depends on the scheduler
        if client is not None:
            plans.append(client.report(max((time.monotonic() - t0) * 1e3, 1e-3)))
    return w, plans


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process `pid` holds open.

    The process may open and close files while we look (imports, logging), so an
    fd listed a moment ago can be gone when read: such fds are skipped, not errors.
    """
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


@pytest.mark.slow
def test_killed_scheduler_then_restarted(sock_dir, clients):
    path = sock_dir / "sched.sock"
    proc = spawn_server(path)
    try:
        # The scheduler process listens on the Unix socket only: no TCP socket at all.
        if Path("/proc/net/tcp").exists():
            inodes = socket_inodes(proc.pid)
            tcp = set()
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                if Path(table).exists():
                    tcp |= {line.split()[9] for line in Path(table).read_text().splitlines()[1:]}
            assert inodes and not inodes & tcp
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

        c = clients(path, "job", timeout_s=1.0, retry_s=(0.05, 0.2))
        assert c.register(job_timeline(), bandwidths=BW) is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

        t0 = time.monotonic()
        w, plans = fake_training(50, c)
        assert time.monotonic() - t0 < 5, "client calls blocked training"
        assert all(p is None for p in plans) and not c.connected
        w_ref, _ = fake_training(50, None)
        np.testing.assert_array_equal(w, w_ref)  # no step lost or corrupted

        proc = spawn_server(path)  # replaces the stale socket file of the killed one
        assert wait_until(lambda: c.report(1.0) is not None, timeout=10)
        assert c.job_id == "job" and c.version == 1 and c.reason == "arrival of job"
        proc.send_signal(signal.SIGTERM)  # a clean stop removes the socket file
        proc.wait(10)
        assert proc.returncode == 0 and not path.exists()
        assert c.report(1.0) is None
    finally:
        stop(proc)


def test_gradients_held_to_the_end_travel_with_the_timeline():
    ops = [("f", "forward", 1.0, [1], [2]), ("b", "backward", 1.0, [2], [3]),
           ("o", "optimizer", 1.0, [1, 3], [1]), ("o2", "optimizer", 1.0, [1], [1])]
    tl = AccessTimeline.from_ops(ops, {1: 8, 2: 16, 3: 32}, {1: "param"}, held_to_end=[3])
    back = timeline_from_wire(timeline_to_wire(tl), list(tl.op_ms))
    assert back.tensors[3].held_to_end and back.vanilla_range(3) == (1, 3)
    assert list(back.vanilla_curve()) == list(tl.vanilla_curve())
    # and a storage held past its last access (held_to), but only where there is one
    held = AccessTimeline.from_ops(ops, {1: 8, 2: 16, 3: 32}, {1: "param"}, held_to={2: 2})
    wire = json.loads(json.dumps(timeline_to_wire(held)))
    assert wire["tensors"][1]["held_to"] == 2 and "held_to" not in wire["tensors"][0]
    back = timeline_from_wire(wire, list(held.op_ms))
    assert back.tensors[2].held_to == 2 and back.vanilla_range(2) == (0, 2)
    assert list(back.vanilla_curve()) == list(held.vanilla_curve())
    # and one its forward code holds past its last forward access (forward_hold)
    ops = [("f", "forward", 1.0, [1], [2]), ("g", "forward", 1.0, [2], [3]),
           ("h", "forward", 1.0, [3], [4]), ("b", "backward", 1.0, [4, 2], [5]),
           ("o", "optimizer", 1.0, [1, 5], [1])]
    tl = AccessTimeline.from_ops(ops, {s: 8 for s in range(1, 6)}, {1: "param"},
                                 forward_hold={2: 2})
    wire = json.loads(json.dumps(timeline_to_wire(tl)))
    assert [t.get("forward_hold") for t in wire["tensors"]] == [None, 2, None, None, None]
    back = timeline_from_wire(wire, list(tl.op_ms))
    assert back.tensors[2].forward_hold == 2 and back.backward_gap(2) is None
