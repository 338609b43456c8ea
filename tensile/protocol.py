"""The wire protocol between training jobs and the TENSILE scheduler process.

Framing: every message is a 4-byte big-endian length followed by that many bytes of
UTF-8 JSON (one object). A length above ``max_bytes`` (default 64 MiB) is refused
*before* the body is read; the receiver answers with an error and closes the connection
(it cannot find the next frame without reading the body).

Job → scheduler (``seq`` is optional; the reply carries it back as ``reply_to``):

* ``register``: ``job_id`` (str or null: the scheduler picks one), ``weight`` (> 0),
  ``timeline`` (see :func:`timeline_to_wire`), ``op_times_ms`` (one per op),
  ``bandwidths`` ``{"d2h": B/s, "h2d": B/s}``; optional ``iter_ms``, ``op_start_ms``,
  ``iter_start_s`` (as in ``measured``: a job that re-registers sends what it measured)
  and ``options`` ``{"allow_recompute", "allow_cross_iteration", "min_swap_bytes",
  "swap_cost_ms", "swap_copy_share"}`` (the last two: what each swap adds to the job's
  step, e.g. its joins in a CUDA graph, and the share of its copies' time it adds; the
  joint plan prices swaps with them).
  Reply: the job's first ``plan``.
* ``measured``: ``iter_ms`` (wall-clock iteration time); optional ``op_times_ms``
  (measured per-op times), ``op_start_ms`` (per-op start relative to the iteration
  start), ``iter_start_s`` (that iteration's start on ``time.monotonic()``),
  ``retimed`` (true: the job now runs its step another way, e.g. captured in a CUDA
  graph, and ``op_times_ms`` are its new op times: re-plan now, no drift test), with it
  ``op_scratch`` (``[[op, bytes], ...]``: what ops hold only while they run in that mode,
  their workspaces; it replaces the timeline's ``scratch``). Reply: ``ack`` at once; a
  re-plan it causes arrives later as a ``plan``.
* ``heartbeat``: reply ``ack``. Any message counts as a sign of life.
* ``leave``: reply ``bye``, then the scheduler closes the connection.

Scheduler → job: ``plan`` (``job_id``, ``version``, ``reason``, ``plan``: the job's
:class:`~tensile.plan.Plan` as an object, ``joint``: joint figures), sent to every job
after each re-plan; ``ack``; ``bye``; ``error`` (``error``: what was wrong, ``code``:
``bad_message``, ``too_large``, ``not_registered``, ``id_in_use``, ``planner``).
Unknown fields are errors: a typo must not pass as a default.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import struct
import time
from pathlib import Path
from typing import Any, Callable

from .timeline import PHASES, ROLES, AccessTimeline

__all__ = [
    "MAX_MESSAGE_BYTES", "HEADER", "ProtocolError", "default_socket_path", "encode",
    "decode", "validate_job_message", "validate_server_message", "timeline_to_wire",
    "timeline_from_wire", "send_message", "recv_message",
]

MAX_MESSAGE_BYTES = 64 << 20
HEADER = struct.Struct(">I")
_JOB_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class ProtocolError(ValueError):
    """A frame or message that does not follow the protocol. ``code`` names the kind."""

    def __init__(self, message: str, code: str = "bad_message") -> None:
        super().__init__(message)
        self.code = code


def default_socket_path() -> Path:
    """``$XDG_RUNTIME_DIR/tensile.sock`` (a per-user 0700 directory), else ``/tmp/tensile-<uid>.sock``."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run and os.path.isdir(run):
        return Path(run) / "tensile.sock"
    return Path(f"/tmp/tensile-{os.getuid()}.sock")


# ---------------------------------------------------------------------- framing
def encode(msg: dict, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """One frame: length prefix + compact JSON. Refuses NaN/inf and oversized messages."""
    try:
        body = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as e:  # NaN or inf somewhere: JSON has no such numbers
        raise ProtocolError(f"message cannot be sent as JSON: {e}") from None
    if len(body) > max_bytes:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the limit of {max_bytes}",
                            "too_large")
    return HEADER.pack(len(body)) + body


