"""Speed and graph memory of Nimble for 1 stream, capped stream counts and all streams.

    python -m experiments.stream_memory nasnet_a_mobile,darts --batches 1,32

Prints one JSON line per (model, batch): for each setting (single, multi, cap8, cap4, cap2)
the median latency of a graph replay in ms (no input copy; 20 warm-ups, 60
CUDA-event-timed replays), the graph's
private pool in MiB and the number of streams; plus eager's allocated and reserved peaks
and the weights. This is the measurement behind "Known limits" in the README: each stream
reuses only its own freed memory, so the pool grows with the number of streams.
"""
from __future__ import annotations

import argparse
import json

import torch

from experiments.models import build_model, example_input
from experiments.timing import measure
from nimble import Nimble

MB = 2 ** 20
SETTINGS = [("single", dict(use_multi_stream=False)), ("multi", {}),
            ("cap8", dict(max_streams=8)), ("cap4", dict(max_streams=4)),
            ("cap2", dict(max_streams=2))]


def measure_model(name: str, batch: int) -> dict:
    """One row: latency, pool and streams per setting for ``name`` at ``batch``."""
    model = build_model(name).cuda().eval()
    x = example_input(name, batch, "cuda")
    row: dict = {"model": name, "batch_size": batch}
    for label, kwargs in SETTINGS:
        fast = Nimble(model).prepare(x, **kwargs)
        st = fast.stats
        timing = measure(fast.replay, (), warmup=20, iters=60, device="cuda")   # graph only
        row[label] = [round(timing.median_ms, 3), round(st.graph_pool_bytes / MB), st.num_streams]
        row["eager_alloc_mb"] = round((st.eager_peak_bytes - st.weights_bytes) / MB)
        row["eager_reserved_mb"] = round((st.eager_reserved_bytes - st.weights_bytes) / MB)
        row["weights_mb"] = round(st.weights_bytes / MB)
        row["allocator"] = st.allocator
        del fast
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", help="comma-separated model names (experiments.models)")
    parser.add_argument("--batches", default="1,32")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("experiments.stream_memory needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True
    for name in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            print(json.dumps(measure_model(name, batch)), flush=True)


if __name__ == "__main__":
    main()
