"""Top-k expert ids for tests of the MoE ops: routing patterns that stress the dispatch."""
import torch


def route(kind: str, S: int, E_total: int, k: int, W: int, g: torch.Generator) -> torch.Tensor:
    """Top-k expert ids [S, k] (distinct per token) for a routing pattern: ``"uniform"``,
    ``"zipf"`` (expert popularity ~ 1 / rank^1.2), ``"one_rank"`` (every token's experts on the
    last rank; k at most its experts), ``"first_expert"`` (every token's first choice is expert
    0, the experts after it up to the middle left without rows)."""
    scores = torch.rand(S, E_total, generator=g)
    if kind == "zipf":
        scores = scores * (1.0 / torch.arange(1, E_total + 1).float() ** 1.2)
    elif kind == "one_rank":
        scores[:, : E_total - E_total // W] = -1
    elif kind == "first_expert":
        scores[:, 0] = 2
        scores[:, 1: E_total // 2] = -1
    return scores.topk(k, dim=1).indices


def with_fault(ids: torch.Tensor, fault, rank: int, E_total: int) -> torch.Tensor:
    """``ids`` with a routing fault for the fault tests: ``"id"`` (rank 1's slot (3, 1) names an
    expert past the last), ``"negative"`` (rank 1's first id is -1), ``"capacity"`` (every
    token's choices are experts 0 and 1, so rank 0 receives every row), anything else none."""
    if fault == "id" and rank == 1:
        ids[3, 1] = E_total + 5
    if fault == "negative" and rank == 1:
        ids[0, 0] = -1
    if fault == "capacity":
        ids = torch.tensor([[0, 1]] * ids.shape[0])
    return ids
