"""The tuning cache file: written atomically with a private mode, never through a symbolic link
(at the cache path or at a temporary name), and a file that cannot be used is ignored with a
warning, never a crash."""
import json
import os
import stat
import warnings

import pytest

from portable_overlap.schedule import TuningCache

VAR = "PORTABLE_OVERLAP_TUNING_CACHE"


@pytest.fixture
def victim(tmp_path):
    """A file a planted link points at; nothing may write to it."""
    p = tmp_path / "victim.txt"
    p.write_text("precious")
    return p


def test_put_writes_json_with_a_private_mode_and_no_leftovers(tmp_path):
    path = tmp_path / "cache" / "tuning.json"
    TuningCache(str(path)).put("k", [1, 2])
    assert json.loads(path.read_text()) == {"k": [1, 2]}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(path.parent) == ["tuning.json"]
    assert TuningCache(str(path)).get("k") == [1, 2]


def test_put_does_not_follow_a_link_at_a_temporary_name(tmp_path, victim):
    path = tmp_path / "tuning.json"
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")  # the name a pid-derived temp file would take
    TuningCache(str(path)).put("k", 1)
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and json.loads(path.read_text()) == {"k": 1}


def test_a_link_at_the_cache_path_is_neither_read_nor_written(tmp_path, victim):
    victim.write_text(json.dumps({"k": "planted"}))
    path = tmp_path / "tuning.json"
    os.symlink(victim, path)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        cache = TuningCache(str(path))
    assert cache.get("k") is None
    with pytest.warns(RuntimeWarning, match="symbolic link.*not written"):
        cache.put("k", 1)
    assert cache.get("k") == 1  # the decision is still used in this process
    assert path.is_symlink() and json.loads(victim.read_text()) == {"k": "planted"}


def test_a_fifo_at_the_cache_path_is_neither_read_nor_replaced(tmp_path):
    """A path that is no regular file (a FIFO here; a device node such as /dev/null, set to
    turn the cache off, alike): the atomic write renamed a private file over it, which for
    /dev/null as root would replace the machine's node."""
    path = tmp_path / "tuning.fifo"
    os.mkfifo(path)
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        cache = TuningCache(str(path))
    with pytest.warns(RuntimeWarning, match="not a regular file.*kept in this process"):
        cache.put("k", 1)
    assert cache.get("k") == 1  # the decision is still used in this process
    assert stat.S_ISFIFO(os.stat(path).st_mode)
    assert os.listdir(tmp_path) == ["tuning.fifo"]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe", "", '{"k": [1',
                                  "[" * 100_000])  # (the last: a RecursionError in the parser)
def test_a_corrupt_cache_file_is_ignored_with_a_warning(tmp_path, text):
    path = tmp_path / "tuning.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.warns(RuntimeWarning, match="ignored"):
        cache = TuningCache(str(path))
    assert cache.get("k") is None
    cache.put("k", 1)
    assert json.loads(path.read_text()) == {"k": 1}


@pytest.mark.skipif(not os.path.isfile("/proc/self/mem"), reason="needs Linux's /proc")
def test_a_cache_file_that_fails_to_read_is_ignored_with_a_warning():
    """A file that opens and then fails to read (on NFS, ESTALE where another node renamed a
    new version over it) is ignored as an unreadable one is: raised on one rank, its peers
    waited in the call's next collective. /proc/self/mem opens as a regular file and its read
    at offset 0 fails with EIO."""
    with pytest.warns(RuntimeWarning, match="cannot be read.*ignored"):
        cache = TuningCache("/proc/self/mem")
    assert cache.get("k") is None


def test_a_value_that_cannot_be_stored_changes_nothing(tmp_path):
    path = tmp_path / "tuning.json"
    cache = TuningCache(str(path))
    cache.put("k", 1)
    with pytest.raises(TypeError):
        cache.put("bad", object())
    assert cache.get("bad") is None
    assert os.listdir(tmp_path) == ["tuning.json"]  # no temporary file left
    cache.put("k2", 2)  # later puts still work
    assert json.loads(path.read_text()) == {"k": 1, "k2": 2}


def test_cache_path_variable_is_read_when_used(tmp_path, monkeypatch):
    monkeypatch.setenv(VAR, str(tmp_path / "t.json"))
    assert TuningCache().path == str(tmp_path / "t.json")
    monkeypatch.setenv(VAR, str(tmp_path))
    with pytest.raises(ValueError, match=rf"{VAR}=.*names a directory"):
        TuningCache()
    # a folder's path that does not exist yet: every put failed at the rename onto it
    monkeypatch.setenv(VAR, str(tmp_path / "new") + os.sep)
    with pytest.raises(ValueError, match=rf"{VAR}=.*names a directory"):
        TuningCache()


