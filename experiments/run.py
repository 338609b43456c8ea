"""The benchmark app: one job measures one model at one batch size on a list of backends.

    python -m experiments.run model=inception_v3 backend=nimble batch_size=1
    python -m experiments.run -m model=glob(*) backend=eager,nimble batch_size=1,32
    python -m experiments.run +sweep=paper_inference            # a paper figure (conf/sweep/)

All variation lives in ``conf/`` (groups model, backend, experiment, timing, device). A job builds
the model once and measures every backend in ``backends`` (default: the ``backend`` group's) on
a fresh copy of it, so backends are compared within one process. Every finished measurement is
appended at once to ``<results_dir>/<gpu>/<experiment>.csv`` (:mod:`experiments.store`); rows
already there are skipped unless ``redo=true``. A backend that is missing or fails becomes a row
with status ``unavailable`` / ``error`` and a reason; a bad config stops before anything is built.
"""
from __future__ import annotations

import copy
import fcntl
import gc
import importlib
import importlib.util
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.env import environment, gpu_slug, host_load
from experiments.limit import cached_step_limit
from experiments.optim import make_optimizer
from experiments.store import ResultStore, row_key
from experiments.timing import allocated_mb, measure, peak_memory
from experiments.watchdog import stop_if_stuck
from nimble.allocator import allocator_environment

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
EXPERIMENTS = ("inference", "training", "tensile")
TRAINING_MODES = ("fwd-bwd", "whole-step")
TRAINING_OPTIMIZERS = ("sgd", "adam")   # experiment=training (experiments.optim has more)


class ConfigError(ValueError):
    """A configuration that cannot run; raised before anything is built."""


# --------------------------------------------------------------------------- registries
# Imported when first needed (the model zoo pulls in timm), behind two functions that the tests
# replace with a tiny model and fake backends.

# One id per process, stored in every row's ``extra.run_id``: rows with the same id were measured
# in one process, which the report uses to pair each backend with its own eager row.
RUN_ID = uuid.uuid4().hex[:12]


def _models():
    return importlib.import_module("experiments.models")


def _tensile_run():
    """The runner of experiment=tensile (:mod:`experiments.tensile_run`)."""
    return importlib.import_module("experiments.tensile_run")


def _backends():
    """The backend registry (``baselines``: BACKENDS, get_backend, try_prepare)."""
    registry = importlib.import_module("baselines")  # importing it registers the baseline adapters
    if importlib.util.find_spec("baselines.nimble_backend"):  # "nimble" and "nimble-single"
        importlib.import_module("baselines.nimble_backend")
    return registry


# --------------------------------------------------------------------------- validation

def validate_model_and_batch(cfg: DictConfig, models: dict) -> None:
    """The checks every experiment shares: a known model, a positive integer batch size and
    an input side the model runs at."""
    if cfg.model.name not in models:
        raise ConfigError(f"unknown model {cfg.model.name!r}; valid: {', '.join(models)}")
    batch = cfg.batch_size
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        raise ConfigError(f"batch_size must be a positive integer, got {batch!r}")
    size = cfg.experiment.get("image_size") or cfg.model.image_size
    try:
        _models().check_image_size(cfg.model.name, size)
    except ValueError as e:
        raise ConfigError(f"{e} (experiment.image_size)") from None


