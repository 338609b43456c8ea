"""How much can independent streams overlap on this GPU? The ceiling of multi-stream speedup.

K independent copies of a model (same weights, own inputs) are captured into one CUDA graph
twice: all on one stream, and one stream per copy. ``overlap = one_stream_ms / k_streams_ms``;
K would be perfect overlap. Inside one model the independent branches are fewer, shorter and
unequal, so a multi-stream schedule of one model gains less than K copies do: this number bounds
what Nimble's multi-stream graph can gain over its single-stream graph at that batch size
(shared/reference/h200-baseline.md measured it at batch 1; issue 3 asks for 1.5x at batch 32 too).

    python -m experiments.headroom --models nasnet_a_mobile,darts --batch 1,32 --copies 2

Rows go to ``<results>/<gpu>/headroom.csv`` (one per model x batch x copies, with the
environment); the report prints them. Needs CUDA.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from tqdm import tqdm

from nimble.cudagraph import capture_graph

from .cli import int_list, model_list
from .env import environment, gpu_slug, host_load
from .store import append_table_row
from .models import build_model, example_input
from .timing import measure

__all__ = ["capture_copies", "overlap", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def capture_copies(models: Sequence[nn.Module], inputs: Sequence[torch.Tensor],
                   parallel: bool) -> torch.cuda.CUDAGraph:
    """One CUDA graph that runs ``models[i](inputs[i])`` for every i, on one stream or one
    stream per copy (forked from and joined back to the capture stream)."""
    if len(models) != len(inputs) or not models:
        raise ValueError(f"need one input per model, got {len(models)} models and {len(inputs)} inputs")
    streams = [torch.cuda.Stream() for _ in models]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():   # warm-up outside capture: cuDNN picks, lazy init
        for model, x in zip(models, inputs):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph), torch.no_grad():
        main_stream = torch.cuda.current_stream()
        for model, x, stream in zip(models, inputs, streams):
            if parallel:
                stream.wait_stream(main_stream)       # fork: the copy starts after the capture's start
                with torch.cuda.stream(stream):
                    model(x)
            else:
                model(x)
        if parallel:
            for stream in streams:                    # join: the capture ends after every copy
                main_stream.wait_stream(stream)
    return graph


def overlap(name: str, batch_size: int, copies: int, *, warmup: int = 50, iters: int = 200) -> dict:
    """Time K copies of ``name`` on one stream and on K streams; the row of :func:`main`."""
    if copies < 2:
        raise ValueError(f"copies must be >= 2 (one copy has nothing to overlap), got {copies}")
    if not torch.cuda.is_available():
        raise RuntimeError("experiments.headroom measures CUDA streams: no CUDA device is available here")
    base = build_model(name).cuda()
    models = [base] + [copy.deepcopy(base) for _ in range(copies - 1)]
    inputs = [example_input(name, batch_size, "cuda", seed=i) for i in range(copies)]
    times = {}
    for label, parallel in (("one_stream", False), ("k_streams", True)):
        graph = capture_copies(models, inputs, parallel)
        times[label] = measure(graph.replay, (), warmup=warmup, iters=iters).median_ms
        del graph
    single = capture_copies(models[:1], inputs[:1], parallel=False)
    times["one_copy"] = measure(single.replay, (), warmup=warmup, iters=iters).median_ms
    return {"model": name, "batch_size": batch_size, "copies": copies,
            "one_copy_ms": times["one_copy"], "one_stream_ms": times["one_stream"],
            "k_streams_ms": times["k_streams"],
            "overlap": times["one_stream"] / times["k_streams"],
            "warmup": warmup, "iters": iters, **environment("cuda"), **host_load()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, type=model_list,
                        help="comma-separated model names (experiments.models)")
    parser.add_argument("--batch", type=int_list, default=[1], help="batch sizes, e.g. 1,32")
    parser.add_argument("--copies", type=int_list, default=[2], help="numbers of copies, e.g. 2,4")
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="results folder")
    parser.add_argument("--iters", type=int, default=200, help="timed replays (>= 100 for the protocol)")
    args = parser.parse_args(argv)
    names = args.models
    if not torch.cuda.is_available():
        parser.error("this experiment measures CUDA streams: no CUDA device is available here")
    out = Path(args.results) / gpu_slug() / "headroom.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = [(m, b, k) for m in names for b in args.batch for k in args.copies]
    for name, batch, k in tqdm(jobs, desc="headroom", unit="setting"):
        row = overlap(name, batch, k, iters=args.iters)
        append_table_row(out, row)
        print(f"{name} b{batch} x{k}: one stream {row['one_stream_ms']:.3f} ms, {k} streams "
              f"{row['k_streams_ms']:.3f} ms, overlap {row['overlap']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
