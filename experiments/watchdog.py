"""Stop a measurement that hangs: store an error row, print the stacks, exit the process.

A backend can hang inside C++ (TorchScript's profiling executor on DenseNet-121 on CUDA did,
for minutes), where no Python exception can reach it. A thread cannot be interrupted there
either, so the watchdog does the one thing that is always possible: it writes the row that
says what happened (the store appends under a file lock, safe from this thread), dumps every
thread's Python stack to stderr for the bug report, and ends the process with exit code 124
(what ``timeout(1)`` uses). Re-running the same command resumes the sweep: the error row
counts as measured, so the stuck backend is skipped and the next one runs.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

EXIT_STUCK = 124


@contextmanager
def stop_if_stuck(limit_s: float | None, on_stuck: Callable[[str], None],
                  what: str = "the backend") -> Iterator[None]:
    """Run the body; if it is still running after ``limit_s`` seconds, stop the process.

    ``on_stuck(reason)`` is called first (from the watchdog thread) to record the failure.
    ``limit_s`` None or <= 0 disables the watchdog.
    """
    if not limit_s or limit_s <= 0:
        yield
        return

    def fire() -> None:
        reason = (f"{what} did not finish within {limit_s:g} s (backend_timeout_s): the process "
                  "was stopped; re-run the same command to go on with the next backend")
        try:
            on_stuck(reason)
        finally:
            print(f"\nwatchdog: {reason}; Python stacks follow", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(EXIT_STUCK)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
