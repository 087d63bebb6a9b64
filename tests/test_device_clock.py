"""The interpreter's clock (``device_clock.host_now_ns``): it reads as ns since 1970, like
NVIDIA's ``%globaltimer``, and runs with the rank's CPU time, not while the process sleeps or
waits for the host's cores."""
import time

from portable_overlap.backends.device_clock import host_now_ns


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_reads_as_the_epoch():
    assert abs(host_now_ns() - time.time_ns()) < 3600 * 10**9  # (set at import, then CPU time)
    assert host_now_ns() > 2**60  # the size the deadline's packing is built for


def test_runs_with_cpu_time_not_while_sleeping():
    t0 = host_now_ns()
    time.sleep(0.3)
    slept = host_now_ns() - t0
    t0 = host_now_ns()
    _spin(0.2)
    spun = host_now_ns() - t0
    assert slept < 0.1e9, slept
    assert 0.2e9 <= spun < 0.5e9, spun
