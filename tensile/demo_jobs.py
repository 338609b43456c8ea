"""Several training jobs and one TENSILE scheduler process, on the CPU (a runnable demo).

    python -m tensile.demo_jobs --socket /tmp/tsl.sock --jobs 3 --steps 20

starts ``python -m tensile.server`` and ``--jobs`` training jobs as separate processes.
Each job trains a small CNN through ``tensile.Scheduler(..., scheduler_socket=...)`` in
simulation mode (CPU tensors, the runtime's bookkeeping) next to a vanilla copy of
itself. Midway one job is killed (``--kill job``, default: the others are re-planned)
or the scheduler is killed and restarted at once (``--kill scheduler``: the jobs train on
vanilla and re-register once it listens again, a few seconds later; give them enough
steps to see it, e.g. ``--steps 60``). At the end it prints, per job, the plan versions it ran,
its losses and whether its parameters are bit-identical to the vanilla copy, and the
scheduler's re-plans. Every process it starts is killed on the way out; the whole run
is bounded by ``--timeout`` seconds. Exit status 0 when every job that was not killed
finished bit-identical to vanilla.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import server

__all__ = ["main"]

_ROOT = Path(__file__).resolve().parents[1]  # so the children import this tensile


# ---------------------------------------------------------------------- one job
def run_job(name: str, socket_path: str, steps: int, width: int, delay_s: float) -> None:
    """Train under the scheduler and, on the same batches, a vanilla copy; JSON lines out."""
    import torch
    from torch import nn

    from .api import Scheduler
    from .step import training_step

    def cnn() -> nn.Module:
        torch.manual_seed(width)
        return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(width, 2 * width, 3, padding=1),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(2 * width * 4 * 4, 10))

    def state(model, opt) -> list:
        out = list(model.state_dict().values())
        return out + [v for p in model.parameters() for v in opt.state[p].values()
                      if isinstance(v, torch.Tensor)]

    g = torch.Generator().manual_seed(width)
    data = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(steps)]
    model, ref = cnn(), cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    loss_fn = nn.functional.cross_entropy
    # Fixed rates and fast copies: no measurement, and the plans are hidden swaps only
    # (no recomputation), which the runtime keeps bit-identical to vanilla.
    with Scheduler(model, opt, data[0], loss_fn, simulate=True, allow_recompute=False,
                   peak_flops=1e10, peak_bytes_per_s=1e10, d2h_bw=1e12, h2d_bw=1e12,
                   scheduler_socket=socket_path, job_id=name,
                   client_kwargs={"timeout_s": 2.0, "retry_s": (0.05, 0.2)}) as sched:
        for i, batch in enumerate(data):
            loss = float(sched.step(*batch))
            ref_loss = float(training_step(ref, ref_opt, batch, loss_fn))
            r = sched.report()
            _emit({"job": name, "step": i, "loss": loss, "same_loss": loss == ref_loss,
                   "version": r.plan_version, "connected": r.connected,
                   "swaps": len(sched.plan.swaps)})
            time.sleep(delay_s)  # so the jobs overlap in time, as on a shared GPU
        sched.restore_parameters()
        same = all(torch.equal(a, b) for a, b in zip(state(model, opt), state(ref, ref_opt)))
        _emit({"job": name, "done": True, "identical": same})


def _emit(msg: dict) -> None:
    print(json.dumps(msg), flush=True)


# ---------------------------------------------------------------------- the driver
class _Job:
    """A job process and what it printed."""

    def __init__(self, name: str, proc: subprocess.Popen, log: Path) -> None:
        self.name, self.proc, self.log = name, proc, log
        self.steps = 0
        self.losses: list[float] = []
        self.versions: list[int | None] = []   # plan versions in the order they ran
        self.same_losses = True
        self.identical: bool | None = None
        self.killed_at: int | None = None


def _start_server(path: Path, log: Path, env: dict, deadline: float | None) -> subprocess.Popen:
    """Start ``python -m tensile.server``; wait until it listens unless ``deadline`` is None."""
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    return server.spawn(path, log=log, env=env, timeout_s=timeout)


def _read_lines(name: str, stream, out: queue.Queue) -> None:
    for line in stream:
        out.put((name, line))
    out.put((name, None))  # end of output


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL: the crash the demo is about (nothing is cleaned up)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def run_demo(socket_path: Path | None, n_jobs: int, steps: int, kill: str, delay_s: float,
             timeout_s: float) -> int:
    """Start the scheduler and the jobs, follow them, print the summary; 0 when all is well."""
    work = Path(tempfile.mkdtemp(prefix="tsl-demo", dir="/tmp"))
    path = socket_path or work / "sched.sock"
    env = {**os.environ, "PYTHONPATH": str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    deadline = time.monotonic() + timeout_s
    server_log = work / "scheduler.log"
    procs: list[subprocess.Popen] = []
    jobs: dict[str, _Job] = {}
    events: list[str] = []
    try:
        scheduler = _start_server(path, server_log, env, deadline)
        procs.append(scheduler)
        lines: queue.Queue = queue.Queue()
        for k in range(n_jobs):
            name = f"job-{k + 1}"
            log = work / f"{name}.log"
            with open(log, "w") as f:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tensile.demo_jobs", "--run-job", name, "--socket",
                     str(path), "--steps", str(steps), "--width", str(4 + 4 * k),
                     "--step-delay", str(delay_s)],
                    stdout=subprocess.PIPE, stderr=f, text=True, env=env, cwd=_ROOT)
            procs.append(proc)
            jobs[name] = _Job(name, proc, log)
            threading.Thread(target=_read_lines, args=(name, proc.stdout, lines), daemon=True).start()

        victim = jobs[f"job-{n_jobs}"]
        open_streams = set(jobs)
        killed = False
        while open_streams:
            if time.monotonic() > deadline:
                events.append(f"timeout after {timeout_s:g} s: stopping everything")
                break
            try:
                name, line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                open_streams.discard(name)
                continue
            job, msg = jobs[name], json.loads(line)
            if msg.get("done"):
                job.identical = msg["identical"]
                continue
            job.steps = msg["step"] + 1
            job.losses.append(msg["loss"])
            job.same_losses &= msg["same_loss"]
            if not job.versions or job.versions[-1] != msg["version"]:
                job.versions.append(msg["version"])
            if not killed and kill == "job" and job is victim and job.steps >= steps // 2:
                _kill(victim.proc)
                victim.killed_at = victim.steps
                events.append(f"killed {victim.name} after step {victim.steps}")
                killed = True
            elif not killed and kill == "scheduler" and job.steps >= steps // 4:
                _kill(scheduler)
                events.append(f"killed the scheduler when {name} had done {job.steps} steps; "
                              "restarting it (it takes a few seconds to listen)")
                procs.append(_start_server(path, server_log, env, None))  # the jobs train on
                killed = True
        for j in jobs.values():
            if j.killed_at is None:
                j.proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        events.append(f"timeout after {timeout_s:g} s: stopping everything")
    finally:
        for p in procs:  # only what this run started, each by its own handle
            server.stop_process(p)
        _print_summary(jobs, events, server_log, steps)
        shutil.rmtree(work, ignore_errors=True)
    ok = all(j.killed_at is not None or (j.steps == steps and j.identical and j.same_losses)
             for j in jobs.values())
    return 0 if ok and jobs else 1


def _print_summary(jobs: dict[str, _Job], events: list[str], server_log: Path, steps: int) -> None:
    print("events:")
    for e in events:
        print(f"  {e}")
    print("jobs (plan versions in the order they ran; '-' = vanilla, no plan):")
    for j in jobs.values():
        versions = " ".join("-" if v is None else f"v{v}" for v in j.versions)
        status = (f"killed after step {j.killed_at}" if j.killed_at is not None
                  else f"exit {j.proc.returncode}")
        same = {True: "yes", False: "NO", None: "?"}[j.identical if j.same_losses else False]
        print(f"  {j.name}: {j.steps}/{steps} steps, {status}; plans {versions}; "
              f"bit-identical to vanilla: {same}")
        shown = [f"{x:.3f}" for x in j.losses]
        if len(shown) > 12:
            shown = shown[:6] + ["..."] + shown[-6:]
        print("    losses " + " ".join(shown))
        if j.killed_at is None and j.proc.returncode not in (0, None) and j.log.exists():
            print("    its stderr ends: " + j.log.read_text()[-2000:].replace("\n", "\n      "))
    if server_log.exists():
        replans = [ln.split(" INFO ", 1)[-1] for ln in server_log.read_text().splitlines()
                   if "re-plan v" in ln or "listening on" in ln]
        n = sum("re-plan v" in ln for ln in replans)
        drift = sum("drift of" in ln for ln in replans)
        print(f"scheduler: {n} re-plans ({drift} on drift of a job's iteration time, "
              "not listed):")
        for ln in replans:
            if "drift of" not in ln:
                print(f"  {ln}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensile.demo_jobs", description=__doc__.split("\n")[0])
    ap.add_argument("--socket", type=Path, default=None,
                    help="Unix socket for the scheduler (default: in a temporary directory)")
    ap.add_argument("--jobs", type=int, default=3, help="training jobs (default 3)")
    ap.add_argument("--steps", type=int, default=20, help="steps per job (default 20)")
    ap.add_argument("--kill", choices=("job", "scheduler", "none"), default="job",
                    help="kill the last job midway (default), or the scheduler (then restart it)")
    ap.add_argument("--step-delay", type=float, default=0.1,
                    help="seconds each job sleeps after a step, so the jobs overlap (default 0.1)")
    ap.add_argument("--timeout", type=float, default=180.0,
                    help="stop everything after this many seconds (default 180)")
    ap.add_argument("--run-job", default=None, help=argparse.SUPPRESS)  # a job process
    ap.add_argument("--width", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.steps < 2:
        ap.error(f"need --jobs >= 1 and --steps >= 2, got {args.jobs} and {args.steps}")
    if args.step_delay < 0 or args.timeout <= 0:
        ap.error(f"need --step-delay >= 0 and --timeout > 0, got {args.step_delay} and {args.timeout}")
    if args.run_job is not None:
        if args.socket is None:
            ap.error("--run-job needs --socket")
        run_job(args.run_job, str(args.socket), args.steps, args.width, args.step_delay)
        return 0
    return run_demo(args.socket, args.jobs, args.steps, args.kill, args.step_delay, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
