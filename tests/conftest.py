"""Shared test fixtures."""
import pytest
import torch


@pytest.fixture
def strict_fp32():
    """TF32 off for the duration of a test: fp32 comparisons against eager need it."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture
def deterministic_cudnn():
    """Deterministic cuDNN kernels (no atomics in conv backward) for exact comparisons."""
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old
