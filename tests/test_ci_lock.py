"""The CPU lock that `make test` installs on an x86_64 host without a GPU (.ci/cpu_lock.py)."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu_lock():
    spec = importlib.util.spec_from_file_location("cpu_lock", ROOT / ".ci" / "cpu_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _item(name: str, version: str, direct: bool = False) -> dict:
    return {"metadata": {"name": name, "version": version}, "is_direct": direct,
            "download_info": {"url": f"file:///x/{name}"}}


def test_lock_lines_pin_everything_but_triton_and_the_project_sorted():
    lines = _cpu_lock().lock_lines([_item("Torch", "2.14.1"), _item("triton", "3.8.0"),
                                    _item("nimble-suite", "0.1.0", direct=True),
                                    _item("numpy", "2.4.6")])
    assert lines == ["numpy==2.4.6", "torch==2.14.1"]


def test_the_committed_lock_pins_the_makefiles_torch_and_leaves_triton_out():
    makefile = (ROOT / "Makefile").read_text()
    x86_pins = re.search(r"ifeq \(\$\(ARCH\),x86_64\)\nTORCH_PINS := (.+)\n", makefile).group(1).split()
    lock = [line for line in (ROOT / ".ci" / "requirements-cpu.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    for pin in x86_pins:
        assert pin in lock, f"{pin} (Makefile) is not in the lock: run `make lock`"
    assert not any(line.startswith("triton==") for line in lock)
    assert all(re.fullmatch(r"[a-z0-9._-]+==[^=\s]+", line) for line in lock), lock


def test_main_without_pins_prints_usage_and_returns_2(capsys):
    assert _cpu_lock().main(["--check"]) == 2
    assert "usage" in capsys.readouterr().err
