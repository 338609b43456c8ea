"""experiments.kernels: the kernel census of a backend's calls (its report section: test_report)."""
import pytest
import torch

from experiments import kernels


def test_summarize_counts_overlap_once_and_gaps_not_at_all():
    # two calls; in each, two kernels overlap (two streams) and a third follows after a gap
    tasks = []
    for call, t0 in enumerate((0.0, 1000.0)):
        tasks += [(call, "conv", t0, t0 + 10), (call, "add", t0 + 5, t0 + 15),
                  (call, "conv", t0 + 40, t0 + 50)]
    c = kernels.summarize(reversed(tasks), calls=2)          # order of arrival does not matter
    assert c.calls == 2 and c.kernels == 3
    assert c.kernel_ms == pytest.approx(30 / 1e3)             # 10 + 10 + 10 us per call
    assert c.busy_ms == pytest.approx(25 / 1e3)               # [0, 15] and [40, 50]
    assert c.span_ms == pytest.approx(50 / 1e3)               # the gap between calls is not counted
    assert c.top == [("conv", 2.0, 20.0), ("add", 1.0, 10.0)]
    assert c.by_name == {"conv": (2.0, 20.0), "add": (1.0, 10.0)}   # every name, per call
    assert c.copy_ms == 0 and c.compute_busy_ms == c.busy_ms


def test_summarize_tells_copies_beside_kernels_from_compute():
    # a copy engine's copy spans a gap between two kernels: the GPU is busy, its compute units wait
    tasks = [(0, "conv", 0.0, 10.0), (0, "Memcpy DtoH (Device -> Pinned)", 5.0, 40.0),
             (0, "conv", 30.0, 50.0)]
    c = kernels.summarize(tasks, calls=1)
    assert c.kernel_ms == pytest.approx(65 / 1e3) and c.copy_ms == pytest.approx(35 / 1e3)
    assert c.busy_ms == pytest.approx(50 / 1e3)               # [0, 50]
    assert c.compute_busy_ms == pytest.approx(30 / 1e3)       # [0, 10] and [30, 50]
    assert kernels.is_copy("Memcpy HtoD (Pinned -> Device)") and not kernels.is_copy("memset32")


def test_kernel_diff_puts_the_largest_change_first():
    base = {"conv": (10.0, 200.0), "bn": (5.0, 50.0), "copy": (1.0, 5.0)}
    other = {"conv": (12.0, 245.0), "bn": (5.0, 49.0), "bn_act": (3.0, 30.0)}
    assert kernels.kernel_diff(base, other) == [
        ("conv", 2.0, 45.0), ("bn_act", 3.0, 30.0), ("copy", -1.0, -5.0), ("bn", 0.0, -1.0)]
    assert kernels.kernel_diff(base, other, top=1) == [("conv", 2.0, 45.0)]
    assert kernels.kernel_diff({}, {}) == []


def test_summarize_keeps_the_costliest_names_only():
    tasks = [(0, f"k{i}", float(i), float(i) + i / 10) for i in range(1, 30)]
    top = kernels.summarize(tasks, calls=1).top
    assert len(top) == kernels.TOP and top[0][0] == "k29" and top[-1][0] == "k20"


def test_summarize_refuses_what_it_cannot_count():
    with pytest.raises(ValueError, match=r"no GPU task was recorded in call\(s\) \[1\]"):
        kernels.summarize([(0, "k", 0.0, 1.0)], calls=2)
    with pytest.raises(ValueError, match="calls: expected at least 1, got 0"):
        kernels.summarize([(0, "k", 0.0, 1.0)], calls=0)
    with pytest.raises(ValueError, match="task 'k' ends"):
        kernels.summarize([(0, "k", 5.0, 1.0)], calls=1)
    with pytest.raises(ValueError, match=r"task 'k' belongs to call 3; expected 0..1"):
        kernels.summarize([(3, "k", 0.0, 1.0)], calls=2)


def test_census_needs_cuda_inputs():
    with pytest.raises(ValueError, match="the inputs must be CUDA tensors"):
        kernels.census(lambda x: x, (torch.zeros(1),))


def test_cli_refuses_unknown_models_and_backends_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        kernels.main(["--models", "resnet5O"])
    assert "unknown model 'resnet5O'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kernels.main(["--models", "resnet50", "--backends", "eager,nimbel"])
    assert "unknown backend(s) ['nimbel']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kernels.main(["--models", "resnet50", "--batch", "1,x"])
    assert "expected comma-separated integers, got '1,x'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without CUDA")
def test_without_cuda_the_cli_says_so(capsys):
    with pytest.raises(SystemExit):
        kernels.main(["--models", "resnet50"])
    assert "no CUDA device is available here" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_census_of_a_graph_replay_counts_its_kernels():
    x = torch.randn(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = ((x + 1) * 2).relu()                    # three elementwise kernels, one after another
    c = kernels.census(lambda _: graph.replay(), (x,), calls=10)
    assert c.calls == 10 and c.kernels == pytest.approx(3)
    assert 0 < c.busy_ms <= c.kernel_ms + 1e-9 and c.busy_ms <= c.span_ms + 1e-9
    assert sum(count for _, count, _ in c.top) == pytest.approx(3)
    assert sum(n for n, _ in c.by_name.values()) == pytest.approx(3)
    del y
