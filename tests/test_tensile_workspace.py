"""tensile.workspace: giving back cuBLAS's workspaces and making later ones small.

On the CPU the allocator and PyTorch's workspace map are fakes (the tests check the order of
the calls, the arithmetic, the environment and the errors); on a GPU, in a child process, the
real workspaces go back, a graph captured before refuses to replay and training goes on."""
from __future__ import annotations

import pytest
import torch

import tensile
from tensile import workspace
from tensile.graph import GraphStep, memory_changes
from trim_child import run_trim_child

MiB = 2**20


class FakeCuda:
    """The allocated bytes of one device that holds two 32 MiB workspaces, and the calls."""

    def __init__(self, monkeypatch, capturing: bool = False) -> None:
        self.allocated, self.calls = 100 * MiB + 2 * 32 * MiB, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: self.calls.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: self.allocated)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append("empty_cache"))
        monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", self.clear)
        monkeypatch.setenv(workspace.ENV, "")   # so that the test's value is undone after it
        monkeypatch.delenv(workspace.ENV)

    def clear(self) -> None:
        self.calls.append(("clear", workspace.os.environ.get(workspace.ENV)))
        self.allocated -= 2 * 32 * MiB


def test_trim_drops_the_workspaces_after_the_device_is_done_and_sets_the_size(monkeypatch):
    gpu = FakeCuda(monkeypatch)
    start = tensile.blas_trim_count()
    assert tensile.trim_blas_workspace() == 64 * MiB          # what the workspaces held
    # the size is set before the workspaces go (a product on another thread allocates the new
    # size), they go only once the device is done with them, and the cache is emptied last
    assert gpu.calls == ["synchronize", ("clear", ":1024:1"), "empty_cache"]
    assert workspace.os.environ[workspace.ENV] == ":1024:1"
    assert tensile.blas_trim_count() == start + 1
    gpu.allocated += 2 * 32 * MiB
    assert tensile.trim_blas_workspace(0) == 64 * MiB
    assert workspace.os.environ[workspace.ENV] == ":0:1"      # no workspace at all


@pytest.mark.parametrize("kib", [-1, 1.5, "1024", True, None])
def test_a_size_that_is_not_a_whole_number_of_kib_is_refused(monkeypatch, kib):
    gpu = FakeCuda(monkeypatch)
    start = tensile.blas_trim_count()
    with pytest.raises(ValueError, match=r"kib: expected a whole number of KiB >= 0, got"):
        tensile.trim_blas_workspace(kib)
    assert gpu.calls == [] and workspace.ENV not in workspace.os.environ
    assert tensile.blas_trim_count() == start


def test_no_trim_without_a_gpu_during_a_capture_or_under_deterministic_algorithms(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        tensile.trim_blas_workspace()
    gpu = FakeCuda(monkeypatch, capturing=True)
    with pytest.raises(RuntimeError, match="outside a CUDA graph capture"):
        tensile.trim_blas_workspace()
    FakeCuda(monkeypatch)
    monkeypatch.setenv(workspace.ENV, ":4096:8")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    with pytest.raises(RuntimeError, match=r"need CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8 "
                                           r"\(now ':4096:8'\).*would set :1024:1"):
        tensile.trim_blas_workspace()
    assert workspace.os.environ[workspace.ENV] == ":4096:8"   # left as it was
    assert gpu.calls == []


def test_a_graph_captured_before_a_workspace_trim_refuses_to_replay(monkeypatch):
    """GraphStep's guard, without a GPU: the graph itself is never touched."""
    graph = GraphStep.__new__(GraphStep)      # what __init__ leaves, less the CUDA graph
    graph.static_batch, graph.graph = (torch.zeros(2),), None
    graph.changes_at_capture = memory_changes()
    assert not graph.stale
    FakeCuda(monkeypatch)
    tensile.trim_blas_workspace()
    assert graph.stale
    with pytest.raises(RuntimeError, match=r"tensile.trim_blas_workspace\(\).*capture the step again"):
        graph(torch.ones(2))
    assert torch.equal(graph.static_batch[0], torch.zeros(2))   # nothing was copied in


@pytest.mark.gpu
def test_on_the_gpu_the_workspaces_go_back_and_later_ones_are_small():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = run_trim_child("tensile.trim_blas_workspace()", after="workspace_bytes()")
    assert r["released"] >= 2 * 4 * MiB          # two handles' workspaces, 4 MiB or more each
    # what the later products allocated: 1 MiB a handle (cuBLAS and cuBLASLt) and stream,
    # where the two handles' default-size workspaces are 16 MiB or more (64 on Hopper)
    assert 0 < r["after"] <= 8 * MiB
    assert r["refused"] and r["finite"] and not r["stale"]   # the old graph refuses; training goes on
    assert r["captures"][1] == r["captures"][0] + 1   # Scheduler.replay captured the step again
