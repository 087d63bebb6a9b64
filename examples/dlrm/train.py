"""DLRM training with table-wise sharded embeddings, with and without the fused embedding
pooling + All-to-All, on synthetic Criteo-like data.

    torchrun --nproc-per-node 2 examples/dlrm/train.py [--impl both|fused|reference] [--steps N]
    python examples/dlrm/train.py                  # no GPUs: 2 CPU-emulated ranks, toy sizes

It prints when the set-up is done and after each step (every tenth of the run for long runs),
with the step's loss and time. The default run is 30 steps on GPUs and 3 on CPU-emulated ranks,
where the Triton interpreter takes seconds per fused step.

Model (Naumov et al.'s DLRM): bottom MLP over 13 dense features -> D; 26 sparse features, one
embedding table each (Criteo Kaggle cardinalities capped at ``--cap`` rows), sum-pooled bags;
dot-product interaction of the 27 D-vectors (upper triangle) concatenated with the bottom output;
top MLP -> 1 logit; BCE loss. Parallelism: tables are sharded table-wise over the ranks
(model-parallel, ``ShardedEmbeddingBagCollection``), the MLPs are replicated (data-parallel,
gradients all-reduced); each rank owns a slice of the global batch. The embedding output's
All-to-All (model-parallel -> data-parallel) is what the fused op hides behind the pooling.

Data: every rank draws the same global batch from a step-seeded generator (so no input
distribution is needed): dense features ~ N(0, 1), bag lengths uniform in 0..2·pf, indices
Zipf(``--zipf``)-distributed over a random permutation of each table's rows; labels from a hidden
logistic model of the dense features and per-row scores, so the loss can fall.
Each rank's loss is the sum of its samples' losses / global batch; the sum over ranks is the
global mean.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from portable_overlap import ShardedEmbeddingBagCollection, World
from portable_overlap.cli import int_at_least
from portable_overlap.testing.compare import worst

CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
                 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
                 142572]
FULL = dict(dim=128, bottom=[512, 256], top=[1024, 1024, 512, 256], batch=4096, cap=200000)
SMALL = dict(dim=16, bottom=[32], top=[64], batch=16, cap=1000)
STEPS = dict(gpu=30, cpu=3)  # default --steps
# How long a fused call waits for a peer (seconds): the interpreter runs a rank's programs one
# after another, and on a busy CPU a peer's slices can come more than 10 s after this rank's
WAIT_S = dict(gpu=10.0, cpu=120.0)


def mlp(sizes, last_act=True):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_act or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, world, rows, dims, fused, max_local_batch, seed=0):
        super().__init__()
        D = dims["dim"]
        torch.manual_seed(seed)  # the replicated MLPs start equal on every rank and both paths
        self.bottom = mlp([13, *dims["bottom"], D])
        n = len(rows) + 1
        self.top = mlp([D + n * (n - 1) // 2, *dims["top"], 1], last_act=False)
        self.to(world.device)
        self.emb = ShardedEmbeddingBagCollection(
            world, rows, D, max_local_batch=max_local_batch, fused=fused, seed=seed,
            timeout_s=WAIT_S["cpu" if world.device.type == "cpu" else "gpu"])
        iu = torch.triu_indices(n, n, offset=1, device=world.device)
        self.register_buffer("iu", iu, persistent=False)

    def forward(self, dense, lengths, indices, splits):
        x = self.bottom(dense)  # [b, D]
        e = self.emb(lengths, indices, batch_splits=splits)  # [b, T*D], global table order
        # the tables' count, not -1: a rank that owns no samples of the batch has b = 0
        T = self.emb.plan.num_tables
        z = torch.cat([x[:, None], e.view(x.shape[0], T, x.shape[1])], 1)  # [b, 27, D]
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([x, dots], 1)).squeeze(1)

    def dense_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("emb.")]


class Data:
    """Synthetic Criteo-like batches, the same global batch on every rank."""

    def __init__(self, rows, dims, args, device):
        self.rows, self.B, self.pf, self.device = rows, dims["batch"], args.pf, device
        g = torch.Generator().manual_seed(1234)
        self.cdf, self.perm, self.score = [], [], []
        for n in rows:  # Zipf over ranks 1..n, hot ranks scattered over the table
            p = torch.arange(1, n + 1, dtype=torch.float64) ** -args.zipf
            self.cdf.append((p.cumsum(0) / p.sum()).to(device))
            self.perm.append(torch.randperm(n, generator=g).to(device))
            self.score.append(torch.randn(n, generator=g).to(device))
        self.v = torch.randn(13, generator=g).to(device)

    def batch(self, step):
        g = torch.Generator(device=self.device).manual_seed(10_000 + step)
        B = self.B
        dense = torch.randn(B, 13, generator=g, device=self.device)
        lengths, indices = [], []
        logit = dense @ self.v
        for t, n in enumerate(self.rows):
            ln = torch.randint(0, 2 * self.pf + 1, (B,), generator=g, device=self.device)
            u = torch.rand(int(ln.sum()), generator=g, device=self.device, dtype=torch.float64)
            idx = self.perm[t][torch.searchsorted(self.cdf[t], u).clamp_max(n - 1)]
            bag = torch.repeat_interleave(torch.arange(B, device=self.device), ln)
            logit = logit.index_add(0, bag, self.score[t][idx] * 0.5)
            lengths.append(ln)
            indices.append(idx)
        labels = (torch.sigmoid(logit) > torch.rand(B, generator=g, device=self.device)).float()
        return dense, lengths, indices, labels


def local_inputs(data_batch, tables, splits, rank):
    """This rank's dense rows and labels, and its tables' features for the whole global batch
    (table-major jagged layout)."""
    dense, lengths, indices, labels = data_batch
    lo = sum(splits[:rank])
    hi = lo + splits[rank]
    ln = torch.cat([lengths[t] for t in tables]) if tables else lengths[0][:0]
    ix = torch.cat([indices[t] for t in tables]) if tables else indices[0][:0]
    return dense[lo:hi], ln, ix, labels[lo:hi]


def train(world, args):
    t_start = time.perf_counter()
    say = (lambda *a: print(*a, flush=True)) if world.rank == 0 else (lambda *a: None)
    small = args.small or world.device.type == "cpu"
    steps = args.steps or STEPS["cpu" if world.device.type == "cpu" else "gpu"]
    dims = dict(SMALL if small else FULL)
    if args.batch:
        dims["batch"] = args.batch
    cap = args.cap or dims["cap"]
    rows = [min(c, cap) for c in CRITEO_KAGGLE]
    W, r = world.world_size, world.rank
    B = dims["batch"]
    splits = [B // W + (1 if q < B % W else 0) for q in range(W)]  # uneven when B % W
    impls = ["fused", "reference"] if args.impl == "both" else [args.impl]
    models = {i: DLRM(world, rows, dims, i == "fused", max(splits)) for i in impls}
    opts = {i: torch.optim.SGD(m.parameters(), lr=args.lr) for i, m in models.items()}
    data = Data(rows, dims, args, world.device)
    tables = models[impls[0]].emb.local_tables
    losses = {i: [] for i in impls}
    times = {i: [] for i in impls}
    on_gpu = world.device.type == "cuda"
    say(f"set-up done in {time.perf_counter() - t_start:.1f} s ({', '.join(impls)}; {len(rows)} "
        f"tables, global batch {B}, {W} ranks on {world.device.type}); {steps} steps:")
    every = max(1, steps // 10)
    for step in range(steps):
        dense, ln, ix, labels = local_inputs(data.batch(step), tables, splits, r)
        for name, m in models.items():
            if step == 1 and name == "fused":
                m.emb.ctx.validate = False  # the generator is trusted: no host sync per step
            if on_gpu:
                torch.cuda.synchronize()
            world.barrier()
            t0 = time.perf_counter()
            opt = opts[name]
            opt.zero_grad(set_to_none=True)
            logits = m(dense, ln, ix, splits)
            loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / B
            loss.backward()
            if W > 1:  # data-parallel MLPs: sum the ranks' gradients (losses are / global B)
                grads = [p.grad for p in m.dense_parameters()]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=world.group)
                off = 0
                for g in grads:
                    g.copy_(flat[off:off + g.numel()].view_as(g))
                    off += g.numel()
            opt.step()
            total = loss.detach().clone()
            if W > 1:
                dist.all_reduce(total, group=world.group)
            if on_gpu:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            losses[name].append(total.item())
        if (step + 1) % every == 0 or step + 1 == steps:
            say(f"  step {step + 1}/{steps}: " + ", ".join(
                f"{n} loss {losses[n][-1]:.4f} ({times[n][-1]:.2f} s)" for n in impls))
    for m in models.values():
        m.emb.close()
    return dict(losses=losses, times=times, B=B, rows=rows, dims=dims, splits=splits, steps=steps,
                tables={q: [t for t, rr in enumerate(models[impls[0]].emb.plan.table_ranks)
                            if rr == q] for q in range(W)})


def report(res, world_size, device) -> int:
    losses, times, steps = res["losses"], res["times"], res["steps"]
    dims = res["dims"]
    print(f"DLRM: {len(res['rows'])} tables of D={dims['dim']} (rows capped: "
          f"{max(res['rows'])}), global batch {res['B']} split {res['splits']}, {world_size} "
          f"ranks on {device}; tables per rank {res['tables']}")
    names = list(losses)
    print(f"{'step':>5} " + " ".join(f"{n + ' loss':>15}" for n in names))
    for s in range(steps):
        print(f"{s:5d} " + " ".join(f"{losses[n][s]:15.6f}" for n in names))
    skip = min(2, steps - 1)  # the first steps compile and plan
    for n in names:
        t = sorted(times[n][skip:])
        med = t[len(t) // 2]
        print(f"{n}: {med * 1e3:.2f} ms/step, {res['B'] / med:,.0f} samples/s")
    if device == "cpu":
        print("(CPU-emulated ranks run the kernels in the Triton interpreter: times are not GPU "
              "times)")
    code = 0
    for n in names:
        k = max(1, steps // 4)
        first, last = sum(losses[n][:k]) / k, sum(losses[n][-k:]) / k
        print(f"{n}: loss {first:.4f} -> {last:.4f} ({'falls' if last < first else 'DOES NOT FALL'})")
    if len(names) == 2:
        a, b = losses[names[0]], losses[names[1]]
        n = min(5, steps)
        diff = worst(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[:n], b[:n]))
        ok = diff < (1e-3 if device == "cpu" else 1e-2)
        print(f"fused vs reference loss over the first {n} steps: max rel diff {diff:.2e} -> "
              f"{'paths agree' if ok else 'PATHS DISAGREE'}")
        code = 0 if ok else 1
    return code


def _emulated(world, args):
    return train(world, args)


def finite_float(text: str) -> float:
    """An argparse ``type=``: a finite float. ``nan`` or ``inf`` would make both paths' losses
    NaN, which the comparison reports as the paths disagreeing (exit code 1, a wrong result)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


