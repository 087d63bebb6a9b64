"""Every public op as a drawable case: the table the shape sweep (``sweep.py``) and the fault
campaign (``campaign.py``) both draw from.

An entry (a subclass of :class:`Case`) draws a context's sizes (``sizes``) and makes it
(``make``), draws a call every rank shares (``draw``: dims from 1, small primes and values
beside the tile sizes, zero where the op documents an empty dim, per-rank sizes where ranks may
differ, operand layouts of ``layouts.LAYOUTS``, optional operands), makes this rank's operands
(``operands``), runs the call (``call``), computes the torch reference (``reference``, a
collective) and judges a result against it (``judge``). ``refusal`` says why a drawn call must
be refused on every rank. For the campaign's faults an entry also says which of its own faults
apply (``faults``), how one rank's call can differ from its peers' in a size they must share
(``disagree``) and how its operands are made bad (``corrupt``).

Every rank draws the same case from a ``random.Random`` of the same seed, and its own operands
from :func:`step_generator` (seed, step, rank), so no communication is needed to agree.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Optional

import torch

import portable_overlap as po
from ..errors import BackendUnavailable
from ..shmem.providers import ShmemUnavailable
from .compare import rel_err
from .layouts import LAYOUTS, laid_out
from .patterns import GEMM_PATTERNS
from .routing import route

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: largest |result - reference| over the reference's largest magnitude (at least 1), by dtype:
#: a few roundings of the output dtype (the sequential transports sum W rounded products)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: dims that find the edges: 1, small primes, and around 16-, 32- and 64-wide tiles
EDGES = (1, 2, 3, 5, 7, 11, 13, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 97, 127, 128,
         129, 191, 255, 256, 257)
#: what the "auto" transport times per candidate at a new shape's first call: once, untimed
#: runs left out (the interpreter's timings say nothing, and each run costs a call)
AUTO_OPTIONS = {"iters": 1, "warmup": 0}
#: layouts of the tensors a kernel reads row by row with contiguous rows
ROW_LAYOUTS = ("contiguous", "stride_0", "offset", "padded_rows")


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The CPU generator of one rank's operands at one step of a seeded run."""
    return torch.Generator().manual_seed((seed * 100003 + step) * 64 + rank)


def small_tiles():
    """16x16x16 tiles, one warp: the interpreter's programs stay short."""
    from ..ops.matmul import MatmulConfig

    return MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1,
                        num_stages=1)


def _dim(rng: random.Random, hi: int, lo: int = 1, zero: float = 0.0) -> int:
    """A dim in ``lo .. hi``: 0 with probability ``zero``, else an edge value (60 %) or any."""
    if zero and rng.random() < zero:
        return 0
    hi = max(hi, lo)
    edges = [v for v in EDGES if lo <= v <= hi]
    if edges and rng.random() < 0.6:
        return rng.choice(edges)
    return rng.randint(lo, hi)


def _layout(rng: random.Random, choices=LAYOUTS) -> str:
    return "contiguous" if rng.random() < 0.4 else rng.choice(choices)


def dense_layout(rng: random.Random) -> str:
    """A layout for an operand the op takes contiguous only: mostly a contiguous one (the
    offset base among them), now and then another (a call that must be refused)."""
    return rng.choice(("contiguous", "offset")) if rng.random() < 0.9 else rng.choice(LAYOUTS)


