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


def _logged_run(path, f, oh):
    """JSON lines as bench_wave_predictor writes them, for all_reduce at two shapes, with
    'measured' times from the model with comm_slowdown ``f`` and group overhead ``oh``."""
    import dataclasses
    import json

    from portable_overlap.schedule import Calibration, candidate_partitions, predict_ms

    curve = [[1 << 20, 0.035], [1 << 24, 0.083], [1 << 27, 0.476], [1 << 28, 0.927]]
    rows = []
    for M, n_tiles in ((4096, 1024), (8192, 2048)):
        shape = {"M": M, "N": 8192, "K": 8192, "K_local": 4096}
        cal = {"wave_ms": 0.05, "tiles_per_wave": 116, "comm_curve": curve, "slowdown": 1.03,
               "reorder_ms": 0.04, "n_tiles": n_tiles, "dests": 1, "tile_bytes": 65536}
        rows.append({"op": "wave_predictor_calibration", "kind": "all_reduce", "shape": shape,
                     "commit": "abc", **cal})
        logged = Calibration(**{k: cal[k] for k in ("wave_ms", "tiles_per_wave", "comm_curve",
                                                     "slowdown", "reorder_ms")})
        true = dataclasses.replace(logged, comm_slowdown=f, group_overhead_ms=oh)
        for part in candidate_partitions(n_tiles, 116, max_groups=4, cap=8):
            rows.append({"op": "wave_predictor", "kind": "all_reduce", "shape": shape,
                         "commit": "abc", "partition": list(part), "role": ["candidate"],
                         "median_ms": predict_ms(part, true, 65536),
                         "predicted_ms": predict_ms(part, logged, 65536)})
    rows.append({"op": "gemm_allreduce_signal", "commit": "old", "graph": True,
                 "impl": "fused[equal2]", "partition": [1044, 1004], "median_ms": 1.4,
                 "shape": {"M": 8192, "N": 8192, "K": 8192, "K_local": 4096}})
    rows.append({"op": "other", "commit": "abc"})
    with open(path, "w") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows) + "\n")


def test_refit_recovers_the_collective_terms(tmp_path, monkeypatch, capsys):
    import sys

    from benchmarks import refit_wave_predictor as refit

    # small grids holding the true values (the full grids take seconds)
    monkeypatch.setattr(refit, "SLOWDOWNS", [1.0, 2.0, 6.0, 1000.0])
    monkeypatch.setattr(refit, "OVERHEADS", [-0.01, 0.0, 0.005, 0.01])
    path = tmp_path / "r.jsonl"
    _logged_run(path, 6.0, 0.005)
    runs = refit.load(str(path), "abc")
    assert sorted(runs) == [("all_reduce", "4096x8192x8192"), ("all_reduce", "8192x8192x8192")]
    f, oh, err = refit.fit([runs[("all_reduce", "4096x8192x8192")]])
    assert (f, oh) == (6.0, 0.005) and err == pytest.approx(0.0, abs=1e-12)
    assert refit.load_sweep(str(path), "old") == [
        ("all_reduce", "8192x8192x8192", "equal2", (1044, 1004), 1.4)]
    monkeypatch.setattr(sys, "argv", ["refit", "--jsonl", str(path), "--commit", "abc",
                                      "--sweep-commit", "old"])
    assert refit.main() == 0
    out = capsys.readouterr().out
    assert "comm_slowdown 6, group_overhead_ms +0.005 (in-sample mean err 0.0%)" in out
    # the held-out shape is predicted exactly with the values fitted on the other
    held = [ln for ln in out.splitlines() if "held-out" in ln]
    assert held and all(" 0.0% " in ln for ln in held)
    assert "equal2" in out


def test_summary_with_the_tuners_own_reserve():
    """A tuned config on another SM reserve has no prediction: it counts for the best and for
    best/tuned, not for the prediction error."""
    rows = [_row((8,), ["default", "candidate"], 1.0, 1.1),
            _row((4, 4), ["search", "candidate"], 0.9, 0.9),
            {"partition": (8,), "roles": ["tuned"], "measured_ms": 0.8,
             "predicted": {"main": None, "alt": None}}]
    s = summarize(rows, ("main", "alt"))
    assert s["mean_err"] == pytest.approx(0.05) and s["max_err"] == pytest.approx(0.1)
    assert s["best_ms"] == 0.8 and s["tuned_ms"] == 0.8 and s["best_over_tuned"] == 1.0
    assert s["best_over_pick"] == pytest.approx(0.8 / 0.9)