def validate(cfg: DictConfig) -> None:
    """Fail fast, naming the valid choices, before any model or backend is built."""
    exp = cfg.experiment.name
    if exp == "tensile":  # methods instead of backends: its own checks
        _tensile_run().validate(cfg, _models().MODELS)
        return
    if exp not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {exp!r}; valid: {', '.join(EXPERIMENTS)}")
    if exp == "training":
        if cfg.experiment.mode not in TRAINING_MODES:
            raise ConfigError(f"experiment.mode={cfg.experiment.mode!r}; valid: {', '.join(TRAINING_MODES)}")
        if cfg.experiment.optimizer not in TRAINING_OPTIMIZERS:
            raise ConfigError(f"experiment.optimizer={cfg.experiment.optimizer!r}; "
                              f"valid: {', '.join(TRAINING_OPTIMIZERS)}")
    validate_model_and_batch(cfg, _models().MODELS)
    names = list(cfg.backends or [])
    if not names:
        raise ConfigError("backends is empty; give at least one, e.g. backends=[eager]")
    registry = _backends().BACKENDS
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ConfigError(f"unknown backend(s) {unknown}; valid: {', '.join(sorted(registry))}")
    if len(set(names)) != len(names):
        raise ConfigError(f"backends lists a backend twice: {names}")
    for n in names:  # a backend's own options (backend_options.<name>) are checked here
        try:
            _backends().get_backend(n, **backend_options(cfg, n))
        except ValueError as e:
            raise ConfigError(f"backend {n}: {e}") from None
    if cfg.timing.iters < 1 or cfg.timing.warmup < 0:
        raise ConfigError(f"timing needs iters >= 1 and warmup >= 0, got {dict(cfg.timing)}")
    limit = cfg.get("backend_timeout_s")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not limit > 0):
        raise ConfigError(f"backend_timeout_s must be a number of seconds > 0, or null for no "
                          f"limit; got {limit!r}")
    device = cfg.device.name
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"unknown device {device!r}; valid: cuda, cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda, but this host has no usable CUDA GPU "
                          "(torch.cuda.is_available() is False); run on the CPU with device=cpu "
                          "(and timing=quick for a smoke run)")


# --------------------------------------------------------------------------- device set-up

_GPU_CLAIM: tuple[int, int] | None = None  # (lock fd, GPU index), held for the process's life


def claim_gpu(n_gpus: int, lock_dir: Path) -> int:
    """Make this process use one of ``n_gpus`` GPUs that no other worker holds; returns its index.

    For ``hydra/launcher=joblib`` with ``n_jobs`` = number of GPUs: joblib reuses worker processes
    and CUDA cannot change device once initialised, so "GPU = job number % n" would put two jobs on
    one GPU when jobs finish out of order. Instead each worker takes the first free lock file
    ``gpu<k>.lock`` (an flock the OS releases when the worker dies) and keeps that GPU, by setting
    ``CUDA_VISIBLE_DEVICES`` before CUDA is initialised.
    """
    global _GPU_CLAIM
    if _GPU_CLAIM is not None:
        return _GPU_CLAIM[1]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_initialized():  # (is_available() alone also fixes the device list: call us first)
        raise RuntimeError("claim_gpu called after CUDA was initialised in this process")
    ids = visible.split(",") if visible else [str(i) for i in range(n_gpus)]
    if len(ids) < n_gpus:
        raise ConfigError(f"device.gpus={n_gpus} but CUDA_VISIBLE_DEVICES lists only {ids}")
    lock_dir.mkdir(parents=True, exist_ok=True)
    for k in range(n_gpus):
        fd = os.open(lock_dir / f"gpu{k}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _GPU_CLAIM = (fd, k)
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[k]
        return k
    raise RuntimeError(f"all {n_gpus} GPUs are claimed by other workers: use hydra.launcher.n_jobs "
                       f"<= device.gpus ({n_gpus})")


# Set in the environment of a command restarted under another allocator (choose_allocator).
RESTARTED_FOR_ALLOCATOR = "SUITE_RESTARTED_FOR_ALLOCATOR"
# The process that ran ``main`` first: a launcher's worker processes must not restart themselves.
MAIN_PID = "SUITE_MAIN_PID"


def choose_allocator(cfg: DictConfig) -> str | None:
    """Make sure this process runs the CUDA allocator ``device.allocator``; returns it (None on CPU).

    PyTorch picks its allocator when ``torch`` is imported, so a process cannot switch. If the
    command was started under another one, it is started again, the same command line under
    the asked allocator (rows already stored are skipped, so a sweep goes on where it was).
    That is refused with a ConfigError where a restart could not work: CUDA already started
    here, a launcher's worker process, or a restart that still runs the other allocator.
    """
    if cfg.device.name != "cuda":
        return None
    allocator = str(cfg.device.get("allocator") or "native")
    try:
        env = allocator_environment(allocator)
    except ValueError as e:
        raise ConfigError(f"device.allocator: {e}") from None
    running = torch.cuda.get_allocator_backend()
    if running == allocator:
        return allocator
    why = ("it was restarted for that already" if os.environ.get(RESTARTED_FOR_ALLOCATOR)
           else "CUDA has started here" if torch.cuda.is_initialized()
           else "this is a launcher's worker process" if os.environ.get(MAIN_PID) != str(os.getpid())
           else None)
    if why:
        raise ConfigError(f"device.allocator={allocator}, but this process runs PyTorch's {running!r} "
                          f"allocator and cannot be restarted ({why}): start the command with "
                          f"PYTORCH_ALLOC_CONF=backend:{allocator}")
    log.warning("device.allocator=%s: starting this command again under that allocator "
                "(PyTorch picks it when torch is imported)", allocator)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {**env, RESTARTED_FOR_ALLOCATOR: allocator})


