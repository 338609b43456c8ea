"""How much memory a captured CUDA graph holds, under either PyTorch allocator backend.

PyTorch has two CUDA allocator backends, chosen once per process before CUDA starts
(``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``; ``native`` is the default):

* ``native`` (the caching allocator): a graph's allocations come from a private pool of
  the caching allocator, so the graph's memory is what ``memory_reserved`` grew by during
  capture. A block freed during capture is reused only by later allocations *on the
  stream that allocated it*, so a multi-stream graph keeps one working set per stream.
* ``cudaMallocAsync``: allocations made during capture become CUDA graph memory nodes.
  The driver gives them addresses and reuses memory between allocations whose lifetimes
  do not overlap *in the graph's dependency order*, across streams. The memory is mapped
  at the first launch and does not show in ``memory_reserved``. A graph's own memory is
  the span of its allocation nodes' addresses (:func:`graph_alloc_ranges`); the driver's
  device-wide counter (``cuDeviceGetGraphMemAttribute``) is shared by every graph of the
  process, since graphs that do not run at once share physical pages.

:class:`GraphMemoryMeter` hides the difference: snapshot before capture, read after.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from typing import Iterator, Mapping

import torch

__all__ = ["ALLOCATOR_BACKENDS", "allocator_backend", "allocator_conf", "expandable_segments",
           "graph_memory_used", "graph_alloc_ranges", "span_bytes", "allocator_environment",
           "GraphMemoryMeter", "measure_eager_peak"]

ALLOCATOR_BACKENDS = ("native", "cudaMallocAsync")

_CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT = 0     # CUgraphMem_attribute, cuda.h
_CU_GRAPH_NODE_TYPE_MEM_ALLOC = 10          # CUgraphNodeType, cuda.h
# CUDA_MEM_ALLOC_NODE_PARAMS, cuda.h: CUmemPoolProps (88 bytes), accessDescs, accessDescCount,
# then the two fields read here (the same offsets since CUDA 11.4: the props struct kept its size).
_ALLOC_PARAMS_BYTES, _ALLOC_PARAMS_BYTESIZE, _ALLOC_PARAMS_DPTR = 120, 104, 112


def allocator_backend() -> str:
    """``"native"`` or ``"cudaMallocAsync"`` (fixed once CUDA is initialised)."""
    return torch.cuda.get_allocator_backend()


def allocator_conf(environ: Mapping[str, str] | None = None) -> str:
    """The allocator settings the process was started with (or ``environ`` holds):
    ``PYTORCH_ALLOC_CONF``, or ``PYTORCH_CUDA_ALLOC_CONF`` (its older name, which newer
    PyTorch still reads); ``""``."""
    env = os.environ if environ is None else environ
    return env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""


def allocator_environment(backend: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default: this process's) under which a new process runs the CUDA
    allocator ``backend`` (``"native"`` or ``"cudaMallocAsync"``).

    PyTorch picks its allocator backend when ``torch`` is imported, from ``PYTORCH_ALLOC_CONF``
    (or its older name ``PYTORCH_CUDA_ALLOC_CONF``): a running process cannot switch, so this
    is for starting one (``subprocess``, ``os.execve``). ``backend:<backend>`` is added to both
    variables, their other settings kept. ``ValueError`` for an unknown backend, or for one
    that contradicts a ``backend:`` the environment already names.
    """
    env = dict(os.environ if environ is None else environ)
    if backend not in ALLOCATOR_BACKENDS:
        raise ValueError(f"allocator backend: expected one of {', '.join(ALLOCATOR_BACKENDS)}, "
                         f"got {backend!r}")
    conf = allocator_conf(env)
    settings = [kv.strip() for kv in conf.split(",") if kv.strip()]
    named = [kv.split(":", 1)[1].strip() for kv in settings if kv.startswith("backend:")]
    if named and named[-1] != backend:
        raise ValueError(f"the environment asks for the {named[-1]!r} allocator "
                         f"(PYTORCH_ALLOC_CONF={conf!r}); asked for {backend!r}")
    if not named and backend != "native":             # native: PyTorch's default
        conf = ",".join(settings + [f"backend:{backend}"])
        env["PYTORCH_ALLOC_CONF"] = env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return env


def expandable_segments(conf: str | None = None) -> bool:
    """Whether the caching allocator uses expandable segments: it then maps pages into a
    segment as it grows, so what it reserves stays close to what is allocated instead of
    fragmenting into fixed-size segments.

    With ``conf`` given: whether that setting string turns them on. Without: the allocator's
    own answer once CUDA has started (``torch.cuda.memory._snapshot()``; some releases
    silently ignored ``PYTORCH_ALLOC_CONF`` for it, pytorch/pytorch#183387), else the
    environment's setting.
    """
    if conf is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            return bool(torch.cuda.memory._snapshot()["allocator_settings"]["expandable_segments"])
        except (AttributeError, KeyError, RuntimeError, TypeError):   # private: may move
            pass
    conf = allocator_conf() if conf is None else conf
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _check(err: int, what: str) -> None:
    """Raise for a driver call that did not return CUDA_SUCCESS."""
    if err != 0:
        raise RuntimeError(f"{what} failed with CUresult {err}")


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:                       # pragma: no cover - needs a GPU host
        raise RuntimeError(f"cannot load the CUDA driver library libcuda.so.1: {e}") from e


