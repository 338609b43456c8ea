"""What a training job uses to talk to the TENSILE scheduler process.

    client = TensileClient(socket_path, weight=2.0)
    plan = client.register(timeline, bandwidths=(d2h_bw, h2d_bw))   # Plan, or None: vanilla
    for step in ...:
        ... one training step under ``plan`` ...
        new = client.report(iter_ms, op_times)      # the plan to run from the next step on
        if new is not plan:
            plan = new                              # None: the scheduler is gone, run vanilla
    client.close()

Every call is bounded by a timeout and never raises on a connection problem: when the
scheduler is unreachable, hung or killed, the call returns ``None`` (run without a plan)
and a later call re-registers, with exponential backoff between attempts (connecting
to a dead Unix socket fails at once, so a down scheduler costs nothing per step). A
re-registration does not wait for its plan: the plan is picked up by a later call.
Error *replies* are different: the scheduler saying the job's message is malformed is
a bug in the caller, and raises :class:`SchedulerError`.

A re-plan caused by another job (arrival, departure, drift) is pushed by the scheduler
and picked up by the next :meth:`report` or :meth:`heartbeat`. Plans only change at
step boundaries, so no step runs half under one plan and half under another.
"""
from __future__ import annotations

import json
import logging
import math
import numbers
import os
import select
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from .plan import Plan
from .protocol import (MAX_MESSAGE_BYTES, ProtocolError, default_socket_path, recv_message,
                       send_message, timeline_to_wire, validate_server_message)
from .timeline import AccessTimeline

__all__ = ["TensileClient", "SchedulerError"]

log = logging.getLogger("tensile.client")

# Error codes that mean "try again later", not "your message is wrong".
_TRANSIENT = {"id_in_use"}