def apply_device_settings(cfg: DictConfig) -> str:
    """Set the numerics switches the config asks for (they are recorded in every row)."""
    dev = cfg.device
    torch.backends.cudnn.benchmark = bool(dev.cudnn_benchmark)
    torch.backends.cuda.matmul.allow_tf32 = bool(dev.tf32_matmul)
    torch.backends.cudnn.allow_tf32 = bool(dev.tf32_cudnn)
    if dev.get("threads"):
        torch.set_num_threads(int(dev.threads))
    return dev.name


# --------------------------------------------------------------------------- helpers

def _flat_tensors(out: Any) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def output_error(ref: Any, out: Any) -> float:
    """Largest relative deviation ``max|out - ref| / max|ref|`` over all output tensors.

    ``inf`` when the outputs do not have the same structure or shapes: a backend that returns
    something else is wrong, not slightly off.
    """
    a, b = _flat_tensors(ref), _flat_tensors(out)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.detach().float().cpu(), y.detach().float().cpu()
        scale = x.abs().max().item() or 1.0
        worst = max(worst, (y - x).abs().max().item() / scale)
    return worst


def _logits(out: Any) -> torch.Tensor:
    """The main output of a classifier (Inception's train-mode output is (logits, aux))."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def _extra_of(fn: Any) -> dict:
    """Backend-specific metrics a prepared callable exposes as ``fn.extra`` (a dict, e.g. Nimble's
    streams and syncs); they go into the row's ``extra`` JSON, never over a measured column."""
    extra = getattr(fn, "extra", None)
    return dict(extra) if isinstance(extra, dict) else {}


def _analysis_of(fn: Any, median_ms: float) -> dict:
    """Metrics a backend computes after timing, via ``fn.analyze(median_ms) -> dict`` (Nimble:
    the critical-path kernel time, the distance to the limit). A failure is noted, not raised."""
    analyze = getattr(fn, "analyze", None)
    if not callable(analyze):
        return {}
    try:
        return dict(analyze(median_ms))
    except Exception as e:  # noqa: BLE001 - an analysis must never sink a measured row
        return {"analysis_error": f"{type(e).__name__}: {e}"[:200]}


