"""The command line every benchmark shares (pure Python; nothing here touches a GPU):

    --shapes 8192x8192x4096,16384x7168x2048  problem sizes, parsed into the op's named dims
    --dtypes bf16,fp16                        element types (each benchmark lists what it takes)
    --worlds 2,4,8                            world sizes to run (see below)
    --out PATH                                results JSONL file, or a folder: <folder>/<kind>.jsonl
    --device-kind KIND                        the device in the rows (default $PO_DEVICE_KIND)
    --iters N --warmup N                      timed (>= 50) and warm-up (>= 0) iterations per impl
    --graph plain,graph | --no-graph | --no-plain   plain launches and / or CUDA-graph replay
    --check / --no-check                      check each fused impl against the reference first

``--worlds``: a benchmark started without a launcher runs itself under torchrun once per listed
world size (sizes above the visible GPU count are skipped); one started by torchrun or mpirun
runs only if its world size is listed, and otherwise says it skips and exits 0.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from typing import Callable, Mapping, Optional, Sequence

from benchmarks.rows import results_path

DTYPE_NAMES = ("fp32", "fp16", "bf16", "fp8")
#: the protocol's fewest timed iterations per impl: a row's median is of at least this many
MIN_ITERS = 50
_GRAPH_WORDS = {"0": False, "plain": False, "eager": False, "1": True, "graph": True}


def split_names(text: str) -> list:
    """``"fused[stores,senders=16],auto"`` -> ``["fused[stores,senders=16]", "auto"]``: a comma
    list of impl names, whose brackets may hold commas."""
    names, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            names.append(cur)
            cur = ""
        else:
            cur += ch
    return [n.strip() for n in (*names, cur) if n.strip()]


def parse_shapes(text: str, dims: Sequence[str]) -> list:
    """``"8192x8192x4096,16384x7168x2048"`` -> ``[{dims[0]: 8192, ...}, ...]``: each shape has
    one positive integer per name in ``dims``, in that order; ValueError says what is wrong."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.lower().replace("×", "x").split("x")
        if len(parts) != len(dims):
            raise ValueError(f"shape {item!r}: expected {len(dims)} sizes "
                             f"{'x'.join(dims)}, got {len(parts)}")
        try:
            vals = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"shape {item!r}: sizes must be integers ({'x'.join(dims)})") \
                from None
        if any(v <= 0 for v in vals):
            raise ValueError(f"shape {item!r}: sizes must be positive")
        out.append(dict(zip(dims, vals)))
    return out


def format_shape(shape: Mapping, dims: Optional[Sequence[str]] = None) -> str:
    """The inverse of ``parse_shapes`` for a label: the integer sizes (of ``dims`` when given)
    joined by ``x``, then any text values (such as a routing) after a space."""
    keys = list(dims) if dims is not None else list(shape)
    nums = [str(shape[k]) for k in keys if isinstance(shape.get(k), int)]
    words = [str(shape[k]) for k in keys if isinstance(shape.get(k), str)]
    return " ".join(["x".join(nums)] + words)


def parse_ints(text: str, flag: str = "", lo: Optional[int] = None) -> list:
    """``"2,4,8"`` -> ``[2, 4, 8]`` (empty items ignored); with ``lo``, each at least ``lo``.
    ValueError names ``flag`` where given."""
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        out = None
    if out is None or (lo is not None and any(v < lo for v in out)):
        what = "integers" if lo is None else f"integers >= {lo}"
        raise ValueError(f"{flag or 'list'} {text!r}: a comma list of {what}")
    return out


def int_list(lo: int, empty: bool = True) -> Callable[[str], str]:
    """An argparse ``type=`` for a script's comma list of integers >= ``lo`` (none allowed where
    ``empty``): the text is checked at parse time and returned as given, for the script to
    split with ``parse_ints`` once its world is up, where an item that is no integer, or a
    list the script indexes left empty, raised after the launch."""
    def check(text: str) -> str:
        try:
            values = parse_ints(text, lo=lo)
        except ValueError:
            values = None
        if values is None or not (values or empty):
            raise argparse.ArgumentTypeError(
                f"{text!r}: a {'' if empty else 'non-empty '}comma list of integers >= {lo}")
        return text

    return check


def one_shape(dims: Sequence[str]) -> Callable[[str], str]:
    """An argparse ``type=``: the text of exactly one shape of ``dims`` (``parse_shapes``),
    returned as given."""
    def check(text: str) -> str:
        try:
            n = len(parse_shapes(text, dims))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if n != 1:
            raise argparse.ArgumentTypeError(f"{text!r}: one shape {'x'.join(dims)}")
        return text

    return check


def parse_dtypes(text: str, allowed: Sequence[str]) -> list:
    """``"bf16,fp16"`` -> ``["bf16", "fp16"]``, each one of ``allowed``."""
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [d for d in out if d not in allowed]
    if bad or not out:
        raise ValueError(f"dtypes {bad or text!r}: this benchmark takes {', '.join(allowed)}")
    return out


