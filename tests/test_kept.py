"""``portable_overlap.kept``: what a context keeps from a call is made on a thread of its own
(outside the CUDA-graph trees' pool, which takes the calling thread's allocations), complete
when handed over; on the CPU and under stream capture, by the caller."""
import contextlib
import threading

import pytest
import torch

from portable_overlap import kept


class _Module:
    """The parts of a device module ``kept`` uses, recording the threads that used them."""

    def __init__(self, capturing=False):
        self.capturing, self.synced = capturing, []
        module = self

        class _Stream:
            def synchronize(self):
                module.synced.append(threading.current_thread().name)
        self._stream = _Stream()

    def is_current_stream_capturing(self):
        return self.capturing

    @contextlib.contextmanager
    def device(self, d):
        yield

    def current_stream(self, d):
        return self._stream


def _made_on(monkeypatch, device, capturing=False):
    module = _Module(capturing)
    monkeypatch.setattr(torch, "get_device_module", lambda d: module)
    threads = []

    def make():
        threads.append(threading.current_thread().name)
        return torch.arange(5)

    t = kept.kept(make, device)
    assert torch.equal(t, torch.arange(5))
    return threads, module.synced


def test_kept_tensors_are_made_on_the_worker_and_synchronized_there(monkeypatch):
    threads, synced = _made_on(monkeypatch, torch.device("meta"))
    assert threads[0].startswith("portable_overlap-kept") and synced == threads


def test_kept_tensors_under_capture_and_on_the_cpu_are_made_by_the_caller(monkeypatch):
    me = threading.current_thread().name
    assert _made_on(monkeypatch, torch.device("meta"), capturing=True) == ([me], [])
    assert _made_on(monkeypatch, torch.device("cpu")) == ([me], [])


def test_kept_helpers_make_what_torch_makes():
    cpu = torch.device("cpu")
    assert kept.kept_empty((2, 3), torch.int32, cpu).shape == (2, 3)
    z = kept.kept_zeros(4, torch.float16, cpu)
    assert z.dtype == torch.float16 and not z.any()
    assert torch.equal(kept.kept_tensor([[1, 2]], torch.int64, cpu), torch.tensor([[1, 2]]))


def test_a_copy_from_the_host_under_capture_says_to_call_eagerly_first(monkeypatch):
    monkeypatch.setattr(torch, "get_device_module", lambda d: _Module(capturing=True))
    with pytest.raises(RuntimeError, match="make one eager call with these shapes before"):
        kept.kept_tensor([1, 2], torch.int32, torch.device("meta"))


def test_a_forked_child_makes_its_own_worker(monkeypatch):
    """The parent's worker thread does not exist in a forked child: it starts its own."""
    import os
    import signal

    monkeypatch.setattr(torch, "get_device_module", lambda d: _Module())
    kept.kept(lambda: torch.zeros(1), torch.device("meta"))  # the parent's worker exists
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a kept tensor must come back (a dead worker would hang here)
        signal.alarm(20)  # so a hang ends the child, and the parent reads nothing
        try:  # (no torch op in the child: its thread pools are the parent's)
            os.write(w, kept.kept(lambda: b"ok", torch.device("meta")))
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 2)
    os.waitpid(pid, 0)
    assert got == b"ok"


def test_a_growing_buffer_doubles_and_keeps_what_it_outgrew():
    """Views of one buffer while calls need no more; growth at least doubles, so sizes that
    grow one element at a time make a logarithmic number of buffers; every outgrown buffer
    stays alive (a graph captured over it replays into it); ``zero`` fills each new one."""
    import weakref

    buf = kept.GrowingBuffer(torch.device("cpu"), torch.int64, zero=True)
    first = buf.get(3)
    assert first.shape == (3,) and not first.any()
    first.fill_(7)
    assert buf.get(2).data_ptr() == first.data_ptr()  # no new buffer for a smaller call
    held = weakref.ref(buf.buffer)
    del first
    for n in range(4, 1001):
        view = buf.get(n)
        assert view.numel() == n
    assert len(buf.outgrown) <= 10, len(buf.outgrown)  # 3 -> 1000 by doubling: 9 steps
    assert held() is not None and held() is buf.outgrown[0]
    assert not buf.get(1000).any()  # the new buffer is zero-filled, not the old contents
    total = buf.buffer.numel() + sum(t.numel() for t in buf.outgrown)
    assert total < 4 * 1000, total
    assert kept.GrowingBuffer("cpu", torch.float16).get(0).numel() == 0
