"""Host cost of the TENSILE runtime per op, measured on the CPU (simulation mode).

    python -m tensile.overhead --model resnet18 --batch 8

The runtime watches a step through hooks and, where it must, a Python dispatch mode
that intercepts ATen ops; on a GPU that host time is what a host-bound model pays on
top of vanilla (TENSILE's extra overhead ratio). The Python side costs the same on a
CPU, so this script times, in one process and on one model:

* ``vanilla``: :func:`tensile.step.training_step` alone;
* ``empty plan``: the runtime with a plan that does nothing (the cost of watching);
* ``real plan``: the runtime with the planner's plan for ``--budget`` (its swaps and
  recomputes are real CPU copies and reruns here: part of its extra time is work);
* ``checked``: the real plan with every op checked under the mode, as on the first
  step after every (re)plan (``PlanRunner.check_every_step``).

The modes take turns on one model for ``--rounds`` rounds of one untimed and
``--steps`` timed steps. Each line gives the median over all timed steps and the extra
time per recorded (counted) op against vanilla's median, then the same for the fastest
step (steadier on a busy machine). Times are the process's CPU time (time the machine
gives other processes does not count); one thread and small inputs (32x32) keep the
compute small and steady so the host cost shows.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .estimate import estimate_op_times
from .plan import Plan
from .planner import plan as make_plan
from .record import record_step
from .runtime import PlanRunner
from .step import training_step

__all__ = ["Timing", "build_job", "measure_overhead", "main"]

_RATES = dict(peak_flops=1e11, peak_bytes_per_s=1e10)  # CPU-ish roofline for the planner
_COPY_BW = 1e10                                          # host memcpy, bytes/s
_MODES = ("vanilla", "empty plan", "real plan", "checked")  # in the order they take turns


@dataclass
class Timing:
    """Median and fastest step time of one mode, and its extra time per counted op."""

    mode: str
    ms_per_step: float  # median
    us_per_op: float    # (median - vanilla's median) / counted ops
    min_ms: float       # the fastest step
    min_us_per_op: float  # (fastest - vanilla's fastest) / counted ops
    detail: str = ""

    def __str__(self) -> str:
        extra = f"  {self.detail}" if self.detail else ""
        return (f"{self.mode:<11} {self.ms_per_step:8.2f} ms/step {self.us_per_op:+6.1f} us/op | "
                f"fastest {self.min_ms:8.2f} ms {self.min_us_per_op:+6.1f} us/op{extra}")


def build_job(model: str, batch: int, size: int = 32, classes: int = 10, seed: int = 0):
    """``(model, optimizer, batch, loss_fn)`` for a torchvision classifier on random data."""
    import torchvision

    torch.manual_seed(seed)
    try:
        net = torchvision.models.get_model(model, num_classes=classes)
    except ValueError as e:
        raise ValueError(f"--model: expected a torchvision model name such as resnet18, "
                         f"resnet50, vgg16, densenet121; got {model!r}") from e
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    data = (torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,)))
    return net, opt, data, nn.functional.cross_entropy


def measure_overhead(net: nn.Module, opt: torch.optim.Optimizer, data: Sequence,
                     loss_fn: Callable | None, *, steps: int = 5, rounds: int = 4,
                     budget: float = 0.5) -> list[Timing]:
    """Vanilla, empty-plan, real-plan and checked step times (see the module docstring).

    The modes take turns on the same model for ``rounds`` rounds of one untimed step
    (the first step after a plan is a checked one) and ``steps`` timed ones, so a slow
    spell of the machine hits all of them alike. ``budget`` is the real plan's budget
    as a fraction of the simulated vanilla peak. The model trains meanwhile.
    """
    if steps < 1 or rounds < 1:
        raise ValueError(f"expected steps >= 1 and rounds >= 1; got {steps}, {rounds}")
    if not 0 < budget <= 1:
        raise ValueError(f"budget is a fraction in (0, 1]; got {budget}")
    for _ in range(2):  # the optimizer state exists from here on: a steady op sequence
        training_step(net, opt, data, loss_fn)
    rec = record_step(net, opt, data, loss_fn)
    n = rec.graph.num_nodes
    timeline = rec.timeline(estimate_op_times(rec.graph, **_RATES))
    peak = int(timeline.vanilla_curve().max())
    real = make_plan(timeline, budget_bytes=max(1, int(budget * peak)), d2h_bw=_COPY_BW,
                     h2d_bw=_COPY_BW, copy_latency_ms=0.0, min_bytes=1)
    empty = Plan(num_ops=n, budget_bytes=None, d2h_bytes_per_s=_COPY_BW, h2d_bytes_per_s=_COPY_BW)
    runner = PlanRunner(rec, net, opt, loss_fn, empty, simulate=True)
    plans = {"empty plan": (empty, False), "real plan": (real, False), "checked": (real, True)}
    times: dict[str, list[float]] = {m: [] for m in _MODES}
    for _ in range(rounds):
        for mode in _MODES:
            if mode == "vanilla":
                step = functools.partial(training_step, net, opt, data, loss_fn)
            else:
                runner.set_plan(plans[mode][0])
                runner.check_every_step = plans[mode][1]
                step = functools.partial(runner.step, data)
            step()
            for _ in range(steps):
                t0 = time.process_time()
                step()
                times[mode].append((time.process_time() - t0) * 1e3)
            runner.set_plan(empty)  # no hooks or host copies left for vanilla
    runner.check_every_step = False
    base, base_min = statistics.median(times["vanilla"]), min(times["vanilla"])
    out = []
    for mode in _MODES:
        ms, fastest = statistics.median(times[mode]), min(times[mode])
        detail = {"vanilla": f"{n} counted ops",
                  "real plan": f"{len(real.swaps)} swaps, {len(real.recomputes)} recomputes"
                  }.get(mode, "")
        out.append(Timing(mode, ms, (ms - base) * 1e3 / n, fastest,
                          (fastest - base_min) * 1e3 / n, detail))
    return out


def main(argv: Sequence[str] | None = None) -> list[Timing]:
    """The command line: build the job, print and return the timings."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18", help="torchvision model name")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=32, help="input height = width")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds in which the modes take turns")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="real plan's budget, fraction of the vanilla peak")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (1: steadiest timings; the host cost is serial)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    net, opt, data, loss_fn = build_job(args.model, args.batch, args.size)
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, CPU, "
          f"{torch.get_num_threads()} thread(s), median of {args.rounds} x {args.steps} steps")
    timings = measure_overhead(net, opt, data, loss_fn, steps=args.steps, rounds=args.rounds,
                               budget=args.budget)
    for t in timings:
        print(t)
    return timings


if __name__ == "__main__":
    main()
