"""A seeded, randomized sweep of every public op through every transport the backend can run,
at shapes, dtypes and operand layouts that no test lists, against the op's torch reference.

Every rank draws the same sequence from the seed (``random.Random(seed)``; no communication is
needed to agree on it), and its own operands from a generator seeded by (seed, step, rank).
Each step draws:

- an op of ``po.OPS`` and one of its transports (``po.SPECS[op].transports``, and ``"auto"``
  timing its candidates once each); a transport the library says cannot run here
  (``BackendUnavailable``, ``ShmemUnavailable`` when its context is made, on every rank) is
  recorded as unavailable and not drawn again;
- the context: reused from an earlier step of the same op and transport (so one context
  serves calls of different shapes, up to the sizes it was made for: ``max_m`` / ``max_n``,
  ``max_n``, ``max_shard_elems``, ``max_tokens``, ``max_local_batch``) or, at the first use and
  with probability ``remake_rate``, made anew with freshly drawn sizes;
- dims from 1, small primes and values beside the tile sizes (15, 16, 17, 31, 33, ...) up to
  ``max_dim``, zero where the op documents an empty dim (no rows; an empty K shard on some
  ranks; no tokens; empty bags and batch shards), per-rank sizes where the op lets ranks differ
  (a reduction's K, MoE token counts, embedding batch splits);
- a dtype the op takes (bf16, fp16, fp32), the operand layouts of ``layouts.LAYOUTS`` that the
  op takes (transposed, every other column, stride 0, a misaligned base, padded rows), the
  optional operands (bias, residual, per-sample weights), ``out=`` or none;
- with probability ``refuse_rate`` a call the op documents as invalid (past the context's
  sizes, rows that do not split over the ranks, a layout it does not take, no batch split
  where a rank holds no tables): every rank must raise ``ValueError`` / ``TypeError``, and the
  context must serve the next call.

Checked on every rank and step: a valid call returns a result of the reference's shape and
dtype whose largest error, relative to the reference's largest magnitude, is within ``TOL`` of
its dtype (outputs and receive buffers are poisoned with NaN first, so an element never
written fails); the dispatch's counts, slots and rows match exactly. A valid call that raises,
an invalid one that returns, and an error of another kind are failures. After a call that
raised an error other than a refusal on any rank, every rank remakes that context (the ranks
agree on it in one small host collective per step).

The report names each step (op, transport, dtype, dims, layouts, options) and each failure
with its seed, step and rank and the error, so a failure is a reproducible case:
``run_sweep(world, seed, step + 1)`` on a world of the same size, with the same ``ops`` and
bounds, replays it (the draws depend on them).
"""
from __future__ import annotations

import math
import random
import time
from typing import Callable, Optional

import torch

import portable_overlap as po
from ..errors import BackendUnavailable, PortableOverlapError
from ..shmem.providers import ShmemUnavailable
from .campaign import _gen as step_generator, _small_tiles
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


def _dense_layout(rng: random.Random) -> str:
    """A layout for an operand the op takes contiguous only: mostly a contiguous one (the
    offset base among them), now and then another (a call that must be refused)."""
    return rng.choice(("contiguous", "offset")) if rng.random() < 0.9 else rng.choice(LAYOUTS)


def _relaid(t: torch.Tensor, how: str) -> torch.Tensor:
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


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- the ops --------------------------------------------------------------------------------
class _Op:
    """One public op: ``sizes`` draws a context's sizes, ``make`` makes it, ``draw`` a call
    (every rank the same), ``operands`` this rank's tensors, ``call`` runs it, ``reference``
    (a collective on every rank) and ``out_shape`` for ``out=`` (None: the op takes none)."""

    name = ""
    #: whether every rank's result has one shape (else a strided out may be refused on
    #: some ranks only, which the sweep does not draw)
    same_out_shape = True

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
        return _compare(got, ref, case["dtype"])


def _compare(got, ref, dtype) -> tuple:
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


class _Gemm(_Op):
    """The three GEMM patterns: ``a_r [M, K_r] @ b_r [K_r, N]`` (+ bias, + residual)."""

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
            opts["config"] = _small_tiles()
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


class _Gemv(_Op):
    """``y = sum_r x_r [M, K_r] @ w_r [N, K_r].T``, M in 0..64."""

    name = "gemv_all_reduce"

    def sizes(self, rng, W, max_dim):
        return {"max_n": _dim(rng, max_dim)}

    def make(self, world, transport, s, timeout_s):
        return po.GemvAllReduce(world, s["max_n"], transport=transport, timeout_s=timeout_s,
                                **_extra(transport))

    def draw(self, rng, W, s, max_dim, refuse):
        case = {"dims": {"M": _dim(rng, 64, zero=0.1), "N": _dim(rng, s["max_n"]),
                         "K": [_dim(rng, max_dim, zero=0.1) for _ in range(W)]},
                "layouts": {k: _dense_layout(rng) for k in ("x", "w")}}
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


