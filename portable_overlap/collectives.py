"""The two torch.distributed collectives whose names changed: a rank's row block of a sum over
the ranks (reduce-scatter into one tensor) and the concatenation of every rank's tensor
(all-gather into one tensor), called by the name the installed torch gives them.

torch 2.13 calls them ``reduce_scatter_single`` / ``all_gather_single`` and warns
(``FutureWarning``) at every call of the older ``reduce_scatter_tensor`` /
``all_gather_into_tensor``, which older releases have alone. Both forms take the same
arguments and run the same backend collective; a library that warns from every sequential call
would bury its user's own warnings. The name is looked up at each call (a getattr), so a
``torch.distributed`` patched by a test or a tracer is the one called."""
from typing import Optional

import torch
import torch.distributed as dist


def reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                   group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """``output`` (rank r, 1/W of ``input``'s elements) = block r of ``sum_q input_q``, with
    ``input`` split into W equal blocks along its first dim."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor,
               group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """``output`` = ``cat([input_0, ..., input_{W-1}])`` along the first dim, on every rank."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)
