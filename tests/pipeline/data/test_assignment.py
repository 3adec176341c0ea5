"""The epoch's global row stream cut into parts: equal ±1, contiguous, and exactly what is left after a
number of steps (the arithmetic an N -> M resume rests on)."""
import pytest

from pipeline.data.assignment import (Segment, consumed, cut, epoch_windows, even_sizes, pieces, remaining,
                                      segment_steps, span, take, window_order)


def _positions(intervals):
    return [p for a, b in intervals for p in range(a, b)]


@pytest.mark.parametrize("total,world", [(10, 3), (7, 7), (1000, 4), (5, 1)])
def test_parts_are_contiguous_equal_and_cover_the_stream(total, world):
    parts = cut(((0, total),), world)
    assert len(parts) == world
    sizes = [span(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert [p for part in parts for p in _positions(part)] == list(range(total))


def test_take_and_cut_follow_the_concatenation_of_several_intervals():
    intervals = ((3, 5), (10, 14), (20, 21))
    assert _positions(take(intervals, 1, 4)) == [4, 10, 11, 12]
    parts = cut(intervals, 2)
    assert [_positions(p) for p in parts] == [[3, 4, 10, 11], [12, 13, 20]]


@pytest.mark.parametrize("total,world,batch,done", [(1000, 2, 64, 3), (1003, 3, 50, 6), (97, 1, 10, 9), (500, 4, 7, 0)])
def test_remaining_is_the_stream_minus_what_each_rank_trained_on(total, world, batch, done):
    segment = Segment(0, ((0, total),), world)
    steps = segment_steps(total, world, batch)
    trained = []
    for part in cut(segment.intervals, world):
        rows = span(part)
        sizes = even_sizes(rows, steps)
        assert max(sizes) <= batch and max(sizes) - min(sizes) <= 1
        trained += _positions(take(part, 0, consumed(rows, steps, done)))
    left = _positions(remaining(segment, steps, done))
    assert sorted(trained + left) == list(range(total)) and not set(trained) & set(left)


def test_nested_resumes_see_every_position_once():
    """2 workers for 3 steps, then 3 workers for 2 steps of what is left, then 1 worker to the end."""
    total, batch = 997, 40
    seen = []
    segment = Segment(0, ((0, total),), 2)
    for world, done in ((2, 3), (3, 2), (1, None)):
        segment = Segment(0, segment.intervals, world)
        steps = segment_steps(span(segment.intervals), world, batch)
        done = steps if done is None else done
        for part in cut(segment.intervals, world):
            seen += _positions(take(part, 0, consumed(span(part), steps, done)))
        segment = Segment(0, remaining(segment, steps, done), world)
    assert span(segment.intervals) == 0
    assert sorted(seen) == list(range(total))


def test_windows_and_pieces_map_positions_to_row_groups():
    rows = [30, 5, 40, 25, 10]
    windows = epoch_windows(rows, seed=3, epoch=1, window_rows=50, shuffle=True)
    assert sorted(g for w in windows for g in w.groups) == list(range(5))
    assert all(w.rows >= 50 for w in windows[:-1]) and sum(w.rows for w in windows) == sum(rows)
    assert windows == epoch_windows(rows, seed=3, epoch=1, window_rows=50, shuffle=True)
    assert [w.groups for w in epoch_windows(rows, 3, 2, 50, True)] != [w.groups for w in windows] or \
        [w.groups for w in epoch_windows(rows, 3, 3, 50, True)] != [w.groups for w in windows]
    covered = [w.start + p for k, lo, hi in pieces(windows, ((7, 61), (80, 110))) for p in range(lo, hi)
               for w in [windows[k]]]
    assert covered == list(range(7, 61)) + list(range(80, 110))
    assert [w.groups for w in epoch_windows(rows, 3, 1, 50, shuffle=False)] == [(0,), (1,), (2,), (3,), (4,)]
    assert sorted(window_order(3, 1, 0, 20, True).tolist()) == list(range(20))
    assert window_order(3, 1, 0, 20, False).tolist() == list(range(20))


def test_segment_records_round_trip():
    segment = Segment(2, ((5, 9), (12, 30)), 3, base=4)
    assert Segment.of(segment.record()) == segment