def check_length(n: int, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Refuse a frame length before reading its body."""
    if n > max_bytes:
        raise ProtocolError(f"message length {n} exceeds the limit of {max_bytes} bytes",
                            "too_large")


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"invalid JSON number {name}")


def decode(body: bytes) -> dict:
    """The JSON object in a frame body."""
    try:
        msg = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except ProtocolError:
        raise
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"not valid UTF-8 JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(msg).__name__}")
    return msg


def send_message(sock: socket.socket, msg: dict, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Send one frame on a blocking socket (its timeout applies)."""
    sock.sendall(encode(msg, max_bytes))


def recv_message(sock: socket.socket, deadline: float,
                 max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Read one frame from a blocking socket by ``deadline`` (``time.monotonic()``).

    Raises ``TimeoutError`` past the deadline, ``ConnectionError`` on EOF and
    :class:`ProtocolError` on a bad frame.
    """
    (n,) = HEADER.unpack(_recv_exact(sock, HEADER.size, deadline))
    check_length(n, max_bytes)
    return decode(_recv_exact(sock, n, deadline))


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete message from the scheduler in time")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the connection was closed")
        buf += chunk
    return bytes(buf)


# ---------------------------------------------------------------------- field checks
Check = Callable[[str, Any], Any]


def _fail(name: str, expected: str, got: Any) -> None:
    shown = repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ProtocolError(f"{name}: expected {expected}, got {shown}")


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def positive(name: str, x: Any) -> float:
    if not (_is_num(x) and x > 0):
        _fail(name, "a positive finite number", x)
    return float(x)


def number(name: str, x: Any) -> float:
    if not _is_num(x):
        _fail(name, "a finite number", x)
    return float(x)


def seq_id(name: str, x: Any) -> int:
    if not (_is_int(x) and x >= 0):
        _fail(name, "an int >= 0", x)
    return x


def job_id(name: str, x: Any) -> str | None:
    if x is None:
        return None
    if not (isinstance(x, str) and _JOB_ID.match(x)):
        _fail(name, "null or 1-64 characters of [A-Za-z0-9._-]", x)
    return x


def times_list(name: str, x: Any, allow_zero: bool = False) -> list[float]:
    if not isinstance(x, list) or not x:
        _fail(name, "a non-empty list of numbers (ms)", x)
    for k, v in enumerate(x):
        if not (_is_num(v) and (v >= 0 if allow_zero else v > 0)):
            _fail(f"{name}[{k}]", "a non-negative finite number" if allow_zero
                  else "a positive finite number", v)
    return [float(v) for v in x]


def starts_list(name: str, x: Any) -> list[float]:
    return times_list(name, x, allow_zero=True)


def scratch_list(name: str, x: Any) -> list[list[int]]:
    """``[[op, bytes], ...]``; the op range is checked against the job's timeline."""
    if not isinstance(x, list):
        _fail(name, "a list of [op, bytes]", x)
    for k, e in enumerate(x):
        if not (isinstance(e, list) and len(e) == 2 and _is_int(e[0]) and _is_int(e[1])
                and e[0] >= 0 and e[1] >= 0):
            _fail(f"{name}[{k}]", "[op index, bytes] (ints >= 0)", e)
    return [[int(op), int(nbytes)] for op, nbytes in x]


def bandwidths(name: str, x: Any) -> tuple[float, float]:
    if not isinstance(x, dict) or set(x) != {"d2h", "h2d"}:
        _fail(name, 'an object {"d2h": bytes/s, "h2d": bytes/s}', x)
    return positive(f"{name}.d2h", x["d2h"]), positive(f"{name}.h2d", x["h2d"])


def flag(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        _fail(name, "true or false", x)
    return x


def options(name: str, x: Any) -> dict:
    if not isinstance(x, dict):
        _fail(name, "an object", x)
    known = {"allow_recompute": bool, "allow_cross_iteration": bool, "min_swap_bytes": int,
             "swap_cost_ms": float, "swap_copy_share": "share"}
    for k, v in x.items():
        if k not in known:
            _fail(f"{name}", f"only the keys {sorted(known)}", k)
        if known[k] is bool and not isinstance(v, bool):
            _fail(f"{name}.{k}", "true or false", v)
        if known[k] is int and not (_is_int(v) and v >= 1):
            _fail(f"{name}.{k}", "an int >= 1", v)
        if known[k] is float and not (_is_num(v) and v >= 0):
            _fail(f"{name}.{k}", "a finite number >= 0 (ms)", v)
        if known[k] == "share" and not (_is_num(v) and 0 <= v <= 1):
            _fail(f"{name}.{k}", "a number in [0, 1]", v)
    return dict(x)


def wire_timeline(name: str, x: Any) -> dict:
    if not isinstance(x, dict):
        _fail(name, "a timeline object", x)
    return x  # structure checked by timeline_from_wire, with the op times


def obj(name: str, x: Any) -> dict:
    if not isinstance(x, dict):
        _fail(name, "an object", x)
    return x


def text(name: str, x: Any) -> str:
    if not isinstance(x, str):
        _fail(name, "a string", x)
    return x


# type → {field: (check, required)}
JOB_MESSAGES: dict[str, dict[str, tuple[Check, bool]]] = {
    "register": {"seq": (seq_id, False), "job_id": (job_id, False), "weight": (positive, False),
                 "timeline": (wire_timeline, True), "op_times_ms": (times_list, True),
                 "bandwidths": (bandwidths, True), "iter_ms": (positive, False),
                 "op_start_ms": (starts_list, False), "iter_start_s": (number, False),
                 "options": (options, False)},
    "measured": {"seq": (seq_id, False), "iter_ms": (positive, True),
                 "op_times_ms": (lambda n, v: times_list(n, v, allow_zero=True), False),
                 "op_start_ms": (starts_list, False), "iter_start_s": (number, False),
                 "retimed": (flag, False), "op_scratch": (scratch_list, False)},
    "heartbeat": {"seq": (seq_id, False)},
    "leave": {"seq": (seq_id, False)},
}
SERVER_MESSAGES: dict[str, dict[str, tuple[Check, bool]]] = {
    "plan": {"job_id": (text, True), "version": (seq_id, True), "reason": (text, True),
             "plan": (obj, True), "joint": (obj, True), "reply_to": (seq_id, False)},
    "ack": {"reply_to": (seq_id, False)},
    "bye": {"reply_to": (seq_id, False)},
    "error": {"error": (text, True), "code": (text, True), "reply_to": (seq_id, False)},
}


def _validate(msg: dict, table: dict[str, dict[str, tuple[Check, bool]]]) -> dict:
    kind = msg.get("type")
    if kind not in table:
        raise ProtocolError(f"type: expected one of {sorted(table)}, got {kind!r}")
    fields = table[kind]
    extra = set(msg) - set(fields) - {"type"}
    if extra:
        raise ProtocolError(f"{kind}: unknown fields {sorted(extra)} (allowed: {sorted(fields)})")
    out: dict[str, Any] = {"type": kind}
    for name, (check, required) in fields.items():
        if name not in msg:
            if required:
                raise ProtocolError(f"{kind}: missing field {name!r}")
            continue
        out[name] = check(f"{kind}.{name}", msg[name])
    return out


def validate_job_message(msg: dict) -> dict:
    """A job's message with every field checked and converted; :class:`ProtocolError` if not."""
    return _validate(msg, JOB_MESSAGES)


def validate_server_message(msg: dict) -> dict:
    """The scheduler's message with every field checked; :class:`ProtocolError` if not."""
    return _validate(msg, SERVER_MESSAGES)


# ---------------------------------------------------------------------- timelines
def timeline_to_wire(tl: AccessTimeline) -> dict:
    """The structure of a timeline as JSON-ready data (op times travel separately)."""
    return {
        "names": list(tl.names),
        "phases": list(tl.phases),
        "random": [bool(r) for r in tl.random],
        "reads": [list(map(int, r)) for r in tl.reads],
        "writes": [list(map(int, w)) for w in tl.writes],
        "tensors": [{"sid": int(t.sid), "nbytes": int(t.nbytes), "role": t.role,
                     "swappable": bool(t.swappable),
                     "needed_by": None if t.needed_by is None else int(t.needed_by),
                     "held_to_end": bool(t.held_to_end),
                     **({} if t.held_to is None else {"held_to": int(t.held_to)}),
                     **({} if t.forward_hold is None else {"forward_hold": int(t.forward_hold)})}
                    for t in tl.tensors.values()],
        "transfers": [[op, direction, nbytes] for op, direction, nbytes in tl.transfers],
        "rerun_share": [[op, share] for op, share in tl.rerun_share.items()],
        "scratch": [[op, nbytes] for op, nbytes in tl.scratch.items()],
    }


_TENSOR_KEYS = {"sid", "nbytes", "role", "swappable", "needed_by", "held_to_end"}
_OPTIONAL_TENSOR_KEYS = {"held_to", "forward_hold"}


def timeline_from_wire(data: Any, op_ms: list[float]) -> AccessTimeline:
    """Rebuild a timeline sent by :func:`timeline_to_wire`; :class:`ProtocolError` if malformed."""
    keys = {"names", "phases", "random", "reads", "writes", "tensors"}
    optional = {"transfers", "rerun_share", "scratch"}
    if not isinstance(data, dict) or not keys <= set(data) <= keys | optional:
        _fail("timeline", "an object with names, phases, random, reads, writes, tensors "
              "(and optionally transfers, rerun_share, scratch)",
              sorted(data) if isinstance(data, dict) else data)
    n = len(op_ms)
    for key in ("names", "phases", "random", "reads", "writes"):
        if not isinstance(data[key], list) or len(data[key]) != n:
            _fail(f"timeline.{key}", f"a list of {n} entries (one per op time)", data[key])
    for k in range(n):
        if not isinstance(data["names"][k], str):
            _fail(f"timeline.names[{k}]", "a string", data["names"][k])
        if data["phases"][k] not in PHASES:
            _fail(f"timeline.phases[{k}]", f"one of {PHASES}", data["phases"][k])
        if not isinstance(data["random"][k], bool):
            _fail(f"timeline.random[{k}]", "true or false", data["random"][k])
        for key in ("reads", "writes"):
            sids = data[key][k]
            if not (isinstance(sids, list) and all(_is_int(s) for s in sids)):
                _fail(f"timeline.{key}[{k}]", "a list of storage ids (ints)", sids)
    if not isinstance(data["tensors"], list):
        _fail("timeline.tensors", "a list", data["tensors"])
    sizes, roles, swappable, needed_by = {}, {}, {}, {}
    for k, t in enumerate(data["tensors"]):
        where = f"timeline.tensors[{k}]"
        if not isinstance(t, dict) or not _TENSOR_KEYS <= set(t) <= _TENSOR_KEYS | _OPTIONAL_TENSOR_KEYS:
            _fail(where, f"an object with keys {sorted(_TENSOR_KEYS)} (and optionally "
                  f"{sorted(_OPTIONAL_TENSOR_KEYS)})", t)
        if not _is_int(t["sid"]) or t["sid"] in sizes:
            _fail(f"{where}.sid", "a storage id (int) not listed before", t["sid"])
        if not (_is_int(t["nbytes"]) and t["nbytes"] >= 0):
            _fail(f"{where}.nbytes", "an int >= 0", t["nbytes"])
        if t["role"] not in ROLES:
            _fail(f"{where}.role", f"one of {ROLES}", t["role"])
        if not isinstance(t["swappable"], bool):
            _fail(f"{where}.swappable", "true or false", t["swappable"])
        if t["needed_by"] is not None and not (_is_int(t["needed_by"]) and 0 <= t["needed_by"] < n):
            _fail(f"{where}.needed_by", f"null or an op index in [0, {n})", t["needed_by"])
        if not isinstance(t["held_to_end"], bool):
            _fail(f"{where}.held_to_end", "true or false", t["held_to_end"])
        for key in _OPTIONAL_TENSOR_KEYS & set(t):
            if not (_is_int(t[key]) and 0 <= t[key] < n):
                _fail(f"{where}.{key}", f"an op index in [0, {n})", t[key])
        sid = t["sid"]
        sizes[sid], roles[sid], swappable[sid] = t["nbytes"], t["role"], t["swappable"]
        if t["needed_by"] is not None:
            needed_by[sid] = t["needed_by"]
    if not isinstance(data.get("transfers", []), list):
        _fail("timeline.transfers", "a list of [op, 'h2d' or 'd2h', bytes]", data["transfers"])
    shares = data.get("rerun_share", [])
    if not (isinstance(shares, list)
            and all(isinstance(e, list) and len(e) == 2 and _is_int(e[0]) for e in shares)):
        _fail("timeline.rerun_share", "a list of [op, share of its time]", shares)
    scratch = data.get("scratch", [])
    if not (isinstance(scratch, list)
            and all(isinstance(e, list) and len(e) == 2 and _is_int(e[0]) for e in scratch)):
        _fail("timeline.scratch", "a list of [op, bytes it holds while it runs]", scratch)
    touched = {s for key in ("reads", "writes") for ops in data[key] for s in ops}
    if touched != set(sizes):
        raise ProtocolError(
            f"timeline: tensors {sorted(set(sizes) - touched)[:10]} are never accessed and "
            f"accessed storages {sorted(touched - set(sizes))[:10]} have no tensor entry")
    ops = [(data["names"][k], data["phases"][k], op_ms[k], data["reads"][k], data["writes"][k])
           for k in range(n)]
    try:
        tl = AccessTimeline.from_ops(
            ops, sizes, roles, swappable=swappable,
            needed_by={s: v for s, v in needed_by.items() if roles[s] != "activation"},
            random_ops=[k for k in range(n) if data["random"][k]],
            held_to_end=[t["sid"] for t in data["tensors"] if t["held_to_end"]],
            held_to={t["sid"]: t["held_to"] for t in data["tensors"] if "held_to" in t},
            forward_hold={t["sid"]: t["forward_hold"] for t in data["tensors"]
                          if "forward_hold" in t},
            transfers=data.get("transfers", []),   # entries checked by the timeline
            rerun_share={op: share for op, share in shares},
            scratch={op: nbytes for op, nbytes in scratch})   # bytes checked by the timeline
    except ValueError as e:
        raise ProtocolError(f"timeline: {e}") from None
    return tl
