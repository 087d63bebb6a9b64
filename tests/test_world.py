"""World construction: a single process, torchrun's variables, and mpirun through mpi4py."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    env.update(TRITON_INTERPRET="1", PORTABLE_OVERLAP_BACKEND="cpu",
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    return env


def test_single_process_world():
    code = ("from portable_overlap import World; w = World.from_env(); "
            "print(w.rank, w.world_size, w.device, w.backend.name, w.launcher)")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "cpu", "cpu", "torchrun"]


def _mpiexec():
    venv_bin = os.path.dirname(sys.executable)
    return shutil.which("mpiexec", path=venv_bin + os.pathsep + os.environ.get("PATH", ""))


def test_world_from_mpirun():
    pytest.importorskip("mpi4py")
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.join(HERE, "scripts",
                                                                          "mpi_world.py")],
                         env=_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # mpiexec forwards both ranks' stdout into one stream, and their lines may run together
    # ("...err=8.0e-08MPI-WORLD rank=1 ..."): find the records, not the lines
    record = r"MPI-WORLD rank=\d+ size=\d+ local=\d+ launcher=\w+ err=\S+?e[-+]\d\d"
    lines = sorted(re.findall(record, out.stdout))
    assert len(lines) == 2, out.stdout
    for r, line in enumerate(lines):
        assert f"rank={r} size=2 local={r} launcher=mpirun" in line, line
        assert float(line.split("err=")[1]) < 1e-5, line


def test_cpu_backend_without_the_interpreter_says_how_to_turn_it_on():
    """torchrun on a CPU machine without TRITON_INTERPRET: a clear error at the context, not
    Triton's "0 active drivers" at the first launch."""
    code = ("from portable_overlap import World, GemvAllReduce, BackendUnavailable\n"
            "w = World.from_env()\n"
            "try:\n"
            "    GemvAllReduce(w, max_n=8)\n"
            "    print('no error')\n"
            "except BackendUnavailable as e:\n"
            "    print(e)\n")
    env = _env()
    env.pop("TRITON_INTERPRET")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout and "gemv_all_reduce" in out.stdout, out.stdout


def _stream_barrier_waits(world):
    """Rank 1 reaches the stream barrier 0.5 s after rank 0: how long each rank's call took."""
    import time

    if world.rank == 1:
        time.sleep(0.5)
    t0 = time.monotonic()
    world.stream_barrier()
    return time.monotonic() - t0


def _placement(world):
    before = world.collectives
    first = world.placement(), world.shares_devices(), world.host_layout()
    between = world.collectives
    again = world.placement(), world.shares_devices(), world.host_layout()
    return first, again, between - before, world.collectives - between


def test_placement_names_each_ranks_host_and_device_once(world2):
    """Every rank's (host, device uid), gathered in one host collective and kept: emulated ranks
    are one host and a device each (a process of its own)."""
    for first, again, asked, asked_again in world2.run(_placement):
        placement, shared, hosts = first
        assert len(placement) == 2 and placement[0][0] == placement[1][0], placement
        assert placement[0][1] != placement[1][1], placement
        assert placement[0][1].startswith("cpu-process-"), placement
        assert not shared and hosts == (2,)
        assert again == first and asked <= 1 and asked_again == 0


def test_the_stream_barrier_on_cpu_ranks_holds_the_early_rank(world2):
    """On the CPU the stream barrier is the host barrier (a CPU has no stream to queue on): the
    rank that arrives first waits for the late one."""
    early, late = world2.run(_stream_barrier_waits)
    assert early > 0.3 and late < early, (early, late)


_BAD_LAUNCH_ENV = [
    # (variables, what the error must name): one launcher variable without its partner, values
    # that are not integers or lie out of range; before, the first two ran as rank 0 of a world
    # of one, RANK past WORLD_SIZE waited the whole rendezvous timeout, and a bad local rank
    # picked another rank's device
    ({"RANK": "1"}, "WORLD_SIZE is not set"),
    ({"WORLD_SIZE": "2"}, "RANK is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 with WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 with WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "RANK=0 with WORLD_SIZE=0"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-3"}, "LOCAL_RANK=-3"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=5"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_WORLD_SIZE=4"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK is not set"),
]


def test_a_malformed_launch_environment_is_refused_naming_the_variable():
    """World.from_env refuses torchrun variables that are missing, malformed or inconsistent
    with a ValueError naming them, before any rendezvous (one process tries every case: none
    reaches the process group)."""
    code = ("import json, os, sys\n"
            "from portable_overlap import World\n"
            "out = []\n"
            "for env, _ in json.loads(sys.argv[1]):\n"
            "    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE'):\n"
            "        os.environ.pop(k, None)\n"
            "    os.environ.update(env)\n"
            "    try:\n"
            "        out.append(repr(World.from_env(timeout_s=5)))\n"
            "    except Exception as e:\n"
            "        out.append(f'{type(e).__name__}: {e}')\n"
            "print(json.dumps(out))\n")
    cases = json.dumps(_BAD_LAUNCH_ENV)
    out = subprocess.run([sys.executable, "-c", code, cases], env=_env(MASTER_ADDR="127.0.0.1",
                         MASTER_PORT="1"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for (env, want), said in zip(_BAD_LAUNCH_ENV, got):
        assert said.startswith("ValueError: ") and want in said, (env, said)