def _release(device: str) -> None:
    gc.collect()
    if "torch._dynamo" in sys.modules:  # compiled backends: drop caches between backends
        torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def write_trace(fn: Callable, inputs: tuple, path: Path, steps: int = 3) -> None:
    """A torch.profiler chrome trace of ``steps`` calls (the report draws one row per stream)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn(*inputs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


# --------------------------------------------------------------------------- one measurement

def _optimizer(model: torch.nn.Module, cfg: DictConfig, capturable: bool = False) -> torch.optim.Optimizer:
    """The configured optimizer; ``capturable`` Adam keeps its step count on the GPU."""
    exp = cfg.experiment
    return make_optimizer(model, exp.optimizer, exp.lr, exp.momentum, capturable)


def _step_limit(model: torch.nn.Module, inputs: tuple, cfg: DictConfig, median_ms: float) -> dict:
    """The training step's limit beside a row's median (:func:`experiments.limit.cached_step_limit`):
    once per model, batch and optimizer in a process."""
    key = (cfg.model.name, cfg.batch_size, cfg.experiment.optimizer, str(inputs[0].device))
    return cached_step_limit(key, model, lambda m: _optimizer(m, cfg, capturable=True), inputs,
                             _loss, median_ms)


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(out), y)


def _training_step(model: torch.nn.Module, forward: Callable, cfg: DictConfig) -> Callable:
    """The paper's training iteration around ``forward``: zero_grad, loss, backward, step."""
    opt = _optimizer(model, cfg)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # set_to_none=False keeps .grad at fixed addresses, which captured backward graphs need.
        opt.zero_grad(set_to_none=False)
        loss = _loss(forward(x), y)
        loss.backward()
        opt.step()
        return loss
    step.extra = _extra_of(forward)  # the backend's metrics (Nimble's streams, memory) stay on the row
    return step


def backend_options(cfg: DictConfig, name: str) -> dict[str, Any]:
    """The options of backend ``name`` from ``cfg.backend_options`` (none: ``{}``)."""
    options = (cfg.get("backend_options") or {}).get(name) or {}
    return dict(OmegaConf.to_container(options, resolve=True)) if isinstance(options, DictConfig) else dict(options)


def measure_backend(name: str, model: torch.nn.Module, inputs: tuple, cfg: DictConfig,
                    device: str, reference: Any, out_dir: Path) -> dict[str, Any]:
    """Prepare ``name`` on a copy of ``model`` and time it; returns the row's measured fields."""
    base = _backends()
    backend = base.get_backend(name, **backend_options(cfg, name))
    training = cfg.experiment.name == "training"
    fields: dict[str, Any] = {"backend_version": ""}
    if training and not getattr(backend, "supports_training", False):
        return {**fields, "status": "unavailable", "reason": f"backend {name} does not support training"}

    original, model = model, copy.deepcopy(model)
    model._suite_name = cfg.model.name  # the TVM adapter finds prebuilt artifacts by it
    if training:
        model.train()
        for p in model.parameters():  # fixed gradient buffers before any capture
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    gc.collect()  # so frees of earlier objects do not land inside the prepare window
    before_mb = allocated_mb(device)
    whole_step = training and cfg.experiment.mode == "whole-step"
    if whole_step and name != "eager":
        prepare_step = getattr(backend, "prepare_step", None)
        if prepare_step is None:
            return {**fields, "status": "unavailable",
                    "reason": f"backend {name} has no whole-step capture (prepare_step)"}
        t0 = time.perf_counter()
        try:   # backend.prepare_step(model, (x, y), loss_fn, optimizer) -> step(x, y) -> loss
            fn = prepare_step(model, inputs, _loss, _optimizer(model, cfg, capturable=True))
        except Exception as e:  # noqa: BLE001 - a failing backend is a row, not a crash
            return {**fields, "status": "error", "reason": f"{type(e).__name__}: {e}"[:400],
                    "prepare_s": time.perf_counter() - t0}
        fields.update(prepare_s=time.perf_counter() - t0, backend_version=backend.version())
    else:
        prep_inputs = inputs[:1] if training else inputs  # training inputs are (x, y)
        with torch.set_grad_enabled(training):
            res = base.try_prepare(backend, model, prep_inputs, device, training=training)
        fields.update(prepare_s=res.prepare_s, backend_version=res.version or "")
        if res.status != "ok":
            return {**fields, "status": res.status, "reason": res.reason}
        fn = _training_step(model, res.fn, cfg) if training else res.fn
    gc.collect()
    held_mb = allocated_mb(device) - before_mb  # what the prepared callable holds
    # Below zero, the prepare freed memory that was held before it (seen with Inductor's
    # CUDA-graph modes): the difference is no size of the callable's memory, so not stored.
    fields["graph_mem_mb"] = held_mb if not held_mb < 0 else math.nan

    with torch.set_grad_enabled(training):
        extra = _extra_of(fn)
        fields["extra"] = extra
        if held_mb < 0:
            extra["graph_mem_note"] = (f"allocated memory fell by {-held_mb:.1f} MiB during "
                                       "prepare: not a size of the prepared callable's memory")
        if reference is not None and not training:
            err = output_error(reference, fn(*inputs))
            extra["max_rel_err"] = err
            if not err <= cfg.experiment.check_tol:
                return {**fields, "status": "error",
                        "reason": f"output differs from eager: max relative error {err:.3g} > "
                                  f"check_tol {cfg.experiment.check_tol}"}
        t = measure(fn, inputs, warmup=cfg.timing.warmup, iters=cfg.timing.iters, device=device)
        extra.update(host_load())
        peak = peak_memory(fn, inputs, device)
        extra.update(_analysis_of(fn, t.median_ms))
        if training and name.startswith("nimble"):
            extra.update(_step_limit(original, inputs, cfg, t.median_ms))
        if cfg.trace and device == "cuda":
            write_trace(fn, inputs, out_dir / f"trace_{cfg.model.name}_{name}.json")
    ms = lambda v: round(v, 4)  # noqa: E731 - 0.1 us, below CUDA event resolution
    return {**fields, "status": "ok", "reason": "",
            "median_ms": ms(t.median_ms), "p10_ms": ms(t.p10_ms), "p90_ms": ms(t.p90_ms),
            "mean_ms": ms(t.mean_ms), "std_ms": ms(t.std_ms), "wall_ms": ms(t.wall_ms),
            "peak_mem_mb": round(peak, 1), "graph_mem_mb": round(fields["graph_mem_mb"], 1),
            "prepare_s": round(fields["prepare_s"], 3)}


