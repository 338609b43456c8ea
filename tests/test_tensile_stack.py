"""tensile.stack: the context's thread-stack reservation and trimming it.

On the CPU the CUDA runtime is a fake that keeps the limit as the driver does (the tests
check the arithmetic, the calls and the errors); on a GPU the real one, in a child process
with a fresh context, checks that the memory really goes back and training is unchanged."""
from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import tensile
from tensile import stack
from trim_child import run_trim_child


class FakeRuntime:
    """cudaDeviceGetLimit / cudaDeviceSetLimit on one stack-size limit, as ctypes calls them."""

    def __init__(self, limit: int, fail_set: int = 0) -> None:
        self.limit, self.fail_set, self.calls = limit, fail_set, []

    def cudaDeviceGetLimit(self, pvalue, which):
        self.calls.append(("get", which.value))
        ctypes.cast(pvalue, ctypes.POINTER(ctypes.c_size_t))[0] = self.limit
        return 0

    def cudaDeviceSetLimit(self, which, value):
        self.calls.append(("set", which.value, value.value))
        if self.fail_set:
            return self.fail_set
        self.limit = value.value
        return 0


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device 0 of 132 SMs x 2048 threads (an H200) behind a fake runtime."""
    runtime = FakeRuntime(limit=1024)
    monkeypatch.setattr(stack, "_cudart", lambda: runtime)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: _NoDevice())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(
        multi_processor_count=132, max_threads_per_multi_processor=2048))
    return runtime


class _NoDevice:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_reservation_is_the_stack_size_times_the_threads_the_gpu_holds(fake_gpu):
    r = tensile.stack_reservation()
    assert (r.bytes_per_thread, r.threads) == (1024, 132 * 2048)
    assert r.bytes == 264 * 2**20          # an H200's default: 264 MiB per process
    assert fake_gpu.calls == [("get", stack.CUDA_LIMIT_STACK_SIZE)]


def test_trim_sets_the_limit_to_zero_and_returns_what_it_released(fake_gpu):
    fake_gpu.limit = 160 + 1024   # grown by some kernel beyond the default
    assert tensile.trim_stack("cuda:0") == (160 + 1024) * 132 * 2048
    assert ("set", stack.CUDA_LIMIT_STACK_SIZE, 0) in fake_gpu.calls
    assert tensile.stack_reservation().bytes == 0
    assert tensile.trim_stack() == 0          # nothing left to release


def test_a_failed_call_names_itself_and_the_cuda_error(fake_gpu):
    fake_gpu.fail_set = 1   # cudaErrorInvalidValue
    with pytest.raises(RuntimeError, match=r"cudaDeviceSetLimit\(cudaLimitStackSize, 0\) failed "
                                           r"with CUDA error 1"):
        tensile.trim_stack()
    assert fake_gpu.limit == 1024


def test_refused_inside_a_capture_and_on_other_devices(fake_gpu, monkeypatch):
    with pytest.raises(ValueError, match="expected a CUDA device, got 'cpu'"):
        tensile.trim_stack("cpu")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="outside a CUDA graph capture"):
        tensile.trim_stack()
    assert fake_gpu.limit == 1024 and all(c[0] == "get" for c in fake_gpu.calls)


def test_no_runtime_library_mapped(fake_gpu, monkeypatch):
    monkeypatch.setattr(stack, "_cudart", lambda: None)
    with pytest.raises(RuntimeError, match="no CUDA runtime library"):
        tensile.stack_reservation()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_without_a_gpu_the_error_says_so():
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        tensile.trim_stack()


CHILD = textwrap.dedent("""
    import json, torch, torchvision, tensile
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=10).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(8, 3, 64, 64, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward(); opt.step()
        return loss.item()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    ref = [step() for _ in range(3)]
    net.load_state_dict(state); opt.state.clear()
    before = tensile.stack_reservation()
    torch.cuda.synchronize(); used0 = torch.cuda.mem_get_info()
    released = tensile.trim_stack()
    used1 = torch.cuda.mem_get_info()
    after = [step() for _ in range(3)]   # the driver grows the stack as kernels need
    grown = tensile.stack_reservation()
    print(json.dumps(dict(before=before.bytes, per_thread=before.bytes_per_thread,
                          released=released, freed=used1[0] - used0[0], grown=grown.bytes_per_thread,
                          same=all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(ref, after)))))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="trims a real CUDA context: needs a CUDA GPU")
def test_trim_gives_the_memory_back_and_training_is_unchanged():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["per_thread"] >= 1024 and r["released"] == r["before"]
    # the device's free memory grows by what was released (to the driver's 2 MiB pages)
    assert abs(r["freed"] - r["released"]) <= 2 * 2**20, r
    assert 0 <= r["grown"] < r["per_thread"], r
    assert r["same"], "the trimmed process trained differently (losses beyond 1e-4)"


def test_every_successful_trim_counts(fake_gpu):
    start = tensile.trim_count()
    tensile.trim_stack()
    assert tensile.trim_count() == start + 1
    fake_gpu.fail_set = 1
    with pytest.raises(RuntimeError):
        tensile.trim_stack()
    assert tensile.trim_count() == start + 1     # a failed call changed nothing


def test_a_graph_captured_before_a_trim_refuses_to_replay(fake_gpu):
    """GraphStep's guard, without a GPU: the graph itself is never touched."""
    from tensile.graph import GraphStep, memory_changes
    graph = GraphStep.__new__(GraphStep)      # what __init__ leaves, less the CUDA graph
    graph.static_batch, graph.changes_at_capture = (torch.zeros(2),), memory_changes()
    graph.graph = None
    assert not graph.stale
    tensile.trim_stack()
    assert graph.stale
    with pytest.raises(RuntimeError, match=r"captured before tensile.trim_stack\(\).*capture the step again"):
        graph(torch.ones(2))
    with pytest.raises(RuntimeError, match="captured before tensile.trim_stack"):
        graph.replay_ms(5)
    assert torch.equal(graph.static_batch[0], torch.zeros(2))   # nothing was copied in


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="trims a real CUDA context: needs a CUDA GPU")
def test_after_a_trim_old_graphs_refuse_and_the_scheduler_captures_again():
    """On the H200 a graph captured before a trim faulted at its next replay (module notes of
    tensile.stack): GraphStep refuses it, and Scheduler.replay captures the step again."""
    r = run_trim_child("tensile.trim_stack()")
    assert r["released"] > 0 and r["refused"], r
    assert r["captures"][1] == r["captures"][0] + 1 and not r["stale"] and r["finite"], r
