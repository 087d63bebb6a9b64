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
