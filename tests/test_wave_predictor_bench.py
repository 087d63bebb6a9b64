"""The host-side summary of benchmarks/bench_wave_predictor.py (prediction error, the search's
pick against the best measured partition)."""
import pytest

from benchmarks.bench_wave_predictor import bytes_lasting, summarize


def _row(part, roles, measured, main, other=None):
    return {"partition": part, "roles": roles, "measured_ms": measured,
            "predicted": {"main": main, "alt": main if other is None else other}}


def test_summary():
    rows = [_row((8,), ["default", "candidate"], 1.0, 1.1),
            _row((4, 4), ["search"], 1.25, 1.0),  # the pick: not among the candidates
            _row((2, 6), ["candidate"], 0.8, 0.9, 0.8),
            _row((6, 2), ["candidate"], None, 0.5)]  # not measured: no error, not the best
    s = summarize(rows, ("main", "alt"))
    assert s["n_measured"] == 3 and s["n_candidates"] == 3
    errs = [0.1, 0.2, 0.125]
    assert s["mean_err"] == pytest.approx(sum(errs) / 3) and s["max_err"] == pytest.approx(0.2)
    assert s["mean_err[alt]"] == pytest.approx((0.1 + 0.2 + 0.0) / 3)
    assert s["best_ms"] == 0.8 and s["best_partition"] == [2, 6]
    assert s["pick_ms"] == 1.25 and s["pick_partition"] == [4, 4]
    assert s["best_over_pick"] == pytest.approx(0.64) and not s["pick_in_candidates"]
    assert s["default_ms"] == 1.0 and s["default_partition"] == [8]
    # the model's favourite among the measured candidates is the measured best here
    assert s["model_best_partition"] == [2, 6] and s["best_over_model_best"] == 1.0


def test_summary_when_the_pick_failed():
    s = summarize([_row((8,), ["candidate"], 1.0, 1.0), _row((4, 4), ["search"], None, 0.9)])
    assert s["pick_ms"] is None and s["best_over_pick"] is None and s["best_ms"] == 1.0


def test_bytes_lasting():
    curve = ((1 << 20, 0.01), (1 << 27, 0.5))
    n = bytes_lasting(curve, 0.3)
    assert n & (n - 1) == 0 and n >= 1 << 20
    cal_ms = lambda b: 0.01 + 0.49 * (b - (1 << 20)) / ((1 << 27) - (1 << 20))  # noqa: E731
    assert cal_ms(n) >= 0.3 > cal_ms(n // 2)
    assert bytes_lasting(curve, 100.0) == 1 << 30  # capped