finite_float.__name__ = "finite number"  # (argparse names the type in its messages)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["fused", "reference", "both"], default="both")
    ap.add_argument("--steps", type=int_at_least(0), default=0,
                    help=f"training steps (default {STEPS['gpu']} on GPUs, {STEPS['cpu']} on CPU)")
    ap.add_argument("--small", action="store_true", help="toy sizes (CPU)")
    ap.add_argument("--batch", type=int_at_least(0), default=0,
                    help="global batch (default 4096 / small 16)")
    ap.add_argument("--cap", type=int_at_least(0), default=0,
                    help="rows per table cap (200000 / small 1000)")
    ap.add_argument("--pf", type=int_at_least(0), default=2,
                    help="mean bag length (uniform 0..2·pf)")
    ap.add_argument("--zipf", type=finite_float, default=1.05,
                    help="exponent of the indices' Zipf distribution (0: uniform)")
    ap.add_argument("--lr", type=finite_float, default=0.5, help="SGD learning rate")
    args = ap.parse_args()
    if "RANK" in os.environ:  # torchrun
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        world = World.from_env()
        res = train(world, args)
        code = report(res, world.world_size, world.device.type) if world.rank == 0 else 0
        dist.destroy_process_group()
        return code
    from portable_overlap.testing import EmulatedWorld

    args.small = True
    print("starting 2 CPU-emulated ranks (the kernels run in the Triton interpreter) ...",
          flush=True)
    with EmulatedWorld(2) as ew:
        res = ew.run(_emulated, args, timeout=900)[0]
    return report(res, 2, "cpu")


if __name__ == "__main__":
    sys.exit(main())