@pytest.mark.parametrize("where", ["under a regular file", "read-only"])
def test_a_cache_that_cannot_be_written_warns_and_keeps_the_decision(tmp_path, monkeypatch,
                                                                     where):
    """``decide`` puts after every rank took the decision: a rank that raised there (one rank's
    file unwritable) left its peers waiting in the call's collective for ever."""
    path = tmp_path / "tuning.json"
    if where == "under a regular file":
        (tmp_path / "afile").write_text("")
        path = tmp_path / "afile" / "tuning.json"
    else:  # chmod does not stop root: the refusal a read-only folder gives

        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr("tempfile.mkstemp", refused)
    with warnings.catch_warnings():  # (under a regular file the read warns first)
        warnings.simplefilter("ignore")
        cache = TuningCache(str(path))
    with pytest.warns(RuntimeWarning, match="cannot be written.*kept in this process"):
        cache.put("k", 1)
    assert cache.get("k") == 1
    assert not path.exists()


def test_caches_of_one_file_keep_each_others_decisions(tmp_path):
    """Two caches of one file (two contexts of a process, or two processes) read it before
    either wrote: each put replaced the file with its own entries, losing the other's."""
    path = tmp_path / "tuning.json"
    first, second = TuningCache(str(path)), TuningCache(str(path))
    first.put("a", 1)
    second.put("b", 2)
    first.put("c", 3)
    assert json.loads(path.read_text()) == {"a": 1, "b": 2, "c": 3}
    assert second.get("a") == 1  # a put keeps what it found in the file


def test_a_cache_path_argument_that_names_a_folder_is_refused(tmp_path):
    from portable_overlap.ops.planner import _check_path

    for path in (str(tmp_path), str(tmp_path / "new") + os.sep):
        with pytest.raises(ValueError, match="cache_path must be the path of a file, not a dir"):
            _check_path("op", path)
    assert _check_path("op", str(tmp_path / "t.json")) == str(tmp_path / "t.json")


def _put_many(path, r, n, start):
    start.wait()
    for i in range(n):
        TuningCache(path).put(f"rank{r}/{i}", i)


def test_writers_in_several_processes_keep_every_decision(tmp_path):
    """Each put read the file, then replaced it with what it read and its own entry: writers in
    other processes that wrote in between lost theirs (72 of 160 entries kept)."""
    import multiprocessing as mp

    path, procs, n = str(tmp_path / "tuning.json"), 4, 25
    ctx = mp.get_context("fork")
    start = ctx.Barrier(procs)
    ps = [ctx.Process(target=_put_many, args=(path, r, n, start)) for r in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(timeout=120)
    assert [p.exitcode for p in ps] == [0] * procs
    assert len(json.loads((tmp_path / "tuning.json").read_text())) == procs * n
    assert os.listdir(tmp_path) == ["tuning.json"]


def test_a_put_keeps_a_newer_decision_of_the_file(tmp_path):
    """A cache's put writes the file's entries over the ones it read earlier: another cache's
    newer decision of a key (made again) is not reverted."""
    path = str(tmp_path / "tuning.json")
    TuningCache(path).put("k", "old")
    stale = TuningCache(path)
    TuningCache(path).put("k", "new")
    stale.put("other", 1)
    assert json.loads((tmp_path / "tuning.json").read_text()) == {"k": "new", "other": 1}


class _OneRank:
    """The world of one rank ``decide`` needs."""

    world_size = 1

    def all_gather_object(self, obj):
        return [obj]

    def broadcast_object(self, obj):
        return obj


@pytest.mark.parametrize("entry", ["sequential", {"transport": "bogus"}, [1]])
def test_an_entry_that_is_no_decision_is_made_again_with_a_warning(tmp_path, entry):
    """An entry the caller's check refuses (a hand-edited file, a transport this build lacks)
    raised on every rank at every call of its key, until the file was edited."""
    from portable_overlap.schedule import decide

    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"k": entry}))
    cache = TuningCache(str(path))
    valid = lambda v: v["transport"] in ("a", "b")  # noqa: E731 (raises on a string or list)
    with pytest.warns(RuntimeWarning, match="not a decision of this call; it is made again"):
        got = decide(_OneRank(), "k", lambda: {"transport": "a"}, cache, valid=valid)
    assert got == {"transport": "a"}
    assert json.loads(path.read_text()) == {"k": {"transport": "a"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new entry is used as it is
        assert decide(_OneRank(), "k", lambda: 1 / 0, TuningCache(str(path)),
                      valid=valid) == {"transport": "a"}
