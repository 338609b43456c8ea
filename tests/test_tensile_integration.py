"""``tensile.Scheduler`` with a scheduler process (``scheduler_socket=``), CPU only.

The scheduler runs as ``python -m tensile.server`` in a subprocess; the jobs are small
CNNs in simulation mode. Swap-only plans must leave training bit-identical to vanilla
whether the scheduler is up, down, killed mid-training or restarted.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from polling import wait_until
import tensile
from tensile import server as server_mod
from tensile.step import training_step

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
# Fixed rates (no measurement) and fast copies: the plans are hidden swaps only.
RATES = dict(peak_flops=1e10, peak_bytes_per_s=1e10, copy_latency_ms=0.0,
             d2h_bw=1e12, h2d_bw=1e12, allow_recompute=False)
# Short client timeouts and retries, so the fault tests take seconds.
FAST_CLIENT = dict(timeout_s=2.0, register_timeout_s=20.0, retry_s=(0.05, 0.2))


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(n)]


def state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for p in model.parameters():
        out += [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def vanilla_state(n: int) -> list[torch.Tensor]:
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for b in batches(n):
        training_step(model, opt, b, nn.functional.cross_entropy)
    return state(model, opt)


def assert_identical(sched: tensile.Scheduler, n: int) -> None:
    sched.restore_parameters()
    got = state(sched.model, sched.optimizer)
    want = vanilla_state(n)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b), "training under the scheduler differs from vanilla"


def make_job(path: Path, job_id: str | None = None, **kw) -> tensile.Scheduler:
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return tensile.Scheduler(model, opt, batches(1)[0], nn.functional.cross_entropy,
                             scheduler_socket=path, job_id=job_id,
                             client_kwargs=FAST_CLIENT, **(RATES | kw))


def spawn_server(path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return server_mod.spawn(path, "--log-level", "WARNING", env=env)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@pytest.fixture
def sock_path():
    """A short socket path (AF_UNIX paths are limited to ~107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="tsi", dir="/tmp"))
    yield d / "sched.sock"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(sock_path):
    """A scheduler process; killed after the test whatever happened."""
    procs = [spawn_server(sock_path)]
    yield procs  # a test that restarts the scheduler appends the new process
    for p in procs:
        kill(p)