class SchedulerError(RuntimeError):
    """The scheduler rejected a message of this job (``code`` says why)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class TensileClient:
    """One job's connection to the scheduler.

    ``job_id``: a name (``None``: the scheduler assigns one, kept for re-registering).
    ``weight``: the job's priority (> 0; higher keeps more resident). ``timeout_s``
    bounds each call during training; ``register_timeout_s`` the first registration,
    which waits for the cold-start plan. ``retry_s`` = (first, longest) pause between
    reconnection attempts. ``options`` are passed to the planner for this job:
    ``allow_recompute``, ``allow_cross_iteration``, ``min_swap_bytes``, ``swap_cost_ms``,
    ``swap_copy_share``.
    """

    def __init__(self, socket_path: str | os.PathLike | None = None, job_id: str | None = None,
                 weight: float = 1.0, *, timeout_s: float = 2.0, register_timeout_s: float = 30.0,
                 retry_s: tuple[float, float] = (1.0, 60.0), options: dict | None = None) -> None:
        if not (isinstance(weight, numbers.Real) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a positive number, got {weight!r}")
        if not (timeout_s > 0 and register_timeout_s > 0):
            raise ValueError(f"timeouts must be positive, got {timeout_s!r}, {register_timeout_s!r}")
        if not (0 < retry_s[0] <= retry_s[1]):
            raise ValueError(f"retry_s must be (first, longest) with 0 < first <= longest, got {retry_s!r}")
        self.socket_path = Path(socket_path) if socket_path is not None else default_socket_path()
        self.job_id = job_id
        self.weight = float(weight)
        self.timeout_s, self.register_timeout_s = float(timeout_s), float(register_timeout_s)
        self.retry_s = (float(retry_s[0]), float(retry_s[1]))
        self.options = dict(options or {})
        self._sock: socket.socket | None = None
        self._seq = 0
        self._plan: Plan | None = None
        self._version = -1
        self._awaiting: tuple[int, float] | None = None  # (seq, deadline) of a pending register
        self._payload: dict | None = None                # what re-registration sends
        self._backoff = self.retry_s[0]
        self._next_try = 0.0
        self.reason: str | None = None   # why the current plan was made
        self.joint: dict | None = None   # the joint figures of the current plan
        self.retries = 0      # failed connection attempts so far

    # ------------------------------------------------------------------ state
    @property
    def plan(self) -> Plan | None:
        """The plan to run now; ``None`` means vanilla (no scheduler, or no plan yet)."""
        return self._plan

    @property
    def version(self) -> int:
        """The scheduler's version of the current plan (``-1``: none)."""
        return self._version

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # ------------------------------------------------------------------ calls
    def register(self, timeline: AccessTimeline, op_times: Sequence[float] | None = None, *,
                 bandwidths: tuple[float, float], iter_ms: float | None = None) -> Plan | None:
        """Register the job and wait (``register_timeout_s``) for its cold-start plan.

        ``op_times``: one estimate per op in ms (default: ``timeline.op_ms``);
        ``bandwidths``: measured ``(d2h, h2d)`` bytes/s. Returns the plan, or ``None`` when
        the scheduler is unreachable (later calls keep trying).
        """
        op_times = [float(x) for x in (timeline.op_ms if op_times is None else op_times)]
        if len(op_times) != timeline.num_ops:
            raise ValueError(f"op_times has {len(op_times)} entries, the timeline has "
                             f"{timeline.num_ops} ops")
        d2h, h2d = bandwidths
        self._payload = {"weight": self.weight, "timeline": timeline_to_wire(timeline),
                         "op_times_ms": op_times,
                         "bandwidths": {"d2h": float(d2h), "h2d": float(h2d)}}
        if self.options:
            self._payload["options"] = self.options
        if iter_ms is not None:
            self._payload["iter_ms"] = float(iter_ms)
        self._leave()  # registering again: the old registration goes first
        if not self._try_register(wait=True):
            self._schedule_retry()
        return self._plan

    def report(self, iter_ms: float, op_times: Sequence[float] | None = None, *,
               op_start_ms: Sequence[float] | None = None,
               iter_start_s: float | None = None, retimed: bool = False,
               scratch: Mapping[int, int] | None = None) -> Plan | None:
        """Report one finished iteration; returns the plan to run from the next step on.

        ``iter_ms``: its wall-clock time; ``op_times``: measured per-op ms, when this step
        was timed op by op; ``op_start_ms``: measured op starts relative to the iteration
        start; ``iter_start_s``: the iteration's start on ``time.monotonic()``;
        ``retimed``: the step now runs another way (captured) and ``op_times`` are its new
        op times: the scheduler re-plans at once (see :meth:`wait_for_plan`); ``scratch``,
        with ``retimed`` only: ``{op: bytes}`` the ops hold only while they run that way
        (:attr:`tensile.timeline.AccessTimeline.scratch`). The result is the same object as
        before unless the plan changed (``None``: vanilla).
        """
        if retimed and op_times is None:
            raise ValueError("retimed=True needs op_times: the step's new op times")
        if scratch is not None and not retimed:
            raise ValueError("scratch goes with retimed=True: the workspaces of the step's new mode")
        if not (isinstance(iter_ms, numbers.Real) and math.isfinite(iter_ms) and iter_ms > 0):
            raise ValueError(f"iter_ms must be a positive finite number of ms, got {iter_ms!r}")
        n = len(self._payload["op_times_ms"]) if self._payload is not None else None
        for name, xs in (("op_times", op_times), ("op_start_ms", op_start_ms)):
            if xs is not None and n is not None and len(xs) != n:
                raise ValueError(f"{name} has {len(xs)} entries, the registered timeline has {n} ops")
        msg: dict = {"type": "measured", "iter_ms": float(iter_ms)}
        if op_times is not None:
            msg["op_times_ms"] = [float(x) for x in op_times]
        if op_start_ms is not None:
            msg["op_start_ms"] = [float(x) for x in op_start_ms]
        if iter_start_s is not None:
            msg["iter_start_s"] = float(iter_start_s)
        if scratch is not None:
            msg["op_scratch"] = [[int(op), int(nbytes)] for op, nbytes in scratch.items()]
        self._remember(msg)
        if retimed:
            msg["retimed"] = True
        return self._call(msg)

    def wait_for_plan(self, newer_than: int, timeout_s: float) -> Plan | None:
        """Heartbeat until a plan of a version above ``newer_than`` has come, or
        ``timeout_s`` passed (or the scheduler is gone); returns the plan then held."""
        deadline = time.monotonic() + timeout_s
        while self.connected and self._version <= newer_than and time.monotonic() < deadline:
            self.heartbeat()
            if self._version <= newer_than:
                time.sleep(0.01)
        return self._plan

    def heartbeat(self) -> Plan | None:
        """A sign of life (for long steps) that also picks up pushed plans."""
        return self._call({"type": "heartbeat"})

    def close(self) -> None:
        """Leave the scheduler (the others are re-planned) and close the connection."""
        self._leave()
        self._payload = None  # no re-registration after an explicit close

    def __enter__(self) -> "TensileClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _leave(self) -> None:
        if self._sock is not None:
            try:
                seq = self._send({"type": "leave"})
                self._read_until(seq, time.monotonic() + self.timeout_s)
            except (OSError, ProtocolError, SchedulerError):
                pass  # leaving anyway: closing the connection is a departure too
        self._disconnect()

    def _call(self, msg: dict) -> Plan | None:
        """Send ``msg`` and wait for its reply; reconnect when due; never raise on faults."""
        if self._sock is None:
            if self._payload is not None and time.monotonic() >= self._next_try:
                if not self._try_register(wait=False):
                    self._schedule_retry()
            return self._plan
        try:
            if self._awaiting is not None:  # a re-registration whose plan has not come yet
                self._poll()
                if self._awaiting is not None:
                    if time.monotonic() > self._awaiting[1]:
                        raise TimeoutError("no plan for the re-registration in time")
                    return self._plan
            seq = self._send(msg)
            self._read_until(seq, time.monotonic() + self.timeout_s)
            self._poll()
        except (OSError, ProtocolError) as e:
            self._lost(e)
        except SchedulerError as e:
            if e.code not in _TRANSIENT:
                raise
            self._lost(e)
        return self._plan

    def _try_register(self, wait: bool) -> bool:
        """Connect and send ``register``; with ``wait``, block for the plan."""
        assert self._payload is not None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.socket_path))
            except OSError:
                sock.close()
                raise
            self._sock = sock
            seq = self._send({"type": "register", "job_id": self.job_id, **self._payload})
            limit = time.monotonic() + self.register_timeout_s
            if wait:
                self._read_until(seq, limit)
            else:
                self._awaiting = (seq, limit)
                self._poll()
        except SchedulerError as e:
            self._disconnect()
            if e.code in _TRANSIENT:
                log.info("registration refused for now (%s); will retry", e)
                return False
            raise
        except (OSError, ProtocolError) as e:
            self._disconnect()
            log.info("TENSILE scheduler at %s unreachable (%s); running without a plan",
                     self.socket_path, e)
            return False
        self._backoff = self.retry_s[0]
        return True

    def _send(self, msg: dict) -> int:
        assert self._sock is not None
        self._seq += 1
        msg["seq"] = self._seq
        self._sock.settimeout(self.timeout_s)
        send_message(self._sock, msg)
        return self._seq

    def _read_until(self, seq: int, deadline: float) -> None:
        """Handle incoming messages until the reply to ``seq`` (pushed plans on the way)."""
        while not self._handle(recv_message(self._sock, deadline, MAX_MESSAGE_BYTES), seq):
            pass

    def _poll(self) -> None:
        """Handle the messages that have already arrived, without waiting for more."""
        while self._sock is not None and select.select([self._sock], [], [], 0)[0]:
            # A frame that has started arriving is read whole (the scheduler writes whole frames).
            self._handle(recv_message(self._sock, time.monotonic() + self.timeout_s), None)

    def _handle(self, raw: dict, seq: int | None) -> bool:
        """Apply one message; True when it is the reply to ``seq``."""
        msg = validate_server_message(raw)
        reply_to = msg.get("reply_to")
        if msg["type"] == "error":
            if self._awaiting is not None and reply_to == self._awaiting[0]:
                self._awaiting = None
                raise SchedulerError(f"scheduler refused registration: {msg['error']}", msg["code"])
            raise SchedulerError(f"scheduler: {msg['error']}", msg["code"])
        if msg["type"] == "plan":
            self._take_plan(msg)
            if self._awaiting is not None and reply_to == self._awaiting[0]:
                self._awaiting = None
        elif msg["type"] == "bye":
            return True
        return seq is not None and reply_to == seq

    def _take_plan(self, msg: dict) -> None:
        if msg["version"] <= self._version:
            return
        if self.job_id is not None and msg["job_id"] != self.job_id:
            raise ProtocolError(f"the scheduler sent a plan for job {msg['job_id']!r}; "
                                f"this is {self.job_id!r}")
        try:
            plan = Plan.from_json(json.dumps(msg["plan"]))
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"the scheduler sent a malformed plan: {e}") from None
        if self._payload is not None and plan.num_ops != len(self._payload["op_times_ms"]):
            raise ProtocolError(f"the scheduler sent a plan for {plan.num_ops} ops; this job "
                                f"has {len(self._payload['op_times_ms'])}")
        self.job_id = msg["job_id"]
        self._version = msg["version"]
        self.reason, self.joint = msg["reason"], msg["joint"]
        if not _same_plan(plan, self._plan):  # an identical plan keeps its object
            self._plan = plan
            log.info("TENSILE plan v%d for %s (%s)", self._version, self.job_id, self.reason)

    def _remember(self, measured: dict) -> None:
        """Keep the latest measurements, so a re-registration brings them along."""
        if self._payload is None:
            return
        self._payload["iter_ms"] = measured["iter_ms"]
        for key in ("op_start_ms", "iter_start_s"):  # only with the iter_ms they belong to
            if key in measured:
                self._payload[key] = measured[key]
            else:
                self._payload.pop(key, None)
        if "op_times_ms" in measured:
            self._payload["op_times_ms"] = [max(x, 1e-6) for x in measured["op_times_ms"]]
        if "op_scratch" in measured:   # re-registering brings the timeline's workspaces
            self._payload["timeline"] = {**self._payload["timeline"],
                                         "scratch": measured["op_scratch"]}

    def _lost(self, err: Exception) -> None:
        log.warning("lost the TENSILE scheduler (%s); running without a plan", err)
        self._disconnect()
        self._schedule_retry()

    def _schedule_retry(self) -> None:
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(2 * self._backoff, self.retry_s[1])
        self.retries += 1

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._awaiting = None
        self._plan, self._version = None, -1
        self.reason = self.joint = None


def _same_plan(a: Plan | None, b: Plan | None) -> bool:
    """Equal in everything the runtime uses (the planner's wall time differs every run)."""
    if a is None or b is None:
        return a is b
    return replace(a, planner_ms=0.0) == replace(b, planner_ms=0.0)
