"""packloss.tools.bench._measure: the median of the timed calls (a fake clock; no timing is asserted),
the CPU peak-memory counter, a target run in a fresh process, and the values check that precedes every
timing."""

from __future__ import annotations

import pytest
import torch

from packloss.tools.bench import _measure
from packloss.tools.bench._measure import ValuesDisagree, check


def test_time_ms_calls_warmup_then_repeat_and_takes_the_median(monkeypatch):
    calls = []
    # perf_counter pairs around each timed call: 1 ms, 3 ms, 2 ms
    ticks = iter([0.0, 0.001, 1.0, 1.003, 2.0, 2.002])
    monkeypatch.setattr(_measure.time, "perf_counter", lambda: next(ticks))
    median = _measure.time_ms(lambda: calls.append(1), "cpu", warmup=2, repeat=3)
    assert len(calls) == 5  # 2 untimed warm-up calls, 3 timed
    assert median == pytest.approx(2.0)


def test_cpu_peak_counts_memory_allocated_after_the_reset():
    base = _measure.reset_peak("cpu")
    assert base > 0  # the resident set now
    x = torch.ones(16 * 2**20)  # 64 MiB, touched
    del x
    added = _measure.peak_bytes("cpu") - base
    assert added >= 48 * 2**20  # the freed tensor still counts: a high-water mark
    _measure.release_freed_memory("cpu")
    base = _measure.reset_peak("cpu")  # a new baseline: the freed tensor is gone from the peak
    assert _measure.peak_bytes("cpu") - base < 48 * 2**20


def test_run_fresh_returns_the_targets_dict_and_reports_its_failure():
    assert _measure.run_fresh("json:loads", {"s": '{"rows": [1, 2], "ok": true}'}, timeout=60) == {
        "rows": [1, 2],
        "ok": True,
    }
    with pytest.raises(RuntimeError, match="(?s)json:loads failed in a fresh process:.*JSONDecodeError"):
        _measure.run_fresh("json:loads", {"s": "not json"}, timeout=60)
    with pytest.raises(RuntimeError, match="(?s)failed in a fresh process:.*AttributeError"):
        _measure.run_fresh("packloss.tools.bench._measure:no_such_function", {}, timeout=60)


def test_check_fails_on_a_difference_a_zero_reference_and_nan():
    x = torch.tensor([1.0, -2.0])
    assert check("x", x * (1 + 1e-7), x, 1e-6) <= 1e-6
    with pytest.raises(ValuesDisagree, match="x: max error"):
        check("x", x * (1 + 1e-5), x, 1e-6)
    with pytest.raises(ValuesDisagree):
        check("zero", torch.zeros(2), torch.zeros(2), 1e-6)
    with pytest.raises(ValuesDisagree):
        check("nan", torch.tensor([1.0, float("nan")]), x, 1e-6)
