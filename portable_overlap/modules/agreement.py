"""The modules' argument agreement: what makes their construction a collective set-up."""
from __future__ import annotations


def kind(obj) -> object:
    """What the ranks compare of a per-rank object argument (a context given): its class name,
    or None where it was not given (a rank that makes its own context meets its peers in that
    context's set-up, which a rank given one never enters)."""
    return None if obj is None else type(obj).__name__


def same_arguments(world, name: str, **args) -> None:
    """Raise :class:`~portable_overlap.errors.RankMismatchError` on every rank if the ranks
    built the module ``name`` with different ``args`` (one host collective). A module calls it
    after its own checks of its arguments and before it makes any context: with
    ``collective_setup`` on its ``__init__``, a check that fails on one rank is then told to
    the peers waiting here (``PeerSetupError``), and arguments that differ raise here on every
    rank, where a rank that makes a context its peers do not (``fused``, ``ctx``, ``max_rows``)
    would wait in that context's set-up until the process group's timeout, and sizes that
    differ would mix layers of different shapes."""
    from ..errors import RankMismatchError

    values = world.all_gather_object(tuple(args.values()))
    differ = [i for i, a in enumerate(args) if any(v[i] != values[0][i] for v in values)]
    if differ:  # only the arguments that differ: a module has a dozen
        names = list(args)
        each = ["{}: {}".format(names[i], ", ".join(f"rank {r}: {v[i]!r}"
                                                    for r, v in enumerate(values)))
                for i in differ]
        raise RankMismatchError(f"{name}: the ranks passed different arguments (every rank must "
                                f"pass the same): " + "; ".join(each))
