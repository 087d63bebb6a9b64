"""A seeded, randomized sweep of every public op through every transport the backend can run,
at shapes, dtypes and operand layouts that no test lists, against the op's torch reference.

Every rank draws the same sequence from the seed (``random.Random(seed)``; no communication is
needed to agree on it), and its own operands from a generator seeded by (seed, step, rank).
What each op draws, its reference and how a result is judged live in ``op_cases.py``, which
the fault campaign draws from too. Each step draws:

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
dtype whose largest error, relative to the reference's largest magnitude, is within
``op_cases.TOL`` of its dtype (outputs and receive buffers are poisoned with NaN first, so an
element never written fails); the dispatch's counts, slots and rows match exactly. A valid
call that raises, an invalid one that returns, and an error of another kind are failures.
After a call that raised an error other than a refusal on any rank, every rank remakes that
context (the ranks agree on it in one small host collective per step).

The report names each step (op, transport, dtype, dims, layouts, options) and each failure
with its seed, step and rank and the error, so a failure is a reproducible case:
``run_sweep(world, seed, step + 1)`` on a world of the same size, with the same ``ops`` and
bounds, replays it (the draws depend on them).
"""
from __future__ import annotations

import random
import time
from typing import Callable, Optional

import torch

import portable_overlap as po
from ..errors import PortableOverlapError
from .op_cases import (DTYPES, all_cases, dense_layout, draw_context, dtype_name, relaid,
                       step_generator)


# -- the sweep ------------------------------------------------------------------------------

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
    entries = all_cases()
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
            key = draw_context(rng, op, W, max_dim, ctxs, unavailable,
                               lambda e, t, s: e.make(world, t, s, timeout_s),
                               leave_out=leave_out, remake_rate=remake_rate, close=close)
            transport = key[1]
            ctx, sizes = ctxs[key]
            refuse = rng.random() < refuse_rate
            case = op.draw(rng, W, sizes, max_dim, refuse)
            case.setdefault("dtype", rng.choice(DTYPES))
            case.update(op=name, transport=transport, sizes=sizes, out=rng.random() < 0.5)
            case["layouts"]["out"] = dense_layout(rng)
            if not op.same_out_shape and case["layouts"]["out"] != "contiguous":
                case["layouts"]["out"] = "offset"  # a strided out of some ranks only
            case["refuse"] = op.refusal(case, W)
            row = {"step": step, "op": name, "transport": transport,
                   "dtype": dtype_name(case["dtype"]), "dims": case["dims"],
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
                out = relaid(nan, case["layouts"]["out"])
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