@pytest.fixture
def jobs():
    """Schedulers made in a test; closed afterwards (leaves the scheduler)."""
    made: list[tensile.Scheduler] = []

    def make(*args, **kw) -> tensile.Scheduler:
        made.append(make_job(*args, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


# --------------------------------------------------------------------------- tests
def test_two_jobs_get_their_parts_of_one_joint_plan(sock_path, server, jobs):
    a = jobs(sock_path, "a")
    ra = a.report()
    assert ra.connected and ra.job_id == "a" and ra.plan_version >= 1
    assert ra.plan_reason == "arrival of a" and a.plan.swaps  # the server's plan runs
    assert a.runner.plan is a.plan

    b = jobs(sock_path, "b")
    rb = b.report()
    assert rb.connected and rb.plan_version > ra.plan_version and b.plan.swaps
    assert "arrival of b" in rb.plan_reason
    a.heartbeat()  # picks up the re-plan the second arrival pushed to a
    assert a.report().plan_version >= rb.plan_version

    for batch in batches(STEPS):  # the two jobs take turns, as on a shared GPU
        a.step(*batch)
        b.step(*batch)
    for s in (a, b):
        r = s.report()
        assert r.steps == STEPS and r.connected and r.plans_received >= 1
        assert r.swap_outs > 0 and r.recomputes == 0 and r.replans == 0  # no local planning
        assert "scheduler" in str(r) and r.budget_bytes is None
        assert_identical(s, STEPS)

    a.close()  # leaving re-plans the other job
    assert not a.report().connected and not a.plan.swaps  # a trains on, vanilla
    assert wait_until(lambda: (b.heartbeat(), "departure of a" in (b.report().plan_reason or ""))[1],
                      timeout=10)


def test_a_jobs_swap_price_goes_to_the_scheduler(sock_path, server, jobs):
    """``swap_cost_ms`` with a scheduler process is the job's option: the joint plan prices
    the job's swaps with it (no budget here: the swaps stay, their price is counted)."""
    a = jobs(sock_path, "a", swap_cost_ms=0.5)
    assert a.client.options["swap_cost_ms"] == 0.5
    assert a.plan.swaps and not a.plan.recomputes
    assert a.plan.est_overhead_ms == pytest.approx(0.5 * len(a.plan.swaps))


def test_a_jobs_swap_price_by_bytes_goes_to_the_scheduler(sock_path, server, jobs):
    """``swap_copy_share`` with a scheduler process is the job's option too: the joint plan
    prices each swap of the job at that share of its copies' time."""
    a = jobs(sock_path, "a", swap_copy_share=0.5)
    assert a.client.options["swap_copy_share"] == 0.5
    assert a.plan.swaps and not a.plan.recomputes
    assert a.plan.est_overhead_ms == pytest.approx(sum(
        0.5 * 1e3 * s.nbytes * (1 / a.d2h_bw + 1 / a.h2d_bw) for s in a.plan.swaps))
    assert a.report().swaps_priced_ms == pytest.approx(a.plan.est_overhead_ms)


def test_no_scheduler_means_vanilla_and_identical_training(sock_path, jobs):
    t0 = time.monotonic()
    s = jobs(sock_path, "alone")  # nobody listens at sock_path
    assert time.monotonic() - t0 < 10, "construction waited for a scheduler that is not there"
    r = s.report()
    assert not r.connected and r.plan_version is None and r.plans_received == 0
    assert not s.plan.swaps and not s.plan.recomputes
    assert s.plan.peak_before == s.plan.peak_after > 0
    for batch in batches(STEPS):
        s.step(*batch)
    assert s.report().steps == STEPS
    assert_identical(s, STEPS)


def test_killed_scheduler_then_restarted(sock_path, server, jobs):
    s = jobs(sock_path, "job")
    assert s.report().connected and s.plan.swaps
    data = batches(200)
    done = 0
    for batch in data[:4]:
        s.step(*batch)
        done += 1
    assert s.report().connected

    kill(server[0])  # the scheduler dies mid-training
    t0 = time.monotonic()
    for batch in data[4:10]:
        s.step(*batch)  # no exception: the job trains on, vanilla
        done += 1
    assert time.monotonic() - t0 < 10, "a dead scheduler blocked training"
    r = s.report()
    assert not r.connected and r.plan_version is None
    assert not s.plan.swaps and s.runner.plan is s.plan
    assert_identical(s, done)  # restore_parameters() is fine mid-training

    server.append(spawn_server(sock_path))  # a new scheduler on the same path
    deadline = time.monotonic() + 20
    for batch in data[10:-3]:
        time.sleep(0.05)  # leave the client's retry pause time to pass
        s.step(*batch)
        done += 1
        if (s.report().connected and s.plan.swaps) or time.monotonic() > deadline:
            break
    r = s.report()
    assert r.connected and r.job_id == "job" and r.plan_version >= 1, \
        f"no plan {done - 10} steps after the scheduler came back"
    # The new scheduler planned for this job: on its arrival, or already again on a drift
    # report (CPU step times are noisy), which only a registered job can send.
    assert r.plan_reason.startswith(("arrival of job", "drift of job")), r.plan_reason
    for batch in data[done:done + 3]:  # and trains under it
        s.step(*batch)
        done += 1
    assert_identical(s, done)


def test_budget_or_planner_with_a_socket_is_refused(sock_path):
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    b = batches(1)[0]
    with pytest.raises(ValueError, match="--budget"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, budget=0.5,
                          scheduler_socket=sock_path, **RATES)
    with pytest.raises(ValueError, match="planner"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy,
                          planner=tensile.vdnn_plan, scheduler_socket=sock_path, **RATES)
    with pytest.raises(ValueError, match="scheduler_socket"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, job_id="x", **RATES)
    with pytest.raises(ValueError, match="swap_cost_ms=0.02 is an option of TENSILE's own planner"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, swap_cost_ms=0.02,
                          planner=tensile.vdnn_plan, **RATES)
    with pytest.raises(ValueError, match="swap_copy_share=0.04 is an option of TENSILE's own planner"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, swap_copy_share=0.04,
                          planner=tensile.vdnn_plan, **RATES)
    with pytest.raises(ValueError, match="swap_copy_share must be a share"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, swap_copy_share=2, **RATES)
    with pytest.raises(ValueError, match="swap_search='always' is an option of TENSILE's own planner"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, swap_search="always",
                          scheduler_socket=sock_path, **RATES)
    with pytest.raises(ValueError, match="swap_search: expected one of"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, swap_search="yes", **RATES)


def test_workspaces_count_in_the_plan_unless_told_not_to():
    """``Scheduler.scratch`` (measured when a CUDA step is captured; set by hand here) goes
    into the timeline the plan is made from, unless ``count_workspaces=False``."""
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    b = batches(1)[0]
    counted = tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, **RATES)
    k = int(np.argmax(counted.timeline.vanilla_curve()))
    peak = int(counted.timeline.vanilla_curve().max())
    counted.scratch = {k: 1 << 20}
    assert counted.timeline.scratch == {k: 1 << 20}
    assert int(counted.timeline.vanilla_curve().max()) == peak + (1 << 20)
    uncounted = tensile.Scheduler(model, opt, b, nn.functional.cross_entropy,
                                  count_workspaces=False, **RATES)
    uncounted.scratch = {k: 1 << 20}
    assert uncounted.timeline.scratch == {} and int(uncounted.timeline.vanilla_curve().max()) == peak
    with pytest.raises(ValueError, match="count_workspaces: expected True or False, got 1"):
        tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, count_workspaces=1, **RATES)


