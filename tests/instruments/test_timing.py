"""timed and timed_rounds: the seconds between the clock reads, rounds that alternate."""

from __future__ import annotations

from instruments.measure import timing
from instruments.measure.timing import timed, timed_rounds


def _clock(monkeypatch, durations: list[float]) -> None:
    """perf_counter as timing sees it: each timed call takes the next of ``durations``."""
    ticks, now = [], 100.0
    for seconds in durations:
        ticks += [now, now + seconds]
        now += seconds + 1.0  # time between calls is not counted
    monkeypatch.setattr(timing, "perf_counter", iter(ticks).__next__)


def test_timed_returns_the_result_and_the_seconds_between_its_clock_reads(monkeypatch) -> None:
    _clock(monkeypatch, [0.25])
    assert timed(lambda: sum(range(1000))) == (499500, 0.25)


def test_timed_rounds_alternates_and_drops_the_warmup_rounds(monkeypatch) -> None:
    calls: list[str] = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b")]
    # one untimed round (a 9, b 8), then three timed ones
    _clock(monkeypatch, [9.0, 8.0, 1.0, 2.0, 1.5, 2.5, 1.25, 2.25])
    assert timed_rounds(fns, repeats=3) == [[1.0, 1.5, 1.25], [2.0, 2.5, 2.25]]
    assert calls == ["a", "b"] * 4
    calls.clear()
    _clock(monkeypatch, [9.0, 8.0, 7.0, 6.0, 1.0, 2.0])
    assert timed_rounds(fns, repeats=1, warmup=2) == [[1.0], [2.0]]
    _clock(monkeypatch, [1.0, 2.0])
    assert timed_rounds(fns, repeats=1, warmup=0) == [[1.0], [2.0]]
    # `before`: an untimed call ahead of each call of its function, every round
    calls.clear()
    _clock(monkeypatch, [9.0, 8.0, 1.0, 2.0])
    before = [lambda: calls.append("switch"), None]
    assert timed_rounds(fns, repeats=1, before=before) == [[1.0], [2.0]]
    assert calls == ["switch", "a", "b"] * 2
