"""The TENSILE scheduler process: one per GPU, many training jobs (reference §3.6).

    python -m tensile.server --socket /run/user/1000/tensile.sock --budget 60000000000
    python -m tensile.server --socket /run/user/1000/tensile.sock --budget-share 0.8

Jobs connect over a Unix socket (mode 0600; no TCP), register their access timeline and
op times, and receive their part of one joint plan (:mod:`tensile.multi`). The scheduler
re-plans when a job arrives, leaves or disappears (connection closed, e.g. the process
was killed, or silent for ``--heartbeat-timeout`` seconds), when a job reports its
first measured iteration, and when a job's iteration time drifts more than 30 % from
its level under the current plan (median of the last 5 iterations, against the median of
the first ones under that plan, see ``SKIP_AFTER_PLAN``; a single iteration time of a job
sharing the GPU is too noisy, see :class:`tensile.estimate.DriftDetector`). Every re-plan
is logged with its reason and sent to every job.

One asyncio loop serves all connections; planning runs in a worker thread so that the
loop keeps answering (a job's ``measured`` is acknowledged before any re-plan it
causes). Re-plans are serialised, and triggers that arrive during one are folded into
the next. A bad message gets an error reply and affects only its sender; a planner
exception keeps the previous plans (a job whose registration it was gets an error).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from dataclasses import dataclass, field
from pathlib import Path

from .estimate import EWMA_NEW_WEIGHT, DriftDetector
from .multi import JobSpec, JointPlan, check_budget_share, plan_jobs
from .planner import COPY_LATENCY_MS, check_max_overhead
from .protocol import (HEADER, MAX_MESSAGE_BYTES, ProtocolError, check_length, decode,
                       default_socket_path, encode, timeline_from_wire, validate_job_message)
from .timeline import AccessTimeline

__all__ = ["SchedulerServer", "main"]

log = logging.getLogger("tensile.server")

# After a new plan is sent, this many reports stay out of the drift test: one may have been
# measured under the old plan (in flight), the next is the step that switched plans (the
# runtime checks every op there, and the allocator grows). The reference is then the median
# of the next DRIFT_MIN_REPORTS: the new plan's own level, as tensile.estimate.OpTimeModel
# does for a job that plans locally. (Taking the old plan's median as the reference made a
# plan that changes the iteration time by > 30 % re-plan on "drift" again and again: the
# H200 runs of 2026-11-29 saw 7 drift re-plans for one ResNet-50 job alone.)
SKIP_AFTER_PLAN = 2


@dataclass
class _Job:
    """What the scheduler knows about one registered job."""

    job_id: str
    weight: float
    timeline: AccessTimeline          # structure; op times below
    op_ms: list[float]                # current estimates (EWMA over measurements)
    d2h_bw: float
    h2d_bw: float
    options: dict
    writer: asyncio.StreamWriter
    measured: bool = False            # has a measured iteration time
    iter_ms: float | None = None
    op_start_ms: list[float] | None = None
    iter_start_s: float | None = None
    reference_ms: float | None = None  # median iteration time under the current plan
    drift: DriftDetector = field(default_factory=DriftDetector)  # reported iteration times
    skip: int = 0                      # reports still to leave out of the drift test
    pending_reply: int | None = None   # seq of the register message awaiting its plan
    registered_at: float = field(default_factory=time.monotonic)

    def spec(self) -> JobSpec:
        return JobSpec(
            job_id=self.job_id, timeline=self.timeline.with_op_times(self.op_ms),
            weight=self.weight, iter_ms=self.iter_ms, op_start_ms=self.op_start_ms,
            iter_start_s=self.iter_start_s,
            allow_recompute=self.options.get("allow_recompute", True),
            allow_cross_iteration=self.options.get("allow_cross_iteration", True),
            min_bytes=self.options.get("min_swap_bytes", 1),
            swap_cost_ms=float(self.options.get("swap_cost_ms", 0.0)),
            swap_copy_share=float(self.options.get("swap_copy_share", 0.0)))


class SchedulerServer:
    """The scheduler: ``await serve()`` until :meth:`stop` (thread-safe) or a signal.

    ``budget_bytes`` is for all jobs together (``None``: minimise the joint peak with
    hidden swaps, and with recomputation adding at most ``max_overhead`` x each job's
    iteration time); ``budget_share`` instead sets it at every re-plan to that share of
    the jobs' joint peak without plans (:func:`tensile.multi.plan_jobs`). The copy
    bandwidths default to the smallest any job measured (one GPU, one bus). A job silent
    for ``heartbeat_timeout_s`` is dropped.
    """

    def __init__(self, socket_path: str | os.PathLike | None = None, *,
                 budget_bytes: int | None = None, budget_share: float | None = None,
                 heartbeat_timeout_s: float = 60.0,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 d2h_bw: float | None = None, h2d_bw: float | None = None,
                 copy_latency_ms: float = COPY_LATENCY_MS, max_overhead: float = 0.0) -> None:
        check_max_overhead(max_overhead)
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
            raise ValueError(f"budget_bytes must be a positive int or None, got {budget_bytes!r}")
        check_budget_share(budget_bytes, budget_share)
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s!r}")
        for name, bw in (("d2h_bw", d2h_bw), ("h2d_bw", h2d_bw)):
            if bw is not None and not (isinstance(bw, (int, float)) and 0 < bw < float("inf")):
                raise ValueError(f"{name} must be a positive number of bytes/s or None, got {bw!r}")
        self.path = Path(socket_path) if socket_path is not None else default_socket_path()
        self.budget_bytes = budget_bytes
        self.budget_share = budget_share
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.max_message_bytes = int(max_message_bytes)
        self.d2h_bw, self.h2d_bw = d2h_bw, h2d_bw
        self.copy_latency_ms = copy_latency_ms
        self.max_overhead = float(max_overhead)
        self.jobs: dict[str, _Job] = {}
        self.version = 0
        self.replans: list[str] = []       # reasons, in order (for tests and logs)
        self.last_joint: JointPlan | None = None
        self._dirty: list[str] = []
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._plan_lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self.ready = threading.Event()  # set once the socket listens

    # ------------------------------------------------------------------ lifecycle
    async def serve(self) -> None:
        """Listen until stopped; removes the socket file on the way out."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._plan_lock = asyncio.Lock()
        sock = _bind_unix(self.path)
        ino = os.stat(self.path).st_ino
        server = await asyncio.start_unix_server(self._connection, sock=sock)
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, NotImplementedError, RuntimeError):
                self._loop.add_signal_handler(sig, self._stopped.set)  # main thread only
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes} bytes"
        if self.budget_share is not None:
            budget = f"{self.budget_share:g} of the joint peak"
        log.info("TENSILE scheduler listening on %s (budget %s)", self.path, budget)
        self.ready.set()
        try:
            await self._stopped.wait()
        finally:
            self._closing = True  # no re-plans while the connections close
            server.close()
            for job in list(self.jobs.values()):
                job.writer.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == ino:  # still ours, not a successor's
                    os.unlink(self.path)
            log.info("TENSILE scheduler stopped")

    def stop(self) -> None:
        """Stop :meth:`serve` (callable from any thread)."""
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ connections
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one job's connection until it closes, leaves or goes silent."""
        me = asyncio.current_task()
        self._tasks.add(me)
        me.add_done_callback(self._tasks.discard)
        job: _Job | None = None
        why = "connection closed"
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readexactly(HEADER.size),
                                                  self.heartbeat_timeout_s)
                    (n,) = HEADER.unpack(head)
                    check_length(n, self.max_message_bytes)
                    body = await asyncio.wait_for(reader.readexactly(n), self.heartbeat_timeout_s)
                except ProtocolError as e:  # oversized: cannot resynchronise, so close
                    self._send(writer, _error(str(e), e.code))
                    why = "oversized message"
                    break
                except asyncio.TimeoutError:
                    why = f"silent for {self.heartbeat_timeout_s:g} s"
                    break
                except (asyncio.IncompleteReadError, ConnectionError):
                    why = "connection closed"
                    break
                seq = None
                try:
                    raw = decode(body)
                    seq = raw.get("seq") if type(raw.get("seq")) is int else None  # not bool
                    msg = validate_job_message(raw)
                    job, done = self._handle(msg, job, writer)
                except ProtocolError as e:
                    log.warning("rejected a message from %s: %s", job.job_id if job else "a client", e)
                    self._send(writer, _error(str(e), e.code, seq))
                    continue
                if done:
                    why = "left"
                    break
        except asyncio.CancelledError:
            # Only serve() cancels us, when stopping. Ending normally (not re-raising) keeps
            # asyncio's stream callback from logging the cancellation as an error.
            why = "scheduler stopping"
        except Exception:  # a bug here must not take the scheduler down
            log.exception("error while serving %s", job.job_id if job else "a client")
            why = "internal error"
        finally:
            writer.close()
            if job is not None and self.jobs.get(job.job_id) is job:
                self._drop(job, why)

    def _handle(self, msg: dict, job: _Job | None,
                writer: asyncio.StreamWriter) -> tuple[_Job | None, bool]:
        """Act on one valid message; returns the connection's job and whether it is done."""
        kind, seq = msg["type"], msg.get("seq")
        if kind == "register":
            if job is not None:
                raise ProtocolError(f"this connection already registered job {job.job_id!r}")
            return self._register(msg, writer), False
        if job is None:
            raise ProtocolError(f"send 'register' before {kind!r}", "not_registered")
        if kind == "heartbeat":
            self._send(writer, {"type": "ack", **_reply(seq)})
        elif kind == "leave":
            self._send(writer, {"type": "bye", **_reply(seq)})
            return job, True
        elif kind == "measured":
            reason = self._measured(job, msg)
            self._send(writer, {"type": "ack", **_reply(seq)})
            if reason:
                self._trigger(reason)
        return job, False

    def _register(self, msg: dict, writer: asyncio.StreamWriter) -> _Job:
        jid = msg.get("job_id")
        if jid is None:
            self._next_id += 1
            jid = f"job-{self._next_id}"
            while jid in self.jobs:
                self._next_id += 1
                jid = f"job-{self._next_id}"
        elif jid in self.jobs:
            raise ProtocolError(f"job id {jid!r} is already registered", "id_in_use")
        op_ms = msg["op_times_ms"]
        tl = timeline_from_wire(msg["timeline"], op_ms)
        d2h, h2d = msg["bandwidths"]
        job = _Job(job_id=jid, weight=msg.get("weight", 1.0), timeline=tl, op_ms=op_ms,
                   d2h_bw=d2h, h2d_bw=h2d, options=msg.get("options", {}), writer=writer,
                   pending_reply=msg.get("seq", -1))
        if "iter_ms" in msg:  # a job that re-registers brings its measurements
            job.measured, job.iter_ms = True, msg["iter_ms"]
            job.drift.add(job.iter_ms)
            job.iter_start_s = msg.get("iter_start_s")
            job.op_start_ms = self._starts(job, msg.get("op_start_ms"), job.iter_ms)
        self.jobs[jid] = job
        log.info("job %s registered: %d ops, weight %g", jid, tl.num_ops, job.weight)
        self._trigger(f"arrival of {jid}")
        return job

    def _measured(self, job: _Job, msg: dict) -> str | None:
        """Take a job's measurement; returns the re-plan reason, if one is due."""
        times = msg.get("op_times_ms")
        if times is not None and len(times) != len(job.op_ms):
            raise ProtocolError(f"measured.op_times_ms: expected {len(job.op_ms)} op times "
                                f"(job {job.job_id}), got {len(times)}")
        retimed = msg.get("retimed", False)
        if retimed and times is None:
            raise ProtocolError("measured.retimed needs op_times_ms: the new op times")
        new_timeline = None
        if "op_scratch" in msg:
            if not retimed:
                raise ProtocolError("measured.op_scratch goes with retimed: the workspaces of "
                                    "the step's new mode")
            try:
                new_timeline = job.timeline.with_scratch(dict(msg["op_scratch"]))
            except ValueError as e:
                raise ProtocolError(f"measured.op_scratch: {e}") from None
        starts = self._starts(job, msg.get("op_start_ms"), msg["iter_ms"])  # checked first
        if retimed:   # not blended: the op times of the step's old mode are void
            job.op_ms = [max(m, 1e-6) for m in times]
            if new_timeline is not None:
                job.timeline = new_timeline
        elif times is not None:
            w = EWMA_NEW_WEIGHT  # as tensile.estimate.OpTimeModel: 0.9 new + 0.1 old
            job.op_ms = [max(w * m + (1 - w) * e, 1e-6) for m, e in zip(times, job.op_ms)]
        first = not job.measured
        job.measured, job.iter_ms = True, msg["iter_ms"]
        job.op_start_ms = starts
        if "iter_start_s" in msg:
            job.iter_start_s = msg["iter_start_s"]
        if retimed:
            job.drift = DriftDetector()
            job.drift.add(job.iter_ms)
            reason = f"{job.job_id} retimed ({job.iter_ms:.2f} ms per iteration)"
        elif first:
            job.drift.add(job.iter_ms)
            reason = f"first measurement of {job.job_id} ({job.iter_ms:.2f} ms per iteration)"
        elif job.skip:
            job.skip -= 1
            reason = None
        else:
            job.drift.add(job.iter_ms)
            reason = self._drift_reason(job)
        if reason is not None:
            job.reference_ms = None  # no drift test until the re-plan asked for here lands
        return reason

    @staticmethod
    def _drift_reason(job: _Job) -> str | None:
        """The drift re-plan reason, if due (the median of the last reports is off).

        Without a reference (the last plan came before 3 reports, or a re-plan is on its
        way) the median becomes the reference once 3 reports are in.
        """
        ref = job.reference_ms
        if ref is None:
            job.reference_ms = job.drift.settle()
            return None
        if not job.drift.drifted(ref):
            return None
        return (f"drift of {job.job_id}: {job.drift.median_ms():.2f} ms per iteration "
                f"(median of last {job.drift.count}), planned for {ref:.2f} ms")

    @staticmethod
    def _starts(job: _Job, starts: list[float] | None, iter_ms: float) -> list[float] | None:
        """Measured op starts, checked here: a bad list must not break later re-plans."""
        if starts is None:
            return None
        if len(starts) != len(job.op_ms):
            raise ProtocolError(f"op_start_ms: expected {len(job.op_ms)} entries "
                                f"(job {job.job_id}), got {len(starts)}")
        if any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > iter_ms:
            raise ProtocolError(f"op_start_ms: expected non-decreasing starts up to iter_ms="
                                f"{iter_ms}, got {starts[:3]}...{starts[-1:]}")
        return starts

    def _drop(self, job: _Job, why: str) -> None:
        del self.jobs[job.job_id]
        log.info("job %s dropped: %s", job.job_id, why)
        if self.jobs:
            self._trigger(f"departure of {job.job_id} ({why})")

    # ------------------------------------------------------------------ planning
    def _trigger(self, reason: str) -> None:
        if self._closing:
            return
        self._dirty.append(reason)
        self._spawn(self._replan())

    async def _replan(self) -> None:
        """Plan all jobs jointly and send each its part (serialised; triggers coalesce)."""
        async with self._plan_lock:
            if not self._dirty:
                return  # an earlier run already covered this trigger
            reasons, self._dirty = self._dirty, []
            jobs = list(self.jobs.values())
            if not jobs:
                return
            d2h = self.d2h_bw or min(j.d2h_bw for j in jobs)
            h2d = self.h2d_bw or min(j.h2d_bw for j in jobs)
            specs = [j.spec() for j in jobs]
            try:
                joint = await asyncio.to_thread(
                    plan_jobs, specs, budget_bytes=self.budget_bytes,
                    budget_share=self.budget_share, d2h_bw=d2h, h2d_bw=h2d,
                    copy_latency_ms=self.copy_latency_ms, max_overhead=self.max_overhead)
            except Exception as e:
                log.exception("re-plan failed (%s); jobs keep their plans", "; ".join(reasons))
                for j in jobs:  # registrations in this batch: refuse them
                    if j.pending_reply is not None and self.jobs.get(j.job_id) is j:
                        del self.jobs[j.job_id]
                        self._send(j.writer, _error(f"planning failed: {e}", "planner",
                                                    j.pending_reply))
                        j.writer.close()
                return
            self.version += 1
            reason = "; ".join(reasons)
            self.replans.append(reason)
            self.last_joint = joint
            mib = 1 << 20
            # a plan over the budget is said louder: the jobs run above it
            log.log(logging.INFO if joint.feasible else logging.WARNING,
                    "re-plan v%d (%s): %d jobs, joint peak %.1f -> %.1f MiB (sum of job "
                    "peaks %.1f MiB), budget %s, feasible %s, %.1f ms", self.version, reason,
                    len(jobs), joint.peak_before / mib, joint.peak_after / mib,
                    joint.sum_of_peaks_before / mib,
                    "none" if joint.budget_bytes is None else f"{joint.budget_bytes / mib:.1f} MiB",
                    joint.feasible, joint.planner_ms)
            summary = {"jobs": sorted(joint.plans), "cycle_ms": joint.layout.cycle_ms,
                       "peak_before": joint.peak_before, "peak_after": joint.peak_after,
                       "sum_of_peaks_before": joint.sum_of_peaks_before,
                       "sum_of_peaks_after": joint.sum_of_peaks_after,
                       "feasible": joint.feasible, "budget_bytes": joint.budget_bytes}
            for j in jobs:
                if self.jobs.get(j.job_id) is not j:
                    continue  # left while we planned; its departure triggered another run
                # The new plan's level is measured afresh (see SKIP_AFTER_PLAN).
                j.reference_ms, j.drift, j.skip = None, DriftDetector(), SKIP_AFTER_PLAN
                msg = {"type": "plan", "job_id": j.job_id, "version": self.version,
                       "reason": reason, "plan": asdict(joint.plans[j.job_id]),
                       "joint": summary}
                if j.pending_reply is not None:
                    if j.pending_reply >= 0:
                        msg["reply_to"] = j.pending_reply
                    j.pending_reply = None
                self._send(j.writer, msg)

    # ------------------------------------------------------------------ sending
    def _send(self, writer: asyncio.StreamWriter, msg: dict) -> None:
        """Queue one frame; a peer that stopped reading is disconnected, not waited for."""
        if writer.is_closing():
            return
        try:
            writer.write(encode(msg))
        except (ConnectionError, ProtocolError) as e:
            log.warning("could not send %s: %s", msg.get("type"), e)
            writer.close()
            return
        if writer.transport.get_write_buffer_size() > 2 * self.max_message_bytes:
            log.warning("a job does not read its messages; closing its connection")
            writer.close()


