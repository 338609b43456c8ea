"""What a convolution's backward costs when cuDNN may use less workspace.

    python -m experiments.conv_workspace --model vgg16 --batch 16 --caps none,400,200,96,32,0

A TENSILE plan cannot move an op's workspace: it is part of the op. PyTorch has no cap on
cuDNN's (pytorch/pytorch#49207), and cuDNN's own ``CUDNN_CONV_WSCAP_DBG`` is not read on
PyTorch's default (cuDNN v8 API) path. Under ``cudnn.benchmark`` PyTorch times every plan and
runs the fastest whose workspace it can allocate, trying the next when the allocation fails.
This experiment uses that: per cap it runs the layer's first backward in a fresh process
whose caching allocator may reserve only what the layer already holds plus its gradients
and the cap (``torch.cuda.set_per_process_memory_fraction``), lifts the limit, and times the
plan PyTorch kept (CUDA events, warm-up, ``--iters`` calls). The cap bounds new
reservations: room free inside segments already reserved comes on top, so a plan may take
somewhat more, and the plan kept is the first PyTorch could allocate, not always the
fastest of those within the cap. ``workspace_mb`` is the backward's peak above its operands
and the gradients it returns.

By default the layer is the model's conv whose backward takes the most workspace (measured
first, in this process, without a cap); ``--layers`` names others by index. Rows go to
``<results>/<gpu>/conv_workspace.csv``; the report prints them. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .cli import int_list, model_list
from .env import environment, gpu_slug, host_load
from .models import build_model, example_input
from .store import append_table_row
from .timing import measure

REPO_ROOT = Path(__file__).resolve().parent.parent
MB = 2**20


@dataclass(frozen=True)
class ConvLayer:
    """One ``nn.Conv2d`` of a model as its forward called it: enough to rebuild and rerun it."""
    index: int
    name: str
    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    bias: bool
    input_shape: tuple[int, ...]
    input_grad: bool       # whether backward makes the input's gradient (not for the first layer)

    def build(self, device: str) -> tuple[torch.nn.Conv2d, torch.Tensor]:
        """The layer (random weights) and a random input of its shape on ``device``."""
        conv = torch.nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride,
                               self.padding, self.dilation, self.groups, self.bias).to(device)
        x = torch.randn(self.input_shape, device=device, requires_grad=self.input_grad)
        return conv, x


def conv_layers(model: torch.nn.Module, example: torch.Tensor) -> list[ConvLayer]:
    """The ``nn.Conv2d`` layers ``model`` runs on ``example``, in call order (a layer called
    twice is listed twice), found by one forward on the meta device (shapes only). A padding
    given as a string is refused: rebuilt from its numbers, a layer must compute the same."""
    model = model.to("meta").eval()
    names = {m: n for n, m in model.named_modules()}
    found: list[ConvLayer] = []

    def hook(module: torch.nn.Conv2d, args: tuple) -> None:
        if isinstance(module.padding, str):
            raise ValueError(f"{names[module]}: padding={module.padding!r}: expected numbers")
        x = args[0]
        found.append(ConvLayer(len(found), names[module], module.in_channels, module.out_channels,
                               tuple(module.kernel_size), tuple(module.stride),
                               tuple(module.padding), tuple(module.dilation), module.groups,
                               module.bias is not None, tuple(x.shape), bool(x.requires_grad)))
    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if isinstance(m, torch.nn.Conv2d)]
    try:
        model(example.to("meta"))   # the input needs no gradient: the layers fed it make none
    finally:
        for h in handles:
            h.remove()
    return found


def _returned(conv: torch.nn.Conv2d, x: torch.Tensor) -> list[int]:
    """Bytes of each gradient a backward of ``conv`` on ``x`` returns."""
    grads = list(conv.parameters()) + ([x] if x.requires_grad else [])
    return [t.numel() * t.element_size() for t in grads]


def _segment_bytes(nbytes: int) -> int:
    """The most PyTorch's caching allocator reserves anew for one block of ``nbytes``: a 2 MiB
    segment for up to 1 MiB, a 20 MiB one below 10 MiB, else the size in whole 2 MiB."""
    if nbytes <= MB:
        return 2 * MB
    if nbytes < 10 * MB:
        return 20 * MB
    return -(-nbytes // (2 * MB)) * 2 * MB


def measure_layer(layer: ConvLayer, cap_mb: float | None, *, warmup: int = 20,
                  iters: int = 100) -> dict:
    """Time ``layer``'s backward with the plan PyTorch picks when its first backward may
    reserve at most ``cap_mb`` MiB above the operands and what the gradients need (None: no
    cap; the allocator's segments round it, :func:`_segment_bytes`). Run it in a fresh
    process: PyTorch keeps the first plan per shape for the process's life."""
    torch.backends.cudnn.benchmark = True
    conv, x = layer.build("cuda")
    y = conv(x)
    grad_out = torch.randn_like(y)
    returned = _returned(conv, x)
    torch.cuda.synchronize()

    def clear_grads() -> None:
        x.grad = None
        for p in conv.parameters():
            p.grad = None

    def backward() -> None:
        clear_grads()
        y.backward(grad_out, retain_graph=True)

    if cap_mb is not None:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        limit = (torch.cuda.memory_reserved() + sum(map(_segment_bytes, returned))
                 + int(cap_mb * MB))
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
    try:
        backward()     # cuDNN's plans timed; the first, fastest first, whose workspace fits is kept
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as exc:
        return {"status": "error", "reason": f"no plan ran under the cap: {str(exc)[:160]}"}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    clear_grads()
    operands = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    backward()
    torch.cuda.synchronize()
    workspace = torch.cuda.max_memory_allocated() - operands - sum(returned)
    timing = measure(backward, (), warmup=warmup, iters=iters)
    return {"status": "ok", "reason": "", "bwd_median_ms": timing.median_ms,
            "bwd_p10_ms": timing.p10_ms, "bwd_p90_ms": timing.p90_ms,
            "workspace_mb": round(max(workspace, 0) / MB, 1)}


def _measure_in_child(layer: ConvLayer, cap_mb: float | None, iters: int) -> dict:
    """:func:`measure_layer` in a fresh interpreter (its own cuDNN plan cache)."""
    spec = json.dumps({"layer": asdict(layer), "cap_mb": cap_mb, "iters": iters})
    proc = subprocess.run([sys.executable, "-m", "experiments.conv_workspace", "--child", spec],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        return {"status": "error", "reason": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(spec: str) -> None:
    d = json.loads(spec)
    layer = d["layer"]
    for k in ("kernel_size", "stride", "padding", "dilation", "input_shape"):
        layer[k] = tuple(layer[k])
    print(json.dumps(measure_layer(ConvLayer(**layer), d["cap_mb"], iters=d["iters"])))


def parse_caps(text: str) -> list[float | None]:
    """``"none,200,0"`` -> ``[None, 200.0, 0.0]`` (MiB; none: no cap)."""
    caps: list[float | None] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part.lower() == "none":
            caps.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"--caps: expected MiB >= 0 or 'none', got {part!r}")
        caps.append(value)
    if not caps:
        raise argparse.ArgumentTypeError("--caps: expected at least one cap, got none")
    return caps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=model_list, default=["vgg16"],
                        help="a model name (experiments.models)")
    parser.add_argument("--batch", type=int, default=16, help="batch size")
    parser.add_argument("--caps", type=parse_caps, default=parse_caps("none,400,200,96,32,0"),
                        help="workspace caps in MiB, 'none' for no cap")
    parser.add_argument("--layers", type=int_list, default=None,
                        help="conv indices in call order (default: the one with most workspace)")
    parser.add_argument("--iters", type=int, default=100, help="timed calls (>= 100 for the protocol)")
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="results folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    if len(args.model) != 1:
        parser.error(f"--model: expected one model, got {args.model}")
    if not torch.cuda.is_available():
        parser.error("this experiment times cuDNN convolutions: no CUDA device is available here")
    name = args.model[0]
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    layers = conv_layers(build_model(name), example_input(name, args.batch, "cpu"))
    if args.layers is None:
        first = {c.index: measure_layer(c, None, warmup=3, iters=3)
                 for c in tqdm(layers, desc="workspaces", unit="conv")}
        chosen = [max(layers, key=lambda c: first[c.index].get("workspace_mb", -1))]
    else:
        bad = [i for i in args.layers if not 0 <= i < len(layers)]
        if bad:
            parser.error(f"--layers: {name} runs {len(layers)} convs (0-{len(layers) - 1}), got {bad}")
        chosen = [layers[i] for i in args.layers]
    out = Path(args.results) / gpu_slug() / "conv_workspace.csv"
    for layer in chosen:
        for cap in tqdm(args.caps, desc=f"{layer.name} caps", unit="cap"):
            found = _measure_in_child(layer, cap, args.iters)
            row = {"model": name, "batch_size": args.batch, "layer": layer.index,
                   "layer_name": layer.name, "input_shape": "x".join(map(str, layer.input_shape)),
                   "out_channels": layer.out_channels, "cap_mb": "" if cap is None else cap,
                   "status": found["status"], "reason": found.get("reason", ""),
                   "bwd_median_ms": found.get("bwd_median_ms"), "bwd_p10_ms": found.get("bwd_p10_ms"),
                   "bwd_p90_ms": found.get("bwd_p90_ms"), "workspace_mb": found.get("workspace_mb"),
                   "iters": args.iters, **environment("cuda"), **host_load()}
            append_table_row(out, row)
            cap_text = "no cap" if cap is None else f"cap {cap:g} MiB"
            if found["status"] == "ok":
                print(f"{name} b{args.batch} {layer.name} {cap_text}: backward "
                      f"{found['bwd_median_ms']:.3f} ms, workspace {found['workspace_mb']:.1f} MiB",
                      flush=True)
            else:
                print(f"{name} b{args.batch} {layer.name} {cap_text}: {found['reason']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
