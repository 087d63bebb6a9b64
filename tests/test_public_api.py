"""What ``import portable_overlap`` offers: the drop-in modules at the top level."""
import portable_overlap
from portable_overlap import (ColumnParallelLinear, ExpertParallelMoE, RowParallelLinear,
                              ShardedEmbeddingBagCollection)
from portable_overlap import modules


def test_modules_at_top_level():
    for cls in (ExpertParallelMoE, ShardedEmbeddingBagCollection, RowParallelLinear,
                ColumnParallelLinear):
        assert cls.__name__ in portable_overlap.__all__
        assert getattr(modules, cls.__name__) is cls


def test_every_module_exported():
    """Each drop-in module of ``portable_overlap.modules`` is also a top-level name."""
    assert set(modules.__all__) <= set(portable_overlap.__all__)
    assert all(getattr(portable_overlap, name) is getattr(modules, name)
               for name in modules.__all__)