def relaid(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t``'s values (2-d) in layout ``how`` of ``LAYOUTS``; ``"stride_0"``: its first row
    expanded to every row (the same values only where the rows are equal)."""
    rows, cols = t.shape
    if how == "stride_0":
        return t[:1].expand(rows, cols) if rows else t
    if how == "transposed":
        return t.t().contiguous().t()
    if how == "every_other_column":
        view = torch.empty(rows, 2 * cols, dtype=t.dtype, device=t.device)[:, ::2]
    elif how == "offset":
        view = torch.empty(rows * cols + 1, dtype=t.dtype, device=t.device)[1:].view(rows, cols)
    elif how == "padded_rows":
        view = torch.empty(rows, cols + 8, dtype=t.dtype, device=t.device)[:, :cols]
    else:
        return t
    view.copy_(t)
    return view


def _lay(shape, how, dtype, world, g: torch.Generator) -> torch.Tensor:
    """``laid_out`` on the rank's device, its values drawn from ``g`` (a CPU generator) there
    or, on a GPU, from a device generator seeded from ``g`` (a layout must be made where it
    lives: moving a strided view to another device packs it)."""
    if world.device.type != "cpu":
        seed = int(torch.randint(2 ** 62, (1,), generator=g))
        g = torch.Generator(device=world.device).manual_seed(seed)
    return laid_out(shape, how, dtype=dtype, device=world.device, gen=g)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- the ops --------------------------------------------------------------------------------
class Case:
    """One public op: ``sizes`` draws a context's sizes, ``make`` makes it, ``draw`` a call
    (every rank the same), ``operands`` this rank's tensors, ``call`` runs it, ``reference``
    (a collective on every rank) and ``out_shape`` for ``out=`` (None: the op takes none)."""

    name = ""
    #: whether every rank's result has one shape (else a strided out may be refused on
    #: some ranks only, which the sweep does not draw)
    same_out_shape = True
    #: whether the op takes ``out=`` (``out_shape`` gives its shape)
    takes_out = True
    #: the campaign's faults of this op's own (``campaign.py``), beside the ones every op takes
    faults: tuple = ()

    def sizes(self, rng, W, max_dim) -> dict:
        return {}

    def make(self, world, transport, sizes, timeout_s):
        raise NotImplementedError

    def draw(self, rng, W, sizes, max_dim, refuse: bool) -> dict:
        raise NotImplementedError

    def operands(self, world, ctx, case, g) -> dict:
        raise NotImplementedError

    def call(self, ctx, case, t, out):
        raise NotImplementedError

    def reference(self, world, ctx, case, t):
        raise NotImplementedError

    def out_shape(self, world, ctx, case, t):
        return None

    def refusal(self, case, W) -> Optional[str]:
        """Why the drawn call (``case``, its transport set) must be refused on every rank, None
        where it is valid; a case that only some ranks would refuse is made valid here."""
        return case.get("refuse")

    def judge(self, got, ref, case) -> tuple:
        """``(error, why)``: the error against the reference, why it fails (None: it passes)."""
        return compare(got, ref, case["dtype"])

    def disagree(self, case) -> Optional[dict]:
        """A copy of the valid ``case`` that differs in a size every rank's call must share and
        still fits the context (the campaign's ``other_shape`` on one rank), or None where no
        such size is left to change. Only for ops whose ``operands`` need no peer."""
        return None

    def corrupt(self, fault: str, t: dict) -> dict:
        """This rank's operands ``t`` with the bad data of ``fault`` (one of ``faults``)."""
        raise NotImplementedError(fault)


def _other_n(case) -> Optional[dict]:
    """``case`` with another N that still fits ``max_n`` (the GEMM patterns' and the GEMV's
    ``disagree``: every rank's product has the same columns)."""
    n = _step(case["dims"]["N"], case["sizes"]["max_n"])
    return None if n is None else _changed(case, "N", n)


def _changed(case, key, value) -> dict:
    """``case`` with ``dims[key]`` set to ``value`` (a copy: the peers keep theirs)."""
    other = copy.deepcopy(case)
    other["dims"][key] = value
    return other


def _step(n: int, hi: int, lo: int = 1) -> Optional[int]:
    """Another value than ``n`` in ``lo .. hi``: one up, else one down; None where neither."""
    return n + 1 if n + 1 <= hi else (n - 1 if n - 1 >= lo else None)


def compare(got, ref, dtype) -> tuple:
    if not isinstance(got, torch.Tensor):
        return math.inf, f"returned {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
        return math.inf, (f"returned {tuple(got.shape)} {got.dtype}, reference "
                          f"{tuple(ref.shape)} {ref.dtype}")
    if got.numel() == 0:
        return 0.0, None
    g, r = got.detach().double().cpu(), ref.detach().double().cpu()
    diff = (g - r).abs()
    if not bool(torch.isfinite(g).all()):
        err = math.inf
    else:
        err = diff.max().item() / max(r.abs().max().item(), 1.0)
    tol = TOL[dtype]
    if err <= tol:
        return err, None
    where = tuple(int(i) for i in torch.nonzero(~(diff <= tol * max(r.abs().max().item(), 1.0)))
                  [0])
    return err, (f"max error {err:.3g} > {tol:g} (relative {rel_err(got, ref):.3g}); first bad "
                 f"element {where}: {g[where].item()!r} vs {r[where].item()!r}")


def _contiguous(shape, how) -> bool:
    """Whether ``laid_out(shape, how)`` is contiguous (it depends on the dims: a transposed
    [1, K] is)."""
    return laid_out(shape, how, gen=torch.Generator()).is_contiguous()


def _extra(transport: str) -> dict:
    return dict(AUTO_OPTIONS) if transport == "auto" else {}


class _Gemm(Case):
    """The three GEMM patterns: ``a_r [M, K_r] @ b_r [K_r, N]`` (+ bias, + residual)."""

    faults = ("other_shape",)

    def __init__(self, name):
        self.name = name
        self.ctx_cls, self.ref_fn, self.rows = GEMM_PATTERNS[name]
        self.split = name != "matmul_all_reduce"  # M divisible by W

    def sizes(self, rng, W, max_dim):
        return {"max_m": W * _dim(rng, max(1, max_dim // W)), "max_n": _dim(rng, max_dim),
                "small_tiles": rng.random() < 0.5, "pieces": rng.choice([None, 1, 2, 3])}

    def make(self, world, transport, s, timeout_s):
        opts = _extra(transport)
        if transport == "stores" and s["small_tiles"]:
            opts["config"] = small_tiles()
        if transport == "copy_engine" and s["pieces"]:
            opts["pieces"] = s["pieces"]
        return self.ctx_cls(world, s["max_m"], s["max_n"], transport=transport,
                            timeout_s=timeout_s, **opts)

    def draw(self, rng, W, s, max_dim, refuse):
        div = W if self.split else 1
        M = div * _dim(rng, s["max_m"] // div, zero=0.1)
        N = _dim(rng, s["max_n"])
        Ks = [_dim(rng, max_dim, zero=0.1) for _ in range(W)]
        case = {"dims": {"M": M, "N": N, "K": Ks},
                "layouts": {"a": _layout(rng), "b": _layout(rng),
                            # a residual with rows that are not contiguous is refused
                            "res": _layout(rng, ROW_LAYOUTS if rng.random() < 0.85
                                           else LAYOUTS)},
                "bias": rng.random() < 0.5, "residual": rng.random() < 0.5}
        if refuse:
            kind = rng.choice(["rows", "split"] if self.split and W > 1 else ["rows"])
            if kind == "rows":  # more rows than max_m, fewer elements than max_m * max_n
                case["dims"].update(M=s["max_m"] + div, N=max(1, s["max_n"] // 4))
            else:
                case["dims"]["M"] = W * max(1, s["max_m"] // W // 2) + 1
            case["refuse"] = kind
        return case

    def refusal(self, c, W):
        if c.get("refuse"):
            return c["refuse"]
        d = c["dims"]
        rows = self.rows(d["M"], W)
        if c["residual"] and laid_out((rows, d["N"]), c["layouts"]["res"],
                                      gen=torch.Generator()).stride(1) != 1:
            return "residual rows not contiguous"
        # its flags are per wave group of rows (README, "No rows")
        if d["M"] == 0 and c["transport"] == "signal_copy_engine":
            return "no rows (signal_copy_engine)"
        return None

    def operands(self, world, ctx, c, g):
        M, N, K = c["dims"]["M"], c["dims"]["N"], c["dims"]["K"][world.rank]
        dt, lay, dev = c["dtype"], c["layouts"], world.device
        rows = M // world.world_size if self.name == "matmul_reduce_scatter" else M
        return {"a": _lay((M, K), lay["a"], dt, world, g),
                "b": _lay((K, N), lay["b"], dt, world, g),
                "bias": (torch.randn(N, generator=g).to(dt).to(dev) if c["bias"] else None),
                "residual": (_lay((rows, N), lay["res"], dt, world, g)
                             if c["residual"] else None)}

    def call(self, ctx, c, t, out):
        return getattr(po, self.name)(t["a"], t["b"], ctx, out, bias=t["bias"],
                                      residual=t["residual"])

    def reference(self, world, ctx, c, t):
        return self.ref_fn(t["a"], t["b"], world.group, t["bias"], t["residual"])

    def out_shape(self, world, ctx, c, t):
        return (self.rows(c["dims"]["M"], world.world_size), c["dims"]["N"])

    def disagree(self, c):
        return _other_n(c)


class _Gemv(Case):
    """``y = sum_r x_r [M, K_r] @ w_r [N, K_r].T``, M in 0..64."""

    name = "gemv_all_reduce"
    faults = ("other_shape",)

    def sizes(self, rng, W, max_dim):
        return {"max_n": _dim(rng, max_dim)}

    def make(self, world, transport, s, timeout_s):
        return po.GemvAllReduce(world, s["max_n"], transport=transport, timeout_s=timeout_s,
                                **_extra(transport))

    def draw(self, rng, W, s, max_dim, refuse):
        case = {"dims": {"M": _dim(rng, 64, zero=0.1), "N": _dim(rng, s["max_n"]),
                         "K": [_dim(rng, max_dim, zero=0.1) for _ in range(W)]},
                "layouts": {k: dense_layout(rng) for k in ("x", "w")}}
        if refuse:
            kind = rng.choice(["M", "N"])
            case["dims"]["M" if kind == "M" else "N"] = 65 if kind == "M" else s["max_n"] + 1
            case["refuse"] = kind
        return case

    def refusal(self, c, W):
        if c.get("refuse"):
            return c["refuse"]
        d, lay = c["dims"], c["layouts"]
        flat = [not (_contiguous((d["M"], k), lay["x"]) and _contiguous((d["N"], k), lay["w"]))
                for k in d["K"]]
        if all(flat):  # the op takes contiguous x and w only
            return "not contiguous"
        if any(flat):  # some ranks only: drawn as a valid call
            c["layouts"] = {"x": "contiguous", "w": "contiguous"}
        return None

    def operands(self, world, ctx, c, g):
        d, lay, dt = c["dims"], c["layouts"], c["dtype"]
        K = d["K"][world.rank]
        return {"x": _lay((d["M"], K), lay["x"], dt, world, g),
                "w": _lay((d["N"], K), lay["w"], dt, world, g)}

    def call(self, ctx, c, t, out):
        return po.gemv_all_reduce(t["x"], t["w"], ctx, out)

    def reference(self, world, ctx, c, t):
        return po.gemv_all_reduce_reference(t["x"], t["w"], world.group)

    def out_shape(self, world, ctx, c, t):
        return (c["dims"]["M"], c["dims"]["N"])

    def disagree(self, c):
        return _other_n(c)


class _AllGather(Case):
    """``cat(all_gather(a_r [m, K])) @ b [K, N]``."""

    name = "all_gather_matmul"
    # every rank gathers shards of one height (its own N is its own b's)
    faults = ("other_shape",)

    def sizes(self, rng, W, max_dim):
        return {"max_elems": _dim(rng, max_dim * max_dim // 2, lo=max_dim),
                "pieces": rng.choice([None, 1, 2, 3])}

    def make(self, world, transport, s, timeout_s):
        opts = _extra(transport)
        if transport == "copy_engine" and s["pieces"]:
            opts["pieces"] = s["pieces"]
        return po.AllGatherMatmul(world, s["max_elems"], transport=transport,
                                  timeout_s=timeout_s, **opts)

    def draw(self, rng, W, s, max_dim, refuse):
        from ..ops.allgather_gemm.api import SCHEDULES

        K = _dim(rng, min(max_dim, s["max_elems"]))
        m = min(_dim(rng, max_dim, zero=0.1), s["max_elems"] // K)
        case = {"dims": {"m": m, "K": K, "N": _dim(rng, max_dim)},
                "layouts": {"a": dense_layout(rng), "b": _layout(rng)},
                "schedule": (rng.choice(SCHEDULES) if rng.random() < 0.5 else None)}
        if refuse:
            case["dims"]["m"] = s["max_elems"] // K + 1
            case["refuse"] = "shard past max_shard_elems"
        return case

    def refusal(self, c, W):
        if c.get("refuse"):
            return c["refuse"]
        if not _contiguous((c["dims"]["m"], c["dims"]["K"]), c["layouts"]["a"]):
            return "a not contiguous"  # its rows are copied whole
        if c["dims"]["m"] == 0 and c["transport"] == "stores":
            return "no rows (stores)"
        if c["schedule"] and c["transport"] not in ("copy_engine", "auto"):
            return "schedule of another transport"
        return None

    def operands(self, world, ctx, c, g):
        d, lay, dt = c["dims"], c["layouts"], c["dtype"]
        return {"a": _lay((d["m"], d["K"]), lay["a"], dt, world, g),
                "b": _lay((d["K"], d["N"]), lay["b"], dt, world, g)}

    def call(self, ctx, c, t, out):
        if c["schedule"]:
            return ctx(t["a"], t["b"], out=out, schedule=c["schedule"])
        return po.all_gather_matmul(t["a"], t["b"], ctx, out)

    def reference(self, world, ctx, c, t):
        return po.all_gather_matmul_reference(t["a"], t["b"], world.group)

    def out_shape(self, world, ctx, c, t):
        return (c["dims"]["m"] * world.world_size, c["dims"]["N"])

    def disagree(self, c):
        d = c["dims"]
        lo = 1 if c["transport"] == "stores" else 0  # (no rows is refused there)
        m = _step(d["m"], c["sizes"]["max_elems"] // d["K"], lo)
        return None if m is None else _changed(c, "m", m)


def _moe_sizes(rng, W, max_dim):
    E = rng.randint(1, 3)
    return {"E": E, "k": rng.randint(1, min(4, E * W)), "H": _dim(rng, max_dim),
            "max_tokens": _dim(rng, max_dim)}


def _routing(rng, W, s, refuse_tokens: bool = False) -> dict:
    kinds = ["uniform", "zipf", "first_expert"] + (["one_rank"] if s["k"] <= s["E"] else [])
    S = [_dim(rng, s["max_tokens"], zero=0.15) for _ in range(W)]
    return {"S": S, "route": rng.choice(kinds),
            "ids": rng.choice(["int32", "int64"])}


class _Dispatch(Case):
    """``x, counts, slots = moe_dispatch(tokens [S_r, H], topk_ids [S_r, k])``."""

    name = "moe_dispatch"
    same_out_shape = False
    takes_out = False
    faults = ("bad_routing",)

    def sizes(self, rng, W, max_dim):
        return dict(_moe_sizes(rng, W, max_dim), dtype=rng.choice(DTYPES))

    def make(self, world, transport, s, timeout_s):
        return po.MoeDispatch(world, max_tokens=s["max_tokens"], top_k=s["k"], hidden=s["H"],
                              experts_per_rank=s["E"], dtype=s["dtype"], transport=transport,
                              timeout_s=timeout_s, **_extra(transport))

    def draw(self, rng, W, s, max_dim, refuse):
        case = {"dims": _routing(rng, W, s), "layouts": {"tokens": _layout(rng, ROW_LAYOUTS)},
                "dtype": s["dtype"]}
        if refuse:
            kind = rng.choice(["tokens", "layout"] if s["H"] > 1 else ["tokens"])
            if kind == "tokens":
                case["dims"]["S"] = [s["max_tokens"] + 1] * W
            else:  # rows that are not contiguous: every rank has two or more
                case["dims"]["S"] = [max(2, n) for n in case["dims"]["S"]]
                case["layouts"]["tokens"] = rng.choice(["transposed", "every_other_column"])
            case["refuse"] = kind
        return case

    def operands(self, world, ctx, c, g):
        d, W = c["dims"], world.world_size
        S = d["S"][world.rank]
        s = c["sizes"]
        ids = route(d["route"], S, s["E"] * W, s["k"], W, g).to(getattr(torch, d["ids"]))
        return {"tokens": _lay((S, s["H"]), c["layouts"]["tokens"], c["dtype"], world, g),
                "ids": ids.to(world.device)}

    def call(self, ctx, c, t, out):
        for buf in ("recv", "recv_slots"):  # what a call fills: poisoned first
            b = getattr(ctx, buf, None)
            if isinstance(b, torch.Tensor):
                b.fill_(float("nan") if b.is_floating_point() else -7)
        return po.moe_dispatch(t["tokens"], t["ids"], ctx)

    def reference(self, world, ctx, c, t):
        return po.moe_dispatch_reference(t["tokens"], t["ids"], c["sizes"]["E"], world.group)

    def corrupt(self, fault, t):
        ids = t["ids"].clone()
        if ids.numel():
            ids.view(-1)[0] = 1 << 20  # an expert no rank holds
        return dict(t, ids=ids)

    def judge(self, got, ref, c):
        x, counts, slots = got
        xr, cr, sr = ref
        n = xr.shape[0]
        if not torch.equal(counts.cpu(), cr.cpu()):
            return math.inf, f"counts {counts.tolist()} != {cr.tolist()}"
        if slots.shape[0] < n or not torch.equal(slots[:n].cpu(), sr.cpu()):
            return math.inf, f"slots {slots[:n].tolist()} != {sr.tolist()}"
        if x.shape[0] < n or x.dtype != xr.dtype or not torch.equal(x[:n].cpu(), xr.cpu()):
            bad = (x[:n].cpu().double() - xr.cpu().double()).abs()
            return math.inf, f"rows differ from the reference (max |diff| {bad.max().item()})"
        return 0.0, None


class _Combine(Case):
    """``out = moe_gemm_combine(x, w, counts, slots, topk_weights)`` on the dispatch layout."""

    name = "moe_gemm_combine"
    same_out_shape = False
    faults = ("bad_routing",)

    def sizes(self, rng, W, max_dim):
        from ..ops.moe_combine.api import WALKS

        return dict(_moe_sizes(rng, W, max_dim), walk=rng.choice(WALKS),
                    small_tiles=rng.random() < 0.5)

    def make(self, world, transport, s, timeout_s):
        opts = _extra(transport)
        if s["small_tiles"]:
            opts["config"] = small_tiles()
        return po.MoeGemmCombine(world, max_tokens=s["max_tokens"], top_k=s["k"],
                                 hidden=s["H"], experts_per_rank=s["E"], transport=transport,
                                 timeout_s=timeout_s, walk=s["walk"], **opts)

    def draw(self, rng, W, s, max_dim, refuse):
        case = {"dims": dict(_routing(rng, W, s), I=_dim(rng, max_dim)),
                "layouts": {"x": rng.choice(LAYOUTS[:2] + LAYOUTS[3:]),
                            "w": rng.choice(["contiguous", "transposed"]),
                            "topk": _layout(rng, ("contiguous", "transposed", "offset"))},
                "topk_fp32": rng.random() < 0.5}
        if refuse:
            case["dims"]["S"] = [s["max_tokens"] + 1] * W
            case["refuse"] = "tokens"
        return case

    def operands(self, world, ctx, c, g):
        d, s, W, dt = c["dims"], c["sizes"], world.world_size, c["dtype"]
        S, I, dev = d["S"][world.rank], d["I"], world.device
        ids = route(d["route"], S, s["E"] * W, s["k"], W, g).to(getattr(torch, d["ids"]))
        tokens = torch.randn(S, I, generator=g).to(dt)
        x, counts, slots = po.moe_dispatch_reference(tokens, ids, s["E"], world.group)
        w = torch.randn(s["E"], I, s["H"], generator=g) / max(I, 1) ** 0.5
        if c["layouts"]["w"] == "transposed":  # [E, I, H] view of an [E, H, I] tensor
            w = w.transpose(1, 2).contiguous().transpose(1, 2)
        topk = torch.softmax(torch.randn(S, s["k"], generator=g), dim=1)
        topk = topk if c["topk_fp32"] else topk.to(dt)
        return {"x": relaid(x.to(dev), c["layouts"]["x"]), "w": w.to(dt).to(dev),
                "counts": counts.to(dev), "slots": slots.to(dev),
                "topk": relaid(topk.to(dev), c["layouts"]["topk"])}

    def call(self, ctx, c, t, out):
        return po.moe_gemm_combine(t["x"], t["w"], t["counts"], t["slots"], t["topk"], ctx,
                                   out)

    def reference(self, world, ctx, c, t):
        return po.moe_gemm_combine_reference(t["x"], t["w"], t["counts"], t["slots"],
                                             t["topk"], world.group)

    def out_shape(self, world, ctx, c, t):
        return (t["topk"].shape[0], c["sizes"]["H"])

    def corrupt(self, fault, t):
        slots = t["slots"].clone()
        if slots.numel() >= 2:  # two rows to one slot: some slot of the owner gets no row
            slots[1] = slots[0]
        return dict(t, slots=slots)


class _Embedding(Case):
    """Pooled lookups of table-wise sharded tables, then the All-to-All to the batch owners."""

    name = "embedding_all_to_all"
    same_out_shape = False
    # an index past its table, found by the device's check (``ctx.validate = False``) or by
    # the host's; a batch split the ranks do not share
    faults = ("bad_index", "other_shape")

    def sizes(self, rng, W, max_dim):
        T = rng.randint(1, 5)
        return {"rows": [_dim(rng, max_dim) for _ in range(T)], "D": _dim(rng, max_dim),
                "ranks": [rng.randrange(W) for _ in range(T)],
                "max_batch": _dim(rng, 8), "block_b": rng.choice([None, 1, 2, 4])}

    def make(self, world, transport, s, timeout_s):
        return po.EmbeddingAllToAll(world, s["rows"], s["D"], s["max_batch"],
                                    table_ranks=s["ranks"], transport=transport,
                                    timeout_s=timeout_s, block_b=s["block_b"],
                                    **_extra(transport))

    def draw(self, rng, W, s, max_dim, refuse):
        splits = [rng.randint(0, s["max_batch"]) for _ in range(W)]
        pooling = rng.choice(["sum", "mean"])
        every_rank = set(s["ranks"]) == set(range(W))
        case = {"dims": {"splits": splits, "max_len": rng.choice([0, 1, 2, 5])},
                "pooling": pooling, "psw": pooling == "sum" and rng.random() < 0.4,
                "index_dtype": rng.choice(["int32", "int64"]), "layouts": {},
                # no batch split given: the even split the lengths imply
                "pass_splits": not (every_rank and len(set(splits)) == 1
                                    and rng.random() < 0.5)}
        if refuse:
            kinds = ["batch"] + ([] if every_rank else ["no splits"])
            if all(s["ranks"].count(q) and sum(s["rows"][t] for t in range(len(s["rows"]))
                                               if s["ranks"][t] == q) > 1 for q in range(W)):
                kinds.append("layout")
            kind = rng.choice(kinds)
            if kind == "batch":
                case["dims"]["splits"] = [s["max_batch"] + 1] * W
            elif kind == "no splits":
                case["pass_splits"] = False
            else:
                case["layouts"]["weight"] = "padded_rows"
            case["refuse"] = kind
        return case

    def operands(self, world, ctx, c, g):
        d, dt, dev = c["dims"], c["dtype"], world.device
        B = sum(d["splits"])
        weight = _lay((ctx.weight_rows, ctx.dim), c["layouts"].get("weight"), dt, world, g)
        lengths = torch.randint(0, d["max_len"] + 1, (ctx.n_loc * B,), generator=g)
        idx = [torch.randint(0, ctx.plan.table_rows[t], (int(lengths[j * B:(j + 1) * B].sum()),),
                             generator=g) for j, t in enumerate(ctx.local_tables)]
        itype = getattr(torch, c["index_dtype"])
        indices = (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)).to(itype)
        psw = torch.rand(indices.numel(), generator=g).to(dt) if c["psw"] else None
        return {"weight": weight, "lengths": lengths.to(itype).to(dev),
                "indices": indices.to(dev), "psw": None if psw is None else psw.to(dev),
                "splits": tuple(d["splits"]) if c["pass_splits"] else None}

    def call(self, ctx, c, t, out):
        return ctx(t["weight"], t["lengths"], t["indices"], t["psw"], batch_splits=t["splits"],
                   pooling=c["pooling"], out=out)

    def reference(self, world, ctx, c, t):
        return po.embedding_all_to_all_reference(
            t["weight"], t["lengths"], t["indices"], t["psw"], ctx.plan, world.rank,
            tuple(c["dims"]["splits"]), c["pooling"], world.group)

    def out_shape(self, world, ctx, c, t):
        return ctx.output_shape(tuple(c["dims"]["splits"]))

    def corrupt(self, fault, t):
        indices = t["indices"].clone()
        if indices.numel():
            indices[-1] = 1 << 20  # past every table
        return dict(t, indices=indices)

    def disagree(self, c):
        splits = list(c["dims"]["splits"])
        n = _step(splits[0], c["sizes"]["max_batch"], 0)
        if n is None:
            return None
        other = _changed(c, "splits", [n] + splits[1:])
        other["pass_splits"] = True  # (lengths alone would imply a split that may not exist)
        return other


def transports(name: str) -> tuple:
    """What a step draws from for op ``name``: its transports and ``"auto"``."""
    return tuple(po.SPECS[name].transports) + ("auto",)


def draw_context(rng, entry, W, max_dim, ctxs: dict, unavailable: dict, make, *,
                 leave_out: tuple = (), remake_rate: Optional[float] = None,
                 close=None) -> tuple:
    """One step's transport of ``entry``'s op and its context, the same on every rank: a
    transport of :func:`transports` not in ``leave_out`` nor found ``unavailable`` (op ->
    {transport: why}, filled here on every rank alike where making its context raises
    ``BackendUnavailable`` / ``ShmemUnavailable``), and the context ``ctxs`` holds for it
    ((op, transport) -> (context, its sizes)), made by ``make(entry, transport, sizes)`` at
    the first use and, with probability ``remake_rate``, anew (``close(key)`` frees the old
    one first). Sizes are drawn at every step, so the draws stay in step. Returns the key."""
    name = entry.name
    while True:
        usable = [t for t in transports(name)
                  if t not in unavailable.get(name, {}) and t not in leave_out]
        transport = rng.choice(usable)
        key = (name, transport)
        remake = key not in ctxs or (remake_rate is not None and rng.random() < remake_rate)
        sizes = entry.sizes(rng, W, max_dim)
        if not remake:
            return key
        if close is not None:
            close(key)
        try:
            ctxs[key] = (make(entry, transport, sizes), sizes)
            return key
        except (BackendUnavailable, ShmemUnavailable) as e:
            unavailable.setdefault(name, {})[transport] = str(e)[:200]


def all_cases() -> dict:
    """Every public op's entry, by name (the order of ``po.OPS``)."""
    entries = {op.name: op for op in (_Embedding(), _Gemv(), _Dispatch(), _Combine(),
                                      _AllGather())}
    entries.update({name: _Gemm(name) for name in GEMM_PATTERNS})
    return {name: entries[name] for name in po.OPS}
