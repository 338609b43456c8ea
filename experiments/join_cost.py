"""What a swap's waits cost inside a CUDA graph: a chain of kernels with side-stream copies.

A captured TENSILE step (``tensile_graph``) joins each swap into the compute stream twice: the
release waits for the copy-out (a later kernel may reuse the block), the use waits for the
copy-in. The twenty-ninth session found the plan's swaps slower than their hidden copies
(about 0.02 ms per swap on the H200, ``tensile.planner.CAPTURED_SWAP_COST_MS``) with every copy
done in time. This experiment isolates that cost on a chain of ``kernels`` matrix products
(about the length of an Inception-v4 training step) with ``swaps`` copies out in the first
half and back in the second, each finished long before its wait:

* ``joins=none``: the copies fork from the compute stream and join it only at the end;
* ``joins=release`` / ``use`` / ``both``: the compute stream also waits for each copy-out at
  its release / for each copy-in at its use, as the runtime does;
* ``group=G``: G swaps in a row share their release op and their use op, and one wait per
  copy stream covers them (a stream's later event implies its earlier copies are done);
* ``forks=once``: the copy streams fork from the compute stream once, at the start, instead
  of before each copy (the copies then read data not yet final: timing only), to tell the
  fork edges' cost from the copies' own;
* ``side=kernel``: a small kernel on each side stream (the tensor times one) instead of the
  copy; ``side=inline``: the copies on the compute stream itself, no side streams (and no
  waits): what a graph with side branches costs, against one with the same nodes in a line;
* ``timed``: each copy between two timing events (external, recorded into the graph), as
  the runtime times a captured step's copies (``PlanRunner.captured_copy_rates``).

    python -m experiments.join_cost --swaps 0,16,48 --group 1,4,16 --forks each,once --timed 0,1
    python -m experiments.join_cost --swaps 0,1,16 --group 1 --side copy,kernel,inline --mib 0.01

With ``--models`` it captures real training steps instead (forward, backward, Adam;
``tensile.graph.GraphStep``, as the ``graph`` method) and adds one ``side`` operation with a
wait right after a middle module's forward: does a single mid-graph wait slow the whole
step, as it slows the chain?

    python -m experiments.join_cost --models resnet50,inception_v4 --batch 16 --side copy,kernel,inline

Rows go to ``<results>/<gpu>/join_cost.csv`` (``join_cost_training.csv`` with ``--models``)
with the environment; ``per_wait_us`` is the step
time over the same chain's copies without waits, per wait the compute stream makes. Needs CUDA.
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from nimble.cudagraph import capture_graph

from .cli import int_list, model_list
from .env import environment, gpu_slug, host_load
from .store import append_table_row
from .timing import measure

__all__ = ["JOINS", "ChainSpec", "capture_chain", "measure_chain", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
JOINS = ("none", "release", "use", "both")
FORKS = ("each", "once")
SIDES = ("copy", "kernel", "inline")
SPACING, DELAY = 8, 20   # ops between copies, ops from a group's last copy to its wait


@dataclass(frozen=True)
class ChainSpec:
    """One chain: ``kernels`` products of ``dim`` x ``dim`` fp32 matrices on the compute
    stream, ``swaps`` copies of ``nbytes`` each out and back in, waited on as ``joins`` says,
    ``group`` swaps to a wait, the copy streams forked before each copy or ``once``, each copy
    between timing events if ``timed``; ``side``: copies on side streams, kernels there
    instead, or copies on the compute stream."""
    kernels: int = 1000
    dim: int = 640
    swaps: int = 16
    nbytes: int = 2 << 20
    joins: str = "both"
    group: int = 1
    timed: bool = False
    forks: str = "each"
    side: str = "copy"

    def __post_init__(self) -> None:
        if self.joins not in JOINS:
            raise ValueError(f"joins must be one of {JOINS}, got {self.joins!r}")
        if self.forks not in FORKS:
            raise ValueError(f"forks must be one of {FORKS}, got {self.forks!r}")
        if self.side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {self.side!r}")
        if self.side == "inline" and self.joins != "none":
            raise ValueError(f"side=inline has no side streams to wait for: joins must be "
                             f"'none', got {self.joins!r}")
        if self.kernels < 40 or self.dim < 1 or self.nbytes < 1 or self.group < 1 or self.swaps < 0:
            raise ValueError(f"need kernels >= 40 and dim, nbytes, group >= 1, swaps >= 0: {self}")
        if self.swaps and self.swaps % self.group:
            raise ValueError(f"swaps ({self.swaps}) must be a multiple of group ({self.group})")
        if 10 + SPACING * self.swaps + DELAY >= self.kernels // 2:
            raise ValueError(f"{self.swaps} swaps need more than {self.kernels} kernels "
                             f"({SPACING} ops apart, within each half)")

    def positions(self) -> list[tuple[int, int, int, int]]:
        """Per swap: (copy-out after op, release at op, copy-in after op, use at op). Outs
        ``SPACING`` ops apart from op 10, the group's release ``DELAY`` ops after its last
        out; copy-ins alike from the second half on, the group's use ``DELAY`` ops after its
        last copy-in: each copy is done long before its wait, as a plan places them."""
        half, out = self.kernels // 2, []
        for s in range(self.swaps):
            last = (s // self.group + 1) * self.group - 1   # the group's last swap
            out.append((10 + SPACING * s, 10 + SPACING * last + DELAY,
                        half + SPACING * s, half + SPACING * last + DELAY))
        return out


@contextlib.contextmanager
def _timed(timed: bool, stream: torch.cuda.Stream, keep: list) -> Iterator[None]:
    """Around a captured copy, timing events as the runtime records them (or nothing). The
    events go into ``keep``: the graph records them on every replay, so they must outlive it."""
    if not timed:
        yield
        return
    start, end = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
    keep += [start, end]
    start.record(stream)
    yield
    end.record(stream)


def _move(side: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    """One swap's copy on the current stream, or (``side=kernel``) a kernel of about the
    same launch instead: the device tensor of the two times one, in place."""
    if side == "kernel":
        (src if src.is_cuda else dst).mul_(1.0)
    else:
        dst.copy_(src, non_blocking=True)


def capture_chain(spec: ChainSpec) -> torch.cuda.CUDAGraph:
    """The chain of ``spec`` captured into one CUDA graph (its tensors kept alive by it)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(spec.dim, spec.dim, device=dev, generator=gen) / spec.dim ** 0.5
    x = torch.randn(spec.dim, spec.dim, device=dev, generator=gen)
    src = [torch.randn(spec.nbytes // 4, device=dev, generator=gen) for _ in range(spec.swaps)]
    host = [torch.empty(spec.nbytes // 4, pin_memory=True) for _ in range(spec.swaps)]
    back = [torch.empty_like(t) for t in src]
    d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
    by_op: dict[int, list[tuple[str, int]]] = {}
    for s, (o, r, i, u) in enumerate(spec.positions()):
        for op, what in ((o, "out"), (r, "release"), (i, "in"), (u, "use")):
            by_op.setdefault(op, []).append((what, s))
    side = torch.cuda.Stream()   # cuBLAS makes its handle on first use, which a capture refuses
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.mm(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    outs, ins, timing = {}, {}, []
    with capture_graph(graph):
        compute = torch.cuda.current_stream()
        if spec.side == "inline":
            d2h = h2d = compute    # the copies in line with the chain: no forks, no waits
        elif spec.forks == "once" and spec.swaps:
            d2h.wait_stream(compute)
            h2d.wait_stream(compute)
        a, b = x, torch.empty_like(x)
        for k in range(spec.kernels):
            torch.mm(a, w, out=b)
            a, b = b, a
            waits = {"d2h": None, "h2d": None}   # the latest event due here, per stream
            for what, s in by_op.get(k, []):
                if what == "out":
                    if spec.forks == "each" and d2h is not compute:
                        d2h.wait_stream(compute)
                    with torch.cuda.stream(d2h), _timed(spec.timed, d2h, timing):
                        _move(spec.side, host[s], src[s])
                    outs[s] = torch.cuda.Event()
                    outs[s].record(d2h)
                elif what == "in":
                    if spec.forks == "each" and h2d is not compute:
                        h2d.wait_stream(compute)
                    h2d.wait_event(outs[s])
                    with torch.cuda.stream(h2d), _timed(spec.timed, h2d, timing):
                        _move(spec.side, back[s], host[s])
                    ins[s] = torch.cuda.Event()
                    ins[s].record(h2d)
                elif what == "release" and spec.joins in ("release", "both"):
                    waits["d2h"] = outs[s]
                elif what == "use" and spec.joins in ("use", "both"):
                    waits["h2d"] = ins[s]
            for event in waits.values():
                if event is not None:
                    compute.wait_event(event)
        if spec.swaps and spec.side != "inline":   # a capture ends with its side streams joined
            compute.wait_stream(d2h)
            compute.wait_stream(h2d)
    graph._keep = (w, x, src, host, back, timing)   # what the graph reads, writes, records
    return graph


def measure_chain(spec: ChainSpec, *, warmup: int = 10, iters: int = 100) -> dict:
    """Time one replay of ``spec``'s graph; the row of :func:`main` (without per-wait cost)."""
    graph = capture_chain(spec)
    timing = measure(graph.replay, (), warmup=warmup, iters=iters)
    groups = spec.swaps // spec.group
    waits = groups * {"none": 0, "release": 1, "use": 1, "both": 2}[spec.joins]
    return {"kernels": spec.kernels, "dim": spec.dim, "swaps": spec.swaps, "nbytes": spec.nbytes,
            "joins": spec.joins, "group": spec.group, "timed": spec.timed, "forks": spec.forks,
            "side": spec.side,
            "waits": waits,
            "median_ms": timing.median_ms, "p10_ms": timing.p10_ms, "p90_ms": timing.p90_ms,
            "warmup": warmup, "iters": iters}


def measure_training(name: str, batch_size: int, sides: list[str], *, warmup: int = 10,
                     iters: int = 100) -> list[dict]:
    """Time ``name``'s captured training step (Adam, random 1000-class labels) as it is and
    with one tiny side operation (``sides``: copy, kernel, inline) and a wait for it after
    its middle module; one row per variant, all in this process on one model."""
    from torch.nn import functional as F
    from tensile.graph import GraphStep
    from tensile.step import training_step
    from .models import build_model, example_input

    model = build_model(name).cuda().train()
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    batch = (example_input(name, batch_size, "cuda"),
             torch.randint(0, 1000, (batch_size,), device="cuda"))
    modules = [m for m in model.modules() if not list(m.children())]
    middle = modules[len(modules) // 2]
    small = torch.ones(1024, device="cuda")
    host = torch.empty(1024, pin_memory=True)
    side_stream, now = torch.cuda.Stream(), {"side": "none"}

    def hook(_m, _inp, _out):   # one side operation, and a wait for it, mid-forward
        side, compute = now["side"], torch.cuda.current_stream()
        if side == "inline":
            _move("copy", host, small)
        elif side != "none":
            side_stream.wait_stream(compute)
            with torch.cuda.stream(side_stream):
                _move(side, host, small)
            compute.wait_stream(side_stream)

    handle = middle.register_forward_hook(hook)
    rows = []
    try:
        for side in ["none"] + [x for x in sides if x != "none"]:
            now["side"] = side
            step = GraphStep(lambda b, capturing: training_step(model, opt, b, F.cross_entropy),
                             batch, model, opt)
            timing = measure(step, batch, warmup=warmup, iters=iters)
            rows.append({"model": name, "batch_size": batch_size, "side": side,
                         "waits": int(side not in ("none", "inline")), "median_ms": timing.median_ms,
                         "p10_ms": timing.p10_ms, "p90_ms": timing.p90_ms,
                         "warmup": warmup, "iters": iters})
            del step
    finally:
        handle.remove()
    return rows


def _choices(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated list of ``allowed`` names."""
    def parse(text: str) -> list[str]:
        got = text.split(",")
        if not set(got) <= set(allowed):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {allowed}, "
                                             f"got {text!r}")
        return got
    return parse


def _chain_specs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[ChainSpec]:
    """The chains the arguments ask for (the one without swaps first); a setting no chain
    can have is a usage error."""
    if not set(args.timed) <= {0, 1}:
        parser.error(f"--timed: expected 0, 1 or 0,1, got {args.timed}")
    nbytes = int(args.mib * (1 << 20)) // 4 * 4
    try:
        specs = [ChainSpec(args.kernels, args.dim, 0, nbytes, "none", 1)]
        specs += [ChainSpec(args.kernels, args.dim, s, nbytes, j, g, bool(t), f, side)
                  for side in args.side for f in args.forks for t in args.timed for s in args.swaps
                  if s for g in args.group if s % g == 0 for j in JOINS
                  if not (j == "none" and g > 1)            # no waits: groups change nothing
                  and not (side == "inline" and (j != "none" or f != "each"))]   # nothing to wait for
    except ValueError as e:
        parser.error(str(e))
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swaps", type=int_list, default=[0, 16, 48], help="numbers of swaps")
    parser.add_argument("--group", type=int_list, default=[1, 4, 16], help="swaps per wait")
    parser.add_argument("--timed", type=int_list, default=[0], help="copies between timing events: 0, 1 or 0,1")
    parser.add_argument("--forks", type=_choices(FORKS), default=["each"], help="each, once or each,once")
    parser.add_argument("--side", type=_choices(SIDES), default=["copy"],
                        help="copy, kernel, inline (comma-separated)")
    parser.add_argument("--kernels", type=int, default=1000, help="matrix products in the chain")
    parser.add_argument("--dim", type=int, default=640, help="their matrices' side")
    parser.add_argument("--mib", type=float, default=2.0, help="MiB per swapped tensor")
    parser.add_argument("--models", type=model_list, default=None,
                        help="training steps of these models instead of the chain")
    parser.add_argument("--batch", type=int, default=16, help="their batch size")
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="results folder")
    parser.add_argument("--iters", type=int, default=100, help="timed replays (>= 100 for the protocol)")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.batch < 1:
        parser.error(f"--iters and --batch must be >= 1, got {args.iters} and {args.batch}")
    specs = [] if args.models else _chain_specs(args, parser)   # said before anything runs
    if not torch.cuda.is_available():
        parser.error("this experiment captures CUDA graphs: no CUDA device is available here")
    out = Path(args.results) / gpu_slug() / "join_cost.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**environment("cuda"), **host_load()}
    if args.models:
        out = out.with_name("join_cost_training.csv")
        for name in tqdm(args.models, desc="join_cost", unit="model"):
            rows = measure_training(name, args.batch, args.side, iters=args.iters)
            for row in rows:
                row["extra_ms"] = row["median_ms"] - rows[0]["median_ms"]
                append_table_row(out, {**row, **env})
                print(f"{name} b{args.batch} side={row['side']:6s}: {row['median_ms']:.3f} ms "
                      f"(p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f}), "
                      f"{row['extra_ms']:+.3f} ms", flush=True)
        return 0
    free = {}   # the step without waits, per setting: measured before those with waits
    for spec in tqdm(specs, desc="join_cost", unit="chain"):
        row = measure_chain(spec, iters=args.iters)
        if row["joins"] == "none":
            free[spec] = row["median_ms"]
        extra = row["median_ms"] - free[replace(spec, joins="none", group=1)]
        row["per_wait_us"] = extra * 1e3 / row["waits"] if row["waits"] else None
        append_table_row(out, {**row, **env})
        print(f"{row['swaps']:3d} swaps, joins={row['joins']:7s} group={row['group']:2d} "
              f"timed={int(row['timed'])} forks={row['forks']} side={row['side']}: "
              f"{row['median_ms']:.3f} ms (p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f})"
              + (f", {row['per_wait_us']:.1f} us per wait" if row["waits"] else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