def graph_memory_used(device: int | None = None) -> int:
    """Bytes of device memory the driver currently associates with CUDA graphs.

    Covers graph memory nodes only (``cudaMallocAsync`` backend); with the native
    allocator graphs allocate from PyTorch's pools and this stays 0. Shared by every graph
    of the process: for one graph's own memory see :func:`graph_alloc_ranges`.
    """
    lib = _libcuda()
    ordinal = torch.cuda.current_device() if device is None else device
    dev, value = ctypes.c_int(), ctypes.c_uint64()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)), f"cuDeviceGet({ordinal})")
    _check(lib.cuDeviceGetGraphMemAttribute(dev, ctypes.c_int(_CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
                                            ctypes.byref(value)), "cuDeviceGetGraphMemAttribute")
    return int(value.value)


def graph_alloc_ranges(cuda_graph: torch.cuda.CUDAGraph) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each memory-allocation node of a captured graph (captured with
    ``keep_graph=True`` under the ``cudaMallocAsync`` backend; other graphs have none)."""
    lib = _libcuda()
    graph = ctypes.c_void_p(cuda_graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    ranges = []
    kind, params = ctypes.c_int(), (ctypes.c_ubyte * _ALLOC_PARAMS_BYTES)()
    for node in nodes:
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != _CU_GRAPH_NODE_TYPE_MEM_ALLOC:
            continue
        _check(lib.cuGraphMemAllocNodeGetParams(ctypes.c_void_p(node), ctypes.byref(params)),
               "cuGraphMemAllocNodeGetParams")
        raw = bytes(params)
        ranges.append((int.from_bytes(raw[_ALLOC_PARAMS_DPTR:_ALLOC_PARAMS_DPTR + 8], "little"),
                       int.from_bytes(raw[_ALLOC_PARAMS_BYTESIZE:_ALLOC_PARAMS_BYTESIZE + 8], "little")))
    return ranges


def span_bytes(ranges: list[tuple[int, int]]) -> int:
    """Bytes covered by the union of ``(address, bytes)`` ranges (overlaps counted once)."""
    total, end = 0, -1
    for start, size in sorted(ranges):
        if start + size > end:
            total += start + size - max(start, end)
            end = start + size
    return total


class GraphMemoryMeter:
    """Memory added by the captures made between construction and :meth:`read`.

    Construct it right before capturing (it synchronises and empties the cache so that
    pool growth is the graph's); call :meth:`read` after capture and, under the
    ``cudaMallocAsync`` backend, after the graph's first launch (graph memory is mapped
    at launch, not at capture).
    """

    def __init__(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.backend = allocator_backend()
        self._reserved = torch.cuda.memory_reserved()
        self._graph = graph_memory_used() if self.needs_launch else 0

    @property
    def needs_launch(self) -> bool:
        """Whether :meth:`read` is only meaningful after the graph has been launched once."""
        return self.backend == "cudaMallocAsync"

    def read(self, *graphs: torch.cuda.CUDAGraph) -> int:
        """Bytes the graph(s) hold now, relative to construction.

        Under ``cudaMallocAsync``, pass the ``graphs`` (captured with ``keep_graph=True``) to
        get their own memory: the span of their allocation nodes' addresses (the driver gives
        allocations whose lifetimes do not overlap in graph order the same addresses, and
        fixes them at capture; overlaps between graphs are counted once). Without graphs it
        is the driver's device-wide counter, which needs a launch first and is no per-graph
        figure: graphs that do not run at once share physical pages, so a second graph of a
        process may add nothing to it (measured on the H200; alone in its process a graph's
        counter was its span rounded up to the driver's 32 MiB mapping, e.g. 320 MiB for a
        301 MiB span).
        """
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - self._reserved
        if self.needs_launch:
            if graphs:
                ranges = [r for graph in graphs for r in graph_alloc_ranges(graph)]
                return span_bytes(ranges) + max(grown, 0)
            grown += graph_memory_used() - self._graph
        return max(grown, 0)


@contextlib.contextmanager
def measure_eager_peak(stats) -> Iterator[None]:
    """Store eager's footprint in ``stats`` (a :class:`nimble.capture.PrepareStats`): weights
    plus the peak the block allocated (``eager_peak_bytes``) and reserved
    (``eager_reserved_bytes``). The block is the uncaptured run that precedes every capture
    (the trace, and for training the pre-run's backward or the warm-up steps, which also
    create the optimizer's state), so a graph's memory can be put beside eager's.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    yield
    torch.cuda.synchronize()
    stats.eager_peak_bytes = torch.cuda.max_memory_allocated() - base + stats.weights_bytes
    stats.eager_reserved_bytes = torch.cuda.max_memory_reserved() - base_reserved + stats.weights_bytes