class _AllGather(_Op):
    """``cat(all_gather(a_r [m, K])) @ b [K, N]``."""

    name = "all_gather_matmul"

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
                "layouts": {"a": _dense_layout(rng), "b": _layout(rng)},
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


def _moe_sizes(rng, W, max_dim):
    E = rng.randint(1, 3)
    return {"E": E, "k": rng.randint(1, min(4, E * W)), "H": _dim(rng, max_dim),
            "max_tokens": _dim(rng, max_dim)}


def _routing(rng, W, s, refuse_tokens: bool = False) -> dict:
    kinds = ["uniform", "zipf", "first_expert"] + (["one_rank"] if s["k"] <= s["E"] else [])
    S = [_dim(rng, s["max_tokens"], zero=0.15) for _ in range(W)]
    return {"S": S, "route": rng.choice(kinds),
            "ids": rng.choice(["int32", "int64"])}


class _Dispatch(_Op):
    """``x, counts, slots = moe_dispatch(tokens [S_r, H], topk_ids [S_r, k])``."""

    name = "moe_dispatch"
    same_out_shape = False

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


class _Combine(_Op):
    """``out = moe_gemm_combine(x, w, counts, slots, topk_weights)`` on the dispatch layout."""

    name = "moe_gemm_combine"
    same_out_shape = False

    def sizes(self, rng, W, max_dim):
        from ..ops.moe_combine.api import WALKS

        return dict(_moe_sizes(rng, W, max_dim), walk=rng.choice(WALKS),
                    small_tiles=rng.random() < 0.5)

    def make(self, world, transport, s, timeout_s):
        opts = _extra(transport)
        if s["small_tiles"]:
            opts["config"] = _small_tiles()
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
        return {"x": _relaid(x.to(dev), c["layouts"]["x"]), "w": w.to(dt).to(dev),
                "counts": counts.to(dev), "slots": slots.to(dev),
                "topk": _relaid(topk.to(dev), c["layouts"]["topk"])}

    def call(self, ctx, c, t, out):
        return po.moe_gemm_combine(t["x"], t["w"], t["counts"], t["slots"], t["topk"], ctx,
                                   out)

    def reference(self, world, ctx, c, t):
        return po.moe_gemm_combine_reference(t["x"], t["w"], t["counts"], t["slots"],
                                             t["topk"], world.group)

    def out_shape(self, world, ctx, c, t):
        return (t["topk"].shape[0], c["sizes"]["H"])


class _Embedding(_Op):
    """Pooled lookups of table-wise sharded tables, then the All-to-All to the batch owners."""

    name = "embedding_all_to_all"
    same_out_shape = False

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


def all_ops() -> dict:
    """Every public op's sweep entry, by name (the order of ``po.OPS``)."""
    entries = {op.name: op for op in (_Embedding(), _Gemv(), _Dispatch(), _Combine(),
                                      _AllGather())}
    entries.update({name: _Gemm(name) for name in GEMM_PATTERNS})
    return {name: entries[name] for name in po.OPS}


# -- the sweep ------------------------------------------------------------------------------
def _transports(name: str) -> tuple:
    return tuple(po.SPECS[name].transports) + ("auto",)


def _outcome(fn) -> tuple:
    try:
        return "returned", fn()
    except (ValueError, TypeError) as e:
        if isinstance(e, PortableOverlapError) and not isinstance(e, po.InvalidInputError):
            return type(e).__name__, e  # ContextClosedError is one: not a refusal
        return "refused", e
    except PortableOverlapError as e:
        return type(e).__name__, e