def _reply(seq: int | None) -> dict:
    return {} if seq is None else {"reply_to": seq}


def _error(text: str, code: str, seq: int | None = None) -> dict:
    return {"type": "error", "error": text, "code": code, **_reply(seq)}


def _bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600; a stale file from a dead server is replaced."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
            os.unlink(path)  # nobody listens: left over by a killed scheduler
        else:
            raise RuntimeError(f"a scheduler is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created 0600: only this user may connect
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    sock.setblocking(False)
    return sock


def is_listening(path: str | Path) -> bool:
    """Whether a scheduler accepts connections on the Unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (a scheduler then removes its socket file), SIGKILL if that is not enough."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(10)


def spawn(path: str | Path, *args: str, log: Path | None = None, env: dict | None = None,
          timeout_s: float | None = 60.0) -> subprocess.Popen:
    """Start ``python -m tensile.server --socket path *args`` in a new process and wait until
    it listens (``timeout_s=None``: don't wait). Raises RuntimeError if it exits or times out."""
    out = open(log, "a") if log is not None else None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tensile.server", "--socket", str(path), *args],
                                stdout=out, stderr=subprocess.STDOUT if out else None,
                                env=env, cwd=Path(__file__).resolve().parent.parent)
    finally:
        if out is not None:
            out.close()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is not None and not is_listening(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)  # reaped: no zombie left behind
            detail = f"; see {log}:\n{Path(log).read_text()}" if log is not None else ""
            raise RuntimeError(f"the scheduler did not come up (exit code {proc.poll()}){detail}")
        time.sleep(0.1)
    return proc


def _parse_bytes(text: str) -> int:
    """``"40000000000"``, ``"40G"``, ``"512MiB"`` → bytes (binary multiples)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes such as 40G or 512MiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the budget must be positive, got {text!r}")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensile.server",
                                 description="TENSILE scheduler: one joint memory plan for the "
                                             "training jobs on one GPU.")
    ap.add_argument("--socket", type=Path, default=None,
                    help=f"Unix socket path (default {default_socket_path()})")
    ap.add_argument("--budget", type=_parse_bytes, default=None,
                    help="memory budget for all jobs together, e.g. 60G (default: minimise "
                         "the joint peak with hidden swaps only)")
    ap.add_argument("--budget-share", type=float, default=None,
                    help="instead of --budget: at every re-plan, this share (0, 1] of the jobs' "
                         "joint peak without plans; the plans move only what that cut needs")
    ap.add_argument("--max-overhead", type=float, default=0.0,
                    help="without a budget, also recompute activations while that adds at "
                         "most this share of each job's iteration time (default 0: swaps only)")
    ap.add_argument("--heartbeat-timeout", type=float, default=60.0,
                    help="drop a job silent for this many seconds (default 60)")
    ap.add_argument("--d2h-bw", type=float, default=None,
                    help="device-to-host bytes/s (default: the smallest a job measured)")
    ap.add_argument("--h2d-bw", type=float, default=None, help="host-to-device bytes/s")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.budget is not None and args.budget_share is not None:
        ap.error(f"give --budget or --budget-share, not both (got {args.budget} bytes and "
                 f"{args.budget_share})")
    try:
        server = SchedulerServer(args.socket, budget_bytes=args.budget,
                                 budget_share=args.budget_share,
                                 heartbeat_timeout_s=args.heartbeat_timeout,
                                 d2h_bw=args.d2h_bw, h2d_bw=args.h2d_bw,
                                 max_overhead=args.max_overhead)
    except ValueError as e:
        ap.error(str(e))
    try:
        asyncio.run(server.serve())
    except (RuntimeError, OSError) as e:  # already running, path taken, no permission
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
