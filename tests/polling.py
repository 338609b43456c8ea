"""Polling helper for tests that wait on another process or thread."""
import time


def wait_until(cond, timeout: float, every: float = 0.02) -> bool:
    """Call ``cond()`` every ``every`` seconds until it is true (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return False
