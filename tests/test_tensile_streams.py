"""tensile.streams on the CPU: finding the CUDA runtime in a process's memory map."""
from __future__ import annotations

from tensile.streams import find_cudart

MAPS = """\
7f1c00000000-7f1c00021000 rw-p 00000000 00:00 0
7f1c10000000-7f1c10080000 r-xp 00000000 08:01 4242 /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c20000000-7f1c20100000 r--p 00000000 08:01 777 /opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f1c30000000-7f1c30100000 r--p 00000000 08:01 778 /opt/my dir/libcudart.so.12
"""


def test_finds_the_mapped_cuda_runtime():
    assert find_cudart(MAPS) == ("/opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/"
                                 "libcudart.so.13")


def test_paths_with_spaces_and_no_runtime():
    assert find_cudart(MAPS.splitlines()[3] + "\n") == "/opt/my dir/libcudart.so.12"
    no_runtime = "\n".join(line for line in MAPS.splitlines() if "cudart" not in line)
    assert find_cudart(no_runtime) is None
    # a library whose name only contains the runtime's is not the runtime
    assert find_cudart("1-2 r--p 0 0:0 1 /x/libcudart_wrapper.so\n") is None

