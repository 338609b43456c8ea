"""experiments.mps: the private MPS daemon, driven here through a stand-in control program."""
from __future__ import annotations

import os
import stat

import pytest

from experiments import mps


def _fake_control(tmp_path, monkeypatch, exit_code: int = 0):
    """An ``nvidia-cuda-mps-control`` on PATH that logs its arguments, its pipe folder and
    its input, then exits with ``exit_code``."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    prog = bin_dir / mps.CONTROL
    prog.write_text("#!/bin/sh\n"
                    f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY gpus=$CUDA_VISIBLE_DEVICES '
                    f'stdin=$(cat)" >> {log}\n'
                    f'[ "$1" = "-d" ] && echo "cannot start" >&2\n'
                    f'[ "$1" = "-d" ] && exit {exit_code}\nexit 0\n')
    prog.chmod(prog.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_daemon_serves_the_block_and_quits_after_it(tmp_path, monkeypatch):
    log = _fake_control(tmp_path, monkeypatch)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/somebody/elses")
    assert mps.available()
    with mps.mps_daemon({**os.environ, "CUDA_VISIBLE_DEVICES": "1"}) as pipe:
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe and os.path.isdir(pipe)
        assert os.environ["CUDA_MPS_LOG_DIRECTORY"] != "/somebody/elses"
    start, quit_ = log.read_text().splitlines()
    assert start.startswith(f"args=-d pipe={pipe} gpus=1")   # on the GPUs it was given
    assert quit_.startswith(f"args= pipe={pipe}") and quit_.endswith("stdin=quit")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ      # the environment as it was
    assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/somebody/elses"
    assert not os.path.exists(pipe)


def test_the_daemon_quits_when_the_block_fails(tmp_path, monkeypatch):
    log = _fake_control(tmp_path, monkeypatch)
    with pytest.raises(KeyError):
        with mps.mps_daemon():
            raise KeyError("a job failed")
    assert log.read_text().splitlines()[-1].endswith("stdin=quit")


def test_a_daemon_that_does_not_start_is_a_clear_error(tmp_path, monkeypatch):
    _fake_control(tmp_path, monkeypatch, exit_code=1)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with pytest.raises(RuntimeError, match=r"nvidia-cuda-mps-control -d failed \(exit code 1\): cannot start"):
        with mps.mps_daemon():
            pytest.fail("the block must not run")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_no_control_program_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not mps.available()
    with pytest.raises(RuntimeError, match="nvidia-cuda-mps-control on PATH"):
        with mps.mps_daemon():
            pass


def test_clients_see_the_daemons_gpus_from_0():
    env = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PIPE_DIRECTORY": "/p", "PATH": "/bin"}
    assert mps.client_env(env) == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/p",
                                   "PATH": "/bin"}
    assert env["CUDA_VISIBLE_DEVICES"] == "1"      # the daemon's own environment untouched
    assert mps.client_env({"CUDA_VISIBLE_DEVICES": "2,3"})["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert mps.client_env({"PATH": "/bin"}) == {"PATH": "/bin"}   # the daemon serves every GPU
