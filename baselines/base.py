"""The one interface every competing system is measured through.

A backend turns ``(model, example_inputs)`` into a callable ``fn(*inputs) -> outputs``.
The runner never calls :meth:`Backend.prepare` directly: it calls :func:`try_prepare`,
which checks availability, times the preparation (tracing, compiling, building, CUDA-graph
capture: everything before the first timed call) and turns every failure into a
:class:`PrepareResult` row with a reason, so that a missing backend is a row, never a crash.

Backends register themselves by name in :data:`BACKENDS`; other packages add theirs with
:func:`register_backend` (``nimble`` adds "nimble" and "nimble-single").
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = [
    "Availability",
    "Backend",
    "BackendUnavailable",
    "PrepareResult",
    "BACKENDS",
    "get_backend",
    "register_backend",
    "try_prepare",
    "as_input_tuple",
    "parse_device",
]

MAX_REASON_CHARS = 400  # one line of a results table, not a traceback


@dataclass
class Availability:
    """Whether a backend can run on a device here; ``reason`` says why not."""

    ok: bool
    reason: str = ""


class BackendUnavailable(RuntimeError):
    """Raised by :meth:`Backend.prepare` when the backend cannot run here (a package,
    a GPU or an artifact is missing). :func:`try_prepare` reports it as "unavailable"."""


class Backend:
    """Base class of the adapters. Subclasses set :attr:`name` and override
    :meth:`prepare` and, when they have preconditions, :meth:`_check`."""

    name: str = ""
    supports_training: bool = False
    needs_cuda: bool = False  # True: unavailable on CPU (CUDA graphs, TensorRT)

    def available(self, device: str) -> Availability:
        """Can this backend run on ``device`` ("cpu", "cuda", "cuda:N") here?"""
        try:
            dev = parse_device(device)
        except ValueError as e:
            return Availability(False, str(e))
        if dev.type == "cpu" and self.needs_cuda:
            return Availability(False, f"{self.name} needs a CUDA device; asked for {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "no CUDA GPU visible to torch (torch.cuda.is_available() is False)")
        return self._check(dev)

    def _check(self, device: torch.device) -> Availability:
        """Backend-specific preconditions (packages, compilers); ok by default."""
        return Availability(True)

    def version(self) -> str:
        """What ran, for the results row, e.g. "torch 2.11.0"."""
        return f"torch {torch.__version__}"

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        """Build ``fn(*inputs) -> outputs`` for inputs shaped like ``example_inputs``.

        ``model`` and ``example_inputs`` are already on the target device. Raises
        :class:`BackendUnavailable` when the backend cannot run here, anything else
        when the build fails.
        """
        raise NotImplementedError(f"{type(self).__name__}.prepare")

    def _refuse_training(self, training: bool) -> None:
        """Raise BackendUnavailable for a training request on an inference-only backend."""
        if training and not self.supports_training:
            raise BackendUnavailable(f"{self.name} supports inference only (training=True asked)")


@dataclass
class PrepareResult:
    """The outcome of :func:`try_prepare`: ``fn`` is set only when ``status == "ok"``."""

    status: str  # "ok" | "unavailable" | "error"
    fn: Callable[..., Any] | None
    reason: str
    prepare_s: float
    version: str


BACKENDS: dict[str, Callable[..., Backend]] = {}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``get_backend(name, **options)`` return ``factory(**options)``.

    Registering a name twice is an error unless it is the same factory (or the same
    function re-created by a module reload), so two packages cannot silently clash.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"backend factory for {name!r} must be callable, got {type(factory).__name__}")
    old = BACKENDS.get(name)
    same = old is factory or (old is not None and _qualname(old) == _qualname(factory))
    if old is not None and not same:
        raise ValueError(f"backend {name!r} is already registered (by {old!r})")
    BACKENDS[name] = factory


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


def get_backend(name: str, **options: Any) -> Backend:
    """A fresh backend object for ``name`` with the backend's own ``options`` (e.g.
    ``fuser="none"`` for torchscript); KeyError listing the valid names for an unknown
    backend, ValueError naming the accepted options for an unknown option."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; valid names: {', '.join(sorted(BACKENDS))}") from None
    accepted = [p.name for p in inspect.signature(factory).parameters.values()
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"backend {name} takes the options {accepted or 'none'}; got {unknown}")
    return factory(**options)


def parse_device(device: str | torch.device) -> torch.device:
    """``torch.device`` for "cpu" / "cuda" / "cuda:N"; ValueError for anything else."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


def as_input_tuple(example_inputs: Tensor | tuple[Tensor, ...] | list[Tensor]) -> tuple[Tensor, ...]:
    """The example inputs as a non-empty tuple of tensors (a bare tensor is wrapped)."""
    if isinstance(example_inputs, Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)) and example_inputs and all(
            isinstance(x, Tensor) for x in example_inputs):
        return tuple(example_inputs)
    raise TypeError("example_inputs must be a Tensor or a non-empty tuple of Tensors, got "
                    f"{type(example_inputs).__name__}"
                    + (f" of {[type(x).__name__ for x in example_inputs]}"
                       if isinstance(example_inputs, (tuple, list)) else ""))


def _one_line(text: str) -> str:
    """First non-empty line, cut to MAX_REASON_CHARS."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 3] + "..."


def _safe_version(backend: Backend) -> str:
    try:
        return backend.version()
    except Exception as e:  # a version string must never sink a row
        return f"{backend.name} (version unknown: {type(e).__name__})"


def try_prepare(backend: Backend, model: nn.Module, example_inputs: Tensor | tuple[Tensor, ...],
                device: str, training: bool = False) -> PrepareResult:
    """Prepare ``model`` with ``backend`` and report; never raises for a backend failure.

    status "unavailable": ``available(device)`` said no, or prepare raised
    BackendUnavailable; "error": prepare raised anything else (reason
    ``"<ExceptionType>: <first line>"``); "ok": ``fn`` is ready. ``prepare_s`` is the wall
    time of prepare (on CUDA, synchronised so queued build work is counted).
    """
    avail = backend.available(device)
    if not avail.ok:
        return PrepareResult("unavailable", None, _one_line(avail.reason), 0.0, _safe_version(backend))
    start = time.perf_counter()
    try:
        inputs = as_input_tuple(example_inputs)
        dev = parse_device(device)
        wrong = [str(x.device) for x in inputs if x.device.type != dev.type]
        if wrong:
            raise ValueError(f"example_inputs must be on {device!r}, got tensors on {wrong}")
        if training and not backend.supports_training:
            raise BackendUnavailable(f"{backend.name} supports inference only (training=True asked)")
        fn = backend.prepare(model, inputs, training=training)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        status, reason = "ok", ""
    except BackendUnavailable as e:
        fn, status, reason = None, "unavailable", _one_line(str(e)) or "unavailable"
    except Exception as e:  # the row records the failure; the sweep goes on
        fn, status, reason = None, "error", _one_line(f"{type(e).__name__}: {e}")
    prepare_s = time.perf_counter() - start
    return PrepareResult(status, fn, reason, prepare_s, _safe_version(backend))