def parse_choices(text: str, allowed: Sequence[str], flag: str) -> list:
    """``"a,b"`` -> ``["a", "b"]``, each one of ``allowed``: ValueError naming ``flag``. The
    scripts' own lists (routings, modes, ops, dists) take anything else for their last word (a
    routing not ``"zipf"`` is balanced), and their rows would carry the name given."""
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [x for x in out if x not in allowed]
    if bad or not out:
        raise ValueError(f"{flag} {bad or text!r}: a comma list of {', '.join(allowed)}")
    return out


def parse_graph_modes(text: str) -> tuple:
    """``"plain,graph"`` (or ``"0,1"``, ``"both"``) -> ``(False, True)``: False is plain
    launches, True CUDA-graph replay; order kept, duplicates dropped."""
    words = ["plain", "graph"] if text.strip() == "both" else \
        [s.strip().lower() for s in text.split(",") if s.strip()]
    bad = [w for w in words if w not in _GRAPH_WORDS]
    if bad or not words:
        raise ValueError(f"graph modes {text!r}: a comma list of plain / graph (or 0 / 1)")
    return tuple(dict.fromkeys(_GRAPH_WORDS[w] for w in words))


def launched_world_size(env: Mapping) -> Optional[int]:
    """The world size a launcher gave this process (torchrun, Open MPI, MPICH), None when it
    was started on its own."""
    for key in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if env.get(key):
            return int(env[key])
    return None


def launch_plan(worlds: Sequence[int], n_devices: int) -> tuple:
    """(world sizes to launch, world sizes skipped because this machine has fewer devices)."""
    return ([w for w in worlds if w <= n_devices], [w for w in worlds if w > n_devices])


