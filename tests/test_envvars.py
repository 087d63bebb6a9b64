"""The environment overrides: values out of range raise a ValueError naming the variable and
the value, every override is read when used, not when the library is imported, and a variable
with the library's prefix that it does not read is reported."""
import os
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch

from portable_overlap.backends import backend_classes

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_a_misspelt_variable_is_reported_once_with_the_closest_name(monkeypatch):
    """A variable with the library's prefix that it does not read was ignored without a word:
    ``PORTABLE_OVERLAP_TUNNING_CACHE`` ran every job without its cache file."""
    from portable_overlap import envvars

    monkeypatch.setattr(envvars, "_reported", set())
    env = {"PORTABLE_OVERLAP_TUNNING_CACHE": "t.json", "PORTABLE_OVERLAP_XYZZY": "1",
           "PORTABLE_OVERLAP_CPU_SLOTS": "4", "OTHER_TUNING_CACHE": "x"}
    with pytest.warns(RuntimeWarning) as caught:
        got = envvars.check_names(env)
    assert got == [("PORTABLE_OVERLAP_TUNNING_CACHE", "PORTABLE_OVERLAP_TUNING_CACHE"),
                   ("PORTABLE_OVERLAP_XYZZY", None)]
    said = [str(w.message) for w in caught]
    assert len(said) == 2 and "did you mean PORTABLE_OVERLAP_TUNING_CACHE?" in said[0], said
    assert "XYZZY is set, but portable_overlap reads no variable" in said[1], said
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert envvars.check_names(env) == got
        assert envvars.check_names({n: "1" for n in envvars.NAMES}) == []


def test_the_catalogue_names_every_variable_the_package_reads():
    """``envvars.NAMES`` is what ``check_names`` compares with: a variable the package reads
    that it lacks would be reported as misspelt."""
    from portable_overlap import envvars

    root = os.path.dirname(envvars.__file__)
    found = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    found |= set(re.findall(r"PORTABLE_OVERLAP_[A-Z0-9_]*[A-Z0-9]", f.read()))
    assert found == set(envvars.NAMES)


def test_making_a_world_reports_a_misspelt_variable():
    code = "from portable_overlap import World; World.from_env(); World.from_env()"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(TRITON_INTERPRET="1", PORTABLE_OVERLAP_BACKEND="cpu",
               PORTABLE_OVERLAP_CPU_SLOT="8", PYTHONPATH=ROOT + os.pathsep
               + env.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("PORTABLE_OVERLAP_CPU_SLOT is set") == 1, out.stderr
    assert "did you mean PORTABLE_OVERLAP_CPU_SLOTS?" in out.stderr, out.stderr


def _override_bad_on_one_rank(world):
    """Rank 1's PORTABLE_OVERLAP_CPU_SLOTS is not a number; each rank makes a context of two
    ops (a transport's plan read the device's facts after the context's first collective,
    where rank 1's error left rank 0 waiting in the heap's allocation). (error type, message)
    per context on this rank."""
    import portable_overlap as po

    found = []
    for make in (lambda: po.MatmulReduceScatter(world, 48, 64, transport="stores"),
                 lambda: po.GemvAllReduce(world, 64, transport="stores")):
        world.__dict__.pop("_facts", None)  # (read again: as in a fresh process)
        if world.rank == 1:
            os.environ["PORTABLE_OVERLAP_CPU_SLOTS"] = "abc"
        try:
            make().close()
            found.append(("made", ""))
        except Exception as e:
            found.append((type(e).__name__, str(e)))
        finally:
            os.environ.pop("PORTABLE_OVERLAP_CPU_SLOTS", None)
            world.__dict__.pop("_facts", None)
    return found


def test_an_override_refused_on_one_rank_is_told_to_its_peers(world2):
    mine, peer = world2.run(_override_bad_on_one_rank, timeout=120)
    for (kind0, msg0), (kind1, msg1) in zip(mine, peer):
        assert kind1 == "ValueError" and "PORTABLE_OVERLAP_CPU_SLOTS" in msg1, (kind1, msg1)
        assert kind0 == "PeerSetupError" and "PORTABLE_OVERLAP_CPU_SLOTS" in msg0, (kind0, msg0)


def test_a_blank_variable_is_unset_and_a_path_with_stray_space_is_refused(monkeypatch,
                                                                           tmp_path):
    """A blank value is no setting (the tuning cache made a file named " " in the working
    folder); a path with white space around it named another file than the one meant (a
    trailing space wrote "c.json "), silently: refused, naming the variable."""
    from portable_overlap.envvars import env_file_path, env_str

    name = "PORTABLE_OVERLAP_TUNING_CACHE"
    for blank in ("", " ", "\t \n"):
        monkeypatch.setenv(name, blank)
        assert env_str(name) is None and env_file_path(name) is None
    for stray in (f"{tmp_path}/c.json ", f" {tmp_path}/c.json"):
        monkeypatch.setenv(name, stray)
        with pytest.raises(ValueError, match=f"{name}=.*white space"):
            env_file_path(name)
    monkeypatch.setenv(name, f"{tmp_path}/c d.json")  # a space inside is a name like any
    assert env_file_path(name) == f"{tmp_path}/c d.json"
