"""Call tags told back in plain words (what a RankMismatchError shows)."""
from portable_overlap.ops.call_tags import (describe_tag, differing, mismatch_message,
                                            shape_tag)


def test_tag_described_by_its_named_fields():
    tag = shape_tag("some_op", "all_reduce", x=(2, 24), w=(48, 24), dtype="torch.float32",
                    config=("a", 1))
    assert describe_tag(tag, "some_op") == \
        "all_reduce, x [2, 24], w [48, 24], dtype=float32, config [a, 1]"
    assert describe_tag(tag ^ 1) is None  # never made here


def test_mismatch_message_once_per_rank():
    own = "x [2, 24], w [48, 24], dtype=float32, config=Cfg(a=1, b=2)"
    other = "x [2, 24], w [40, 24], dtype=float32, config=Cfg(a=1, b=3)"
    assert differing(own, [other, None]) == ["w", "config"]
    msg = mismatch_message("op", 1, own, {0: other, 3: None}, differing(own, [other]))
    assert msg.splitlines() == [
        "op: ranks 0, 1 and 3 called it with different shapes or settings (this rank is 1):",
        f"  rank 0: {other}", f"  rank 1: {own}",
        "  rank 3: (its arguments did not reach this rank in time)",
        "  they differ in: w, config"]