def this_script() -> list:
    """How torchrun starts the running benchmark again: as the module it was started as
    (``python -m benchmarks.bench_x``: ``["-m", "benchmarks.bench_x"]``, which the children
    import from the same working directory), else as its file."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return ["-m", spec.name] if spec is not None else [os.path.abspath(sys.argv[0])]


def torchrun_command(script, argv: Sequence[str], world: int, port: int) -> list:
    """The command that runs ``script argv`` on ``world`` ranks of this machine; ``script``: a
    file, or the arguments that name it (``["-m", module]``)."""
    target = [script] if isinstance(script, str) else list(script)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
            "--master-port", str(port), *target, *argv]


def launch(script, argv: Sequence[str], worlds: Sequence[int]) -> int:
    """Runs ``script`` (as :func:`torchrun_command` takes it) under torchrun once per world size
    that fits the visible devices, one after another; returns the first non-zero exit status,
    2 where no world fits (the benchmarks' code for "cannot run here", as without GPUs; a
    wrong result is 1), else 0."""
    import torch  # only here: parsing and --help never touch a device

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    todo, skipped = launch_plan(worlds, n)
    for w in skipped:
        print(f"world {w}: skipped, {n} device(s) visible", flush=True)
    if not todo:  # (a job given the wrong machine must not pass having run nothing)
        print(f"no world of --worlds {','.join(map(str, worlds))} fits the {n} device(s) "
              f"visible: nothing was run", flush=True)
        return 2
    rc = 0
    for w in todo:
        name = os.path.basename(script) if isinstance(script, str) else script[-1]
        print(f"world {w}: {name} under torchrun", flush=True)
        got = subprocess.run(torchrun_command(script, argv, w, 29500 + random.randrange(1000)))
        rc = rc or got.returncode
    return rc


class BenchParser(argparse.ArgumentParser):
    """An ArgumentParser with the shared options; ``parse_args`` returns them parsed:
    ``shapes`` a list of {dim: size} (the benchmark's defaults when not given), ``dtypes`` a
    list of names, ``graphs`` a tuple of bools, ``worlds`` a list of ints or None, ``out`` the
    JSONL path, ``check`` a bool."""

    def __init__(self, description: str, *, dims: Sequence[str], shapes: Sequence,
                 dtypes: Sequence[str] = ("bf16",), allowed_dtypes: Optional[Sequence] = None,
                 iters: int = 50, warmup: int = 10, graphs: Sequence[bool] = (False, True),
                 shapes_help: str = "", split_dims: Sequence[str] = ()):
        super().__init__(description=description,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
        self.dims = tuple(dims)
        #: the dims each rank holds a 1/world share of: ``run_main`` refuses a shape whose
        #: size there the world does not divide (the script would run another shape than
        #: asked, or fail deep inside)
        self.split_dims = tuple(split_dims)
        if split_dims:
            shapes_help += (f"({', '.join(split_dims)} must divide by the world size: each "
                            f"rank holds a share) ")
        self.default_shapes = [dict(zip(self.dims, s)) if not isinstance(s, Mapping) else dict(s)
                               for s in shapes]
        self.allowed_dtypes = tuple(allowed_dtypes or dtypes)
        #: (dest, flag, allowed) of the comma-list options added by ``add_choices``
        self.choice_lists: list = []
        g = self.add_argument_group("shared benchmark options")
        g.add_argument("--out", required=True,
                       help="results JSONL file, or a folder (then <folder>/<device-kind>.jsonl)")
        g.add_argument("--device-kind", default=os.environ.get("PO_DEVICE_KIND", "unknown"),
                       help="device kind recorded in every row (default: $PO_DEVICE_KIND or "
                            "'unknown')")
        shown = ",".join(format_shape(s, self.dims) for s in self.default_shapes)
        g.add_argument("--shapes", default="",
                       help=f"{'x'.join(self.dims)},... {shapes_help}(default: {shown})")
        g.add_argument("--dtypes", default=",".join(dtypes),
                       help=f"comma list of {', '.join(self.allowed_dtypes)} "
                            f"(default: %(default)s)")
        g.add_argument("--worlds", default="",
                       help="comma list of world sizes: started alone, run under torchrun once "
                            "per size; under a launcher, skip unless its size is listed")
        g.add_argument("--iters", type=int, default=iters,
                       help=f"timed iterations per impl, at least {MIN_ITERS} "
                            f"(default: %(default)s)")
        g.add_argument("--warmup", type=int, default=warmup,
                       help="warm-up iterations per impl (default: %(default)s)")
        g.add_argument("--graph", default=",".join("graph" if x else "plain" for x in graphs),
                       help="comma list of plain (plain launches) and graph (CUDA-graph "
                            "replay), or 0 / 1 (default: %(default)s)")
        g.add_argument("--no-graph", action="store_true", help="plain launches only")
        g.add_argument("--no-plain", action="store_true", help="CUDA-graph replay only")
        # (more than one round by default: in one, every case times ``fused`` first, the
        # order a drifting clock favours, by 9-13% for one kernel on one H100)
        g.add_argument("--rounds", type=int, default=3,
                       help="time the impls in this many rounds of --iters each, the order "
                            "rotated each round, and keep each impl's round with the median "
                            "median: a GPU's clock drifts within a run, and a fixed order "
                            "favours the impls timed first (default: %(default)s)")
        g.add_argument("--barrier", choices=("device", "host"), default="device",
                       help="the barrier before each timed iteration: on the stream, the host "
                            "running ahead (device), or of the hosts (host), which adds the "
                            "gap between the ranks' hosts to every op that waits for its peers "
                            "(benchmarks/harness.py; default: %(default)s)")
        g.add_argument("--impls", default="",
                       help="comma list of the impls to check and time (default: every one "
                            "the benchmark has)")
        g.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                       help="check every fused impl against the reference before timing it; "
                            "a wrong one is not timed (default: on)")

    def add_choices(self, flag: str, allowed: Sequence[str], default: str, help: str = ""):
        """A script's comma-list option whose items must be among ``allowed``, checked by
        ``parse_args`` (the value stays the text given)."""
        action = self.add_argument(flag, default=default,
                                   help=f"{help}comma list of {', '.join(allowed)} "
                                        f"(default: %(default)s)")
        self.choice_lists.append((action.dest, flag, tuple(allowed)))
        return action

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        try:
            ns.shapes = parse_shapes(ns.shapes, self.dims) or [dict(s)
                                                               for s in self.default_shapes]
            ns.dtypes = parse_dtypes(ns.dtypes, self.allowed_dtypes)
            ns.worlds = parse_ints(ns.worlds, "--worlds", lo=1) or None
            graphs = parse_graph_modes(ns.graph)
            for dest, flag, allowed in self.choice_lists:
                parse_choices(getattr(ns, dest), allowed, flag)
        except ValueError as e:
            self.error(str(e))
        # an empty --out failed at the first row's open, after the first case was timed; a
        # device kind names the file inside an --out folder
        if not ns.out.strip():
            self.error("--out '': give a results file or a folder")
        if not ns.device_kind.strip() or os.sep in ns.device_kind or "/" in ns.device_kind:
            self.error(f"--device-kind {ns.device_kind!r}: a non-empty name without '/' (it "
                       f"names the results file inside an --out folder)")
        # no timed iteration: every impl's median failed (an empty list) and no row was written;
        # fewer than the protocol's MIN_ITERS: rows whose median is of too few runs, with
        # nothing in the row to tell them from the protocol's
        for flag, value, lo in (("--iters", ns.iters, MIN_ITERS), ("--warmup", ns.warmup, 0),
                                ("--rounds", ns.rounds, 1)):
            if value < lo:
                self.error(f"{flag} {value}: must be at least {lo}")
        graphs = tuple(g for g in graphs if not (g and ns.no_graph) and not (not g and ns.no_plain))
        if not graphs:
            self.error("no graph mode left to time (--no-graph and --no-plain together?)")
        ns.graphs = graphs
        ns.impls = tuple(split_names(ns.impls))
        ns.out = results_path(ns.out, ns.device_kind)
        return ns
