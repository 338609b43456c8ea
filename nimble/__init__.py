"""Nimble on stock PyTorch 2.x: ahead-of-time scheduling and multi-stream CUDA graphs.

    fast = nimble.Nimble(model)                        # CUDA model, eval mode
    fast.prepare(example_input, training=False, use_multi_stream=True)
    out = fast(x)                                      # replays one CUDA graph

The pieces, in the order data flows through them: :mod:`nimble.trace` (task graph of one
run), :mod:`nimble.streams` (optimal stream assignment), :mod:`nimble.capture` (pre-run,
multi-stream capture, replay). :mod:`nimble.racecheck` checks a schedule on the CPU.
"""
from .graph import OpNode, TaskGraph
from .trace import TraceMismatchError, trace_graph

__all__ = ["OpNode", "TaskGraph", "TraceMismatchError", "trace_graph"]

try:  # written in parallel; import lazily so a partial tree still imports
    from .streams import StreamPlan, assign_streams  # noqa: F401
    __all__ += ["StreamPlan", "assign_streams"]
except ImportError:  # pragma: no cover
    pass
try:
    from .capture import Nimble, NimbleError  # noqa: F401
    __all__ += ["Nimble", "NimbleError"]
except ImportError:  # pragma: no cover
    pass