def run_sweep(world, seed: int, steps: int, *, max_dim: int = 48,
              ops: Optional[list] = None, refuse_rate: float = 0.08,
              remake_rate: float = 0.25, timeout_s: float = 30.0, leave_out: tuple = (),
              tamper: Optional[Callable] = None, verbose: bool = False) -> dict:
    """Collective: ``steps`` steps of the sweep (module docstring) on every rank of ``world``.
    ``max_dim``: the largest dim drawn (GEMV's M stays at most 64, the op's limit); ``ops``:
    names of ``po.OPS`` to draw from (default all); ``leave_out``: transports never drawn
    (e.g. ``"shmem"`` where ranks share a GPU); ``tamper(step, rank, result) -> result``
    changes what a call returned before it is judged (a test that the sweep can fail).
    Returns this rank's report: ``steps`` (one dict per step: op, transport, dtype, dims,
    layouts, options, whether the call must be refused, the outcome and the error),
    ``failures`` (one line per failed check, naming seed, step and rank), ``unavailable``
    (op -> {transport: why}) and ``seconds``."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    entries = all_ops()
    names = list(ops) if ops else list(entries)
    W, rank = world.world_size, world.rank
    ctxs: dict = {}  # (op, transport) -> (context, its sizes)
    unavailable: dict = {}
    report = {"seed": seed, "world": W, "rank": rank, "steps": [], "failures": [],
              "unavailable": unavailable}

    def close(key):
        ctx = ctxs.pop(key, (None,))[0]
        if ctx is not None:
            try:
                ctx.close()
            except PortableOverlapError:
                pass

    try:
        for step in range(steps):
            name = rng.choice(names)
            op = entries[name]
            while True:  # a transport that cannot run here is found on every rank alike
                usable = [t for t in _transports(name)
                          if t not in unavailable.get(name, {}) and t not in leave_out]
                transport = rng.choice(usable)
                key = (name, transport)
                remake = key not in ctxs or rng.random() < remake_rate
                sizes = op.sizes(rng, W, max_dim)  # drawn at every step: the draws stay in step
                if not remake:
                    break
                close(key)
                try:
                    ctxs[key] = (op.make(world, transport, sizes, timeout_s), sizes)
                    break
                except (BackendUnavailable, ShmemUnavailable) as e:
                    unavailable.setdefault(name, {})[transport] = str(e)[:200]
            ctx, sizes = ctxs[key]
            refuse = rng.random() < refuse_rate
            case = op.draw(rng, W, sizes, max_dim, refuse)
            case.setdefault("dtype", rng.choice(DTYPES))
            case.update(op=name, transport=transport, sizes=sizes, out=rng.random() < 0.5)
            case["layouts"]["out"] = _dense_layout(rng)
            if not op.same_out_shape and case["layouts"]["out"] != "contiguous":
                case["layouts"]["out"] = "offset"  # a strided out of some ranks only
            case["refuse"] = op.refusal(case, W)
            row = {"step": step, "op": name, "transport": transport,
                   "dtype": _name(case["dtype"]), "dims": case["dims"],
                   "layouts": case["layouts"], "sizes": sizes, "out": case["out"],
                   "options": {k: v for k, v in case.items()
                               if k in ("bias", "residual", "schedule", "pooling", "psw",
                                        "index_dtype", "pass_splits", "topk_fp32")},
                   "refuse": case["refuse"]}
            where = f"seed {seed} step {step} rank {rank} of {W}: {name}[{transport}]"
            if verbose:
                print(where, row, flush=True)
            g = step_generator(seed, step, rank)
            t = op.operands(world, ctx, case, g)
            ref = None if case["refuse"] else op.reference(world, ctx, case, t)
            out = None
            shape = op.out_shape(world, ctx, case, t) if case["out"] else None
            if shape is not None:
                like = ref if isinstance(ref, torch.Tensor) else t.get("a", t.get("x"))
                dtype = like.dtype if like is not None else case["dtype"]
                nan = torch.full(shape, float("nan"), dtype=dtype, device=world.device)
                out = _relaid(nan, case["layouts"]["out"])
                if not case["refuse"] and not out.is_contiguous():
                    # every op writes a contiguous out only (the same on every rank: the
                    # result's shape is, where out is non-contiguous)
                    case["refuse"] = row["refuse"] = "out not contiguous"

            def run():
                got = op.call(ctx, case, t, out)
                ctx.synchronize()
                return got

            kind, value = _outcome(run)
            err, why = None, None
            if case["refuse"]:
                if kind != "refused":
                    why = (f"an invalid call ({case['refuse']}) was not refused: "
                           f"{kind} {str(value)[:300] if kind != 'returned' else ''}")
            elif kind != "returned":
                why = f"a valid call raised {type(value).__name__}: {str(value)[:400]}"
            else:
                got = tamper(step, rank, value) if tamper is not None else value
                err, why = op.judge(got, ref, case)
                if why is None and out is not None and got is not out:
                    err, why = op.judge(out, ref, case)
                    why = why and f"out= holds another result: {why}"
            row.update(outcome=kind, err=err, why=why)
            report["steps"].append(row)
            if why is not None:
                report["failures"].append(f"{where}: {why} | case {row}")
            # a call that raised anything but a refusal on some rank: its context is out of
            # step there, so every rank makes a new one (the only agreement of a step)
            broken = world.all_gather_object(kind not in ("returned", "refused"))
            if any(broken):
                close(key)
    finally:
        for key in list(ctxs):
            close(key)
    report["seconds"] = time.monotonic() - t0
    return report


def summary(reports: list) -> str:
    """One line per report: steps, calls per op, failures."""
    lines = []
    for r in reports:
        by_op: dict = {}
        for s in r["steps"]:
            by_op[s["op"]] = by_op.get(s["op"], 0) + 1
        lines.append(f"seed {r['seed']} rank {r['rank']}/{r['world']}: {len(r['steps'])} steps "
                     f"in {r['seconds']:.1f} s, {len(r['failures'])} failures; {by_op}")
    return "\n".join(lines)