def test_local_mode_reports_no_scheduler_and_close_is_harmless():
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with tensile.Scheduler(model, opt, batches(1)[0], nn.functional.cross_entropy,
                           **RATES) as s:
        for batch in batches(3):
            s.step(*batch)
        r = s.report()
        assert s.client is None and r.scheduler_socket is None and r.connected is None
        assert "scheduler" not in str(r)
        plan = s.plan
    assert s.plan is plan  # planning locally, close() keeps the plan
    assert_identical(s, 3)


@pytest.mark.slow
def test_demo_runs_kills_a_job_and_cleans_up():
    sock = Path(tempfile.mkdtemp(prefix="tsi", dir="/tmp")) / "demo.sock"
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out = subprocess.run([sys.executable, "-m", "tensile.demo_jobs", "--socket", str(sock),
                              "--jobs", "2", "--steps", "6", "--step-delay", "0.05",
                              "--timeout", "120"],
                             env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "killed job-2 after step 3" in out.stdout
        assert "job-1: 6/6 steps, exit 0" in out.stdout
        assert "bit-identical to vanilla: yes" in out.stdout
        assert not sock.exists()  # the scheduler was stopped cleanly
    finally:
        shutil.rmtree(sock.parent, ignore_errors=True)


def test_capture_checks_its_swap_search_before_it_needs_cuda():
    """``capture(swap_search=...)`` re-plans the graph's step with TENSILE's own planner:
    a bad mode, another planner or a capture without that re-plan are refused by name
    (here, on the CPU, before the capture would say it needs CUDA)."""
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    b = batches(1)[0]
    sched = tensile.Scheduler(model, opt, b, nn.functional.cross_entropy, **RATES)
    sched.step(*b)
    with pytest.raises(ValueError, match="swap_search: expected one of"):
        sched.capture(*b, swap_search="sometimes")
    with pytest.raises(ValueError, match="needs plan_for_graph=True"):
        sched.capture(*b, swap_search="always", plan_for_graph=False)
    with pytest.raises(ValueError, match="capture needs CUDA"):
        sched.capture(*b, swap_search="always")
    assert sched._planner_options()["swap_search"] == "unmet"   # nothing changed on refusal
    vdnn = tensile.Scheduler(model, opt, b, nn.functional.cross_entropy,
                             planner=tensile.vdnn_plan, **RATES)
    with pytest.raises(ValueError, match="swap_search='always' is an option of TENSILE's own"):
        vdnn.capture(*b, swap_search="always")