def run_config(cfg: DictConfig, on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Run one job: validate, then measure each backend not yet stored; returns the rows written.

    ``on_row`` is called with each row as it is stored (the CLI prints one line per row).
    """
    if cfg.device.name == "cuda" and cfg.device.get("gpus"):
        # Before anything asks CUDA a question: CUDA_VISIBLE_DEVICES is read once, at driver init.
        claim_gpu(int(cfg.device.gpus), Path(hydra.utils.to_absolute_path(cfg.results_dir)) / ".gpu-locks")
    choose_allocator(cfg)
    validate(cfg)
    device = apply_device_settings(cfg)
    env = environment(device)
    exp = cfg.experiment
    out_dir = Path(hydra.utils.to_absolute_path(cfg.results_dir)) / gpu_slug(str(env["gpu"]))
    if exp.name == "tensile":
        return _tensile_run().run(cfg, _models(), device, env, out_dir, on_row)
    store = ResultStore(out_dir / f"{exp.name}.csv")
    common = {"experiment": exp.name, "mode": exp.mode, "model": cfg.model.name,
              "batch_size": cfg.batch_size, "warmup": cfg.timing.warmup, "iters": cfg.timing.iters,
              "run_id": RUN_ID}  # not a column: the store files it under extra
    done = store.done_keys(redo=cfg.redo, min_iters=cfg.timing.iters)
    todo = [b for b in cfg.backends if row_key({**common, **env, "backend": b}) not in done]
    skipped = [b for b in cfg.backends if b not in todo]
    if skipped:
        log.info("already measured (redo=true to measure again): %s %s b=%s", cfg.model.name,
                 ",".join(skipped), cfg.batch_size)
    if not todo:
        return []

    m = _models()
    model = m.build_model(cfg.model.name, num_classes=exp.num_classes or cfg.model.num_classes).to(device)
    x = m.example_input(cfg.model.name, cfg.batch_size, device,
                        image_size=exp.image_size or cfg.model.image_size)
    if exp.name == "training":
        y = torch.randint(0, exp.num_classes, (cfg.batch_size,), generator=torch.Generator().manual_seed(0))
        inputs: tuple = (x, y.to(device))
        reference = None
    else:
        inputs = (x,)
        reference = None
        if exp.check_tol is not None:
            with torch.no_grad():
                reference = model(x)

    rows = []
    for name in todo:
        stuck_row = lambda reason, name=name: store.append(  # noqa: E731
            {**env, **common, "backend": name, "status": "error", "reason": reason})
        try:
            with stop_if_stuck(cfg.get("backend_timeout_s"), stuck_row,
                               what=f"{name} on {cfg.model.name} b={cfg.batch_size}"):
                fields = measure_backend(name, model, inputs, cfg, device, reference, out_dir)
        except Exception as exc:  # noqa: BLE001 - a failing backend is a row, never a crash
            log.exception("%s on %s failed", name, cfg.model.name)
            fields = {"status": "error", "reason": _one_line(exc)}
        _release(device)
        row = store.append({**env, **common, **fields, "backend": name})
        rows.append(row)
        on_row(row)
    return rows


# --------------------------------------------------------------------------- CLI

def format_row(row: dict) -> str:
    """One line per measurement: model, backend, batch, median, p10/p90, status."""
    head = f"{row['model']:<16} {row['backend']:<22} b={row['batch_size']:<4}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['reason']}"
    f = lambda k: float(row[k])  # noqa: E731
    return (f"{head} median {f('median_ms'):8.3f} ms  p10/p90 {f('p10_ms'):.3f}/{f('p90_ms'):.3f}"
            f"  prepare {f('prepare_s'):.1f} s  ok")


def sweep_size(hc: Any, argv: list[str] | None = None) -> int | None:
    """Number of jobs of the running multirun, computed as Hydra's basic sweeper does; None if unknown.

    Combines ``hydra.sweeper.params`` with the command-line overrides (later wins per key).
    """
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra._internal.utils import create_config_search_path, get_args_parser
        from hydra.core.override_parser.overrides_parser import OverridesParser

        args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
        params = [f"{k}={v}" for k, v in (hc.sweeper.params or {}).items()]
        loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(params + args.overrides)
        return len(BasicSweeper.split_arguments(overrides, None)[0])
    except Exception:  # noqa: BLE001 - the bar then just counts without a total
        return None


_BAR: tqdm | None = None


def _progress_bar() -> tqdm | None:
    """One bar over a multirun run by the basic launcher (jobs run one after another here)."""
    global _BAR
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or "BasicLauncher" not in str(hc.launcher.get("_target_", "")):
        return None
    if _BAR is None:
        _BAR = tqdm(total=sweep_size(hc), desc="sweep", unit="job", dynamic_ncols=True)
    return _BAR


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point; see the module docstring."""
    bar = _progress_bar()
    try:
        run_config(cfg, on_row=lambda row: tqdm.write(format_row(row)))
    except ConfigError as exc:
        # A config error is the user's to fix: a message, not a traceback; stop the whole sweep.
        if bar is not None:
            bar.close()
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if bar is not None:
        bar.set_postfix_str(f"{cfg.model.name} b={cfg.batch_size}")
        bar.update(1)
        if bar.total is not None and bar.n >= bar.total:
            bar.close()


if __name__ == "__main__":
    # Call the copy imported as experiments.run, not this __main__ module: launchers that run jobs
    # in other processes (joblib, submitit) pickle the task function, and functions of __main__
    # are pickled by value, dragging unpicklable module globals along.
    from experiments.run import MAIN_PID, main as _main
    os.environ[MAIN_PID] = str(os.getpid())   # kept across an allocator restart (same pid)
    _main()
