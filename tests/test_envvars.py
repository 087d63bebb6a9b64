"""The environment overrides: values out of range raise a ValueError naming the variable and
the value, and every override is read when used, not when the library is imported."""
import time

import pytest
import torch

from portable_overlap.backends import backend_classes

CPU = torch.device("cpu")


@pytest.fixture
def cpu_backend():
    return backend_classes()["cpu"]()


@pytest.mark.parametrize("value", ["0", "-1", "1025", "four", "2.5"])
def test_cpu_slots_override_is_range_checked(cpu_backend, monkeypatch, value):
    monkeypatch.setenv("PORTABLE_OVERLAP_CPU_SLOTS", value)
    with pytest.raises(ValueError, match=rf"PORTABLE_OVERLAP_CPU_SLOTS={value!r}.*1 \.\. 1024"):
        cpu_backend.device_facts(CPU)


def test_cpu_slots_override_is_read_when_used(cpu_backend, monkeypatch):
    monkeypatch.setenv("PORTABLE_OVERLAP_CPU_SLOTS", "7")
    assert cpu_backend.device_facts(CPU).sm_count == 7
    monkeypatch.delenv("PORTABLE_OVERLAP_CPU_SLOTS")
    assert cpu_backend.device_facts(CPU).sm_count == 4


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "soon"])
def test_cpu_wait_timeout_override_is_range_checked(cpu_backend, monkeypatch, value):
    monkeypatch.setenv("PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT", value)
    flag = torch.ones(1, dtype=torch.int32)  # already set: the wait would return at once
    with pytest.raises(ValueError, match=rf"PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT={value!r}"):
        cpu_backend.stream_wait_value(None, flag.data_ptr(), 1)


def test_cpu_wait_timeout_override_is_read_when_used(cpu_backend, monkeypatch):
    from portable_overlap.errors import PeerTimeoutError

    monkeypatch.setenv("PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT", "0.05")
    flag = torch.zeros(1, dtype=torch.int32)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="0.05 s"):
        cpu_backend.stream_wait_value(None, flag.data_ptr(), 1)
    assert time.monotonic() - t0 < 5


def test_backend_override_names_where_the_name_came_from(monkeypatch):
    from portable_overlap.backends import get_backend
    from portable_overlap.errors import BackendUnavailable

    monkeypatch.setenv("PORTABLE_OVERLAP_BACKEND", "tpu")
    with pytest.raises(BackendUnavailable, match=r"PORTABLE_OVERLAP_BACKEND='tpu'.*'cpu'"):
        get_backend()
    monkeypatch.delenv("PORTABLE_OVERLAP_BACKEND")
    with pytest.raises(BackendUnavailable, match=r"^backend 'tpu' names no backend"):
        get_backend("tpu")
