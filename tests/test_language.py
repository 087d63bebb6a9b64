"""The public device API (portable_overlap.language) and its host side (Workspace) on emulated
ranks: every primitive against a torch reference over several calls, and the failure paths (a
flag nobody sets, a peer that gives up, a kernel that skips end_call, bad host input). The calls
live in portable_overlap.testing.language_calls, shared with tests/gpu/check_language.py."""
import pytest
import triton

import portable_overlap.language as pol
from portable_overlap.errors import ContextClosedError, RankMismatchError
from portable_overlap.testing import language_calls as calls


def test_ping_ring_over_calls(world):
    assert not calls.check_ping(world.run(calls.ping, 37, 3), 3)


@pytest.mark.parametrize("n", [1, 63])
def test_ping_odd_sizes(world2, n):
    assert not calls.check_ping(world2.run(calls.ping, n, 2), 2)


def test_all_gather_by_puts(world):
    assert not calls.check_gather(world.run(calls.gather, 45, 2))


def test_counters_barrier_and_remote_loads(world):
    assert not calls.check_count(world.run(calls.count, 2))


def test_program_numbering_over_a_3d_grid(world2):
    assert not calls.check_grid(world2.run(calls.grid))


def test_a_flag_nobody_sets_raises_on_every_rank_naming_it(world):
    assert not calls.check_lonely(world.run(calls.lonely))


def test_a_peer_that_gives_up_is_reported_and_the_workspace_goes_on(world):
    assert not calls.check_quitter(world.run(calls.quitter))


def test_flags_of_another_tag_raise_a_mismatch(world):
    assert not calls.check_tagged(world.run(calls.tagged))


def test_a_kernel_that_skips_end_call_is_caught(world2):
    assert not calls.check_no_end(world2.run(calls.no_end))


def test_every_call_on_eight_ranks(world8):
    assert not calls.check_every_call(world8.run(calls.every_call, timeout=600))


def test_every_peer_and_consumed_buffers_over_back_to_back_calls(world):
    assert not calls.check_sum(world.run(calls.sum_by_pushes, 11, 3), 3)


def test_a_consumed_flag_nobody_sets_raises_naming_it(world2):
    assert not calls.check_unread(world2.run(calls.unread))


def test_bad_host_input_is_refused(world2):
    for errors in world2.run(calls.bad_host):
        assert errors["nbytes"][0] == "ValueError" and "nbytes" in errors["nbytes"][1]
        assert errors["name"][0] == "ValueError"
        assert errors["timeout"][0] == "ValueError" and "timeout_s" in errors["timeout"][1]
        assert errors["shape"][0] == "ValueError" and errors["dtype"][0] == "ValueError"
        assert errors["flag name"][0] == "ValueError" and "name" in errors["flag name"][1]
        assert errors["full"][0] == "MemoryError" and "larger nbytes" in errors["full"][1]
        assert errors["disagree"][0] == RankMismatchError.__name__
        assert errors["closed"][0] == ContextClosedError.__name__
        assert errors["closed launch"][0] == ContextClosedError.__name__


def test_public_names():
    assert set(pol.__all__) <= set(dir(pol))
    for name in pol.__all__:
        assert isinstance(getattr(pol, name), triton.JITFunction), name


def test_the_checks_can_fail():
    """The verdicts reject wrong results (so the GPU check cannot pass by accident)."""
    import torch

    x = torch.ones(3)
    assert calls.check_ping([([(x, x + 1, 1)], 1), ([(x, x, 1)], 1)], 1)
    assert calls.check_grid([torch.zeros(24, dtype=torch.int64)])
    assert calls.check_lonely([(None, None)])
    assert calls.check_no_end([(None, None)])
    assert calls.check_tagged([(None, None)])
    assert calls.check_unread([(1, None, None)])
    assert calls.check_sum([([(x, x, [1])], 1), ([(x, x, [1])], 1)], 1)
