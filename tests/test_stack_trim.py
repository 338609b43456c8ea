"""experiments.stack_trim: the command line on the CPU; one model measured on a GPU."""
from __future__ import annotations

import pytest
import torch

from experiments import stack_trim
from experiments.store import read_rows


def test_fewer_than_100_timed_replays_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        stack_trim.main(["--models", "resnet50", "--iters", "50"])
    assert exc.value.code == 2
    assert "--iters must be >= 100 (the suite's timing protocol), got 50" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_a_gpu_the_error_says_so(capsys):
    with pytest.raises(SystemExit) as exc:
        stack_trim.main(["--models", "resnet50"])
    assert exc.value.code == 2
    assert "no CUDA device is available here" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="trims a CUDA context: needs a CUDA GPU")
def test_one_model_before_and_after_the_trims(tmp_path):
    assert stack_trim.main(["--models", "resnet50", "--batch", "2", "--iters", "100",
                            "--results", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*/stack_trim.csv")
    (row,) = read_rows(path)
    assert row["model"] == "resnet50" and int(row["batch_size"]) == 2
    assert float(row["released_mb"]) == pytest.approx(float(row["stack_mb_before"]))
    assert int(row["stack_bytes_per_thread_after"]) < int(row["stack_bytes_per_thread_before"])
    # what was released left the process (the driver's 2 MiB pages), and stays gone
    assert float(row["saved_mb"]) >= float(row["released_mb"]) - float(row["stack_mb_after"]) - 2
    assert 0.5 < float(row["step_ratio"]) < 2
    # then the cuBLAS workspaces: two handles' (4 MiB or more each) on two streams go back,
    # the third capture holds 1 MiB ones instead
    assert float(row["blas_released_mb"]) >= 2 * 4
    assert float(row["allocated_mb_blas"]) < float(row["allocated_mb_after"]) - 4
    assert 0.5 < float(row["blas_step_ratio"]) < 2
