"""Schedule tables (jaxtrain.parallel.schedules): dependencies, activation peaks, bubbles, bad input. Pure Python."""

import pytest

from jaxtrain.errors import ConfigError
from jaxtrain.parallel import pipeline, schedules
from jaxtrain.parallel.schedules import Action

CASES = [("gpipe", S, M, 1) for S, M in ((1, 1), (2, 1), (2, 3), (4, 4), (4, 8), (3, 7))]
CASES += [("circular", S, M, R) for S, M, R in ((2, 2, 2), (4, 4, 2), (4, 8, 3), (3, 5, 2), (4, 2, 1))]
CASES += [("1f1b", S, M, 1) for S, M in ((1, 3), (2, 2), (4, 4), (4, 8), (4, 16), (3, 7), (8, 9))]
CASES += [("interleaved_1f1b", S, M, R) for S, M, R in ((2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 16, 3), (3, 6, 2),
                                                         (8, 16, 2), (4, 8, 1))]
CASES += [("zero_bubble", S, M, 1) for S, M in ((1, 2), (2, 2), (4, 4), (4, 8), (4, 16), (3, 7), (8, 9))]


@pytest.mark.parametrize("name,S,M,R", CASES)
def test_tables_validate_and_peak_at_their_bound(name, S, M, R):
    table = schedules.build(name, S, M, R)
    assert schedules.validate(table) == schedules.activation_bound(name, S, M, R)
    busy = sum(c is not None for row in table.rows for c in row)
    work = S * R * M * (1 + 2)  # every chunk-microbatch: F, then BW or B and W, each unit cost
    assert busy == work and 0 <= schedules.bubble_fraction(table) < 1


@pytest.mark.parametrize("M", [8, 16])
def test_bounds_and_bubbles_at_four_stages(M):
    S = 4
    gpipe, f1b, zb = (schedules.build(n, S, M) for n in ("gpipe", "1f1b", "zero_bubble"))
    assert schedules.validate(gpipe) == (M,) * S
    assert schedules.validate(f1b) == (4, 3, 2, 1)  # S - s: at most S whatever M
    assert schedules.validate(zb) == (S,) * S  # ZB-H1: 1F1B's stage-0 memory on every stage
    # The "Bubble" must-show: zero_bubble idles less than half as much as 1F1B.
    assert schedules.bubble_fraction(zb) < schedules.bubble_fraction(f1b) / 2
    # Unit costs with BW = 2: 1F1B's and GPipe's bubble is (S-1)/(M+S-1) (pipeline.bubble_fraction);
    # ZB-H1's (S-1)(F+B-W) / (3M + (S-1)).
    assert schedules.bubble_fraction(f1b) == pytest.approx(pipeline.bubble_fraction(S, M))
    assert schedules.bubble_fraction(gpipe) == pytest.approx(pipeline.bubble_fraction(S, M))
    assert schedules.bubble_fraction(zb) == pytest.approx((S - 1) / (3 * M + S - 1))
    assert pipeline.bubble_fraction(S, M, schedule="zero_bubble") == schedules.bubble_fraction(zb)  # what runs print
    inter = schedules.build("interleaved_1f1b", S, M, 2)
    assert schedules.bubble_fraction(inter) == pytest.approx(pipeline.bubble_fraction(S, M, 2))
    assert schedules.bubble_fraction(inter) < schedules.bubble_fraction(f1b)


def test_circular_matches_todays_pipeline_bubble():
    for S, M, R in ((4, 8, 2), (2, 4, 3)):
        table = schedules.build("circular", S, M, R)
        assert schedules.bubble_fraction(table) == pytest.approx(pipeline.bubble_fraction(S, M, R))


def test_costs_change_the_time_model():
    table = schedules.build("1f1b", 4, 8, costs={"F": 1, "BW": 1})
    assert len(table.rows[0]) == 2 * 8 + 2 * 3
    schedules.validate(table)
    with pytest.raises(ConfigError, match="costs"):
        schedules.build("1f1b", 4, 8, costs={"W": 0})


def test_validate_catches_broken_tables():
    table = schedules.build("1f1b", 2, 2)
    rows = [list(r) for r in table.rows]
    # Stage 1 runs F0 before stage 0 has produced it.
    rows[1][0], rows[1][1] = rows[1][1], None
    with pytest.raises(ValueError, match="before"):
        schedules.validate(schedules.Table("1f1b", 2, 2, 1, table.costs, tuple(map(tuple, rows))))
    rows = [list(r) for r in table.rows]
    rows[0] = [None if a == Action("F", 1, 0) else a for a in rows[0]]
    with pytest.raises(ValueError, match="microbatch 1 chunk 0"):
        schedules.validate(schedules.Table("1f1b", 2, 2, 1, table.costs, tuple(map(tuple, rows))))


@pytest.mark.parametrize("args,field", [
    (("1f1b", 4, 3), "pipeline.microbatches"),
    (("zero_bubble", 4, 2), "pipeline.microbatches"),
    (("interleaved_1f1b", 4, 3, 2), "pipeline.microbatches"),
    (("interleaved_1f1b", 4, 6, 2), "pipeline.microbatches"),
    (("circular", 4, 2, 2), "pipeline.microbatches"),
    (("1f1b", 4, 8, 2), "pipeline.repeats"),
    (("zigzag", 4, 8), "pipeline.schedule"),
    (("gpipe", 0, 8), "pipeline.stages"),
    (("gpipe", 2, True), "pipeline.microbatches"),
])
def test_bad_input_names_the_field(args, field):
    with pytest.raises(ConfigError) as e:
        schedules.build(*args)
    assert e.value.field == field


def test_layers_the_chunks_cannot_split():
    with pytest.raises(ConfigError) as e:
        schedules.build("interleaved_1f1b", 4, 8, 3, n_layers=16)
    assert e.value.field == "pipeline.repeats"
    with pytest.raises(ConfigError) as e:
        schedules.build("1f1b", 4, 8, n_layers=10)
    assert e.value.field == "pipeline.stages"
    schedules.build("interleaved_1f1b", 4, 8, 2, n_layers=16)


def test_format_table():
    text = schedules.format_table(schedules.build("zero_bubble", 4, 8))
    lines = text.splitlines()
    assert lines[1].split()[2:6] == ["F0", "F1", "F2", "F3"] and "W7" in lines[4]
    assert "bubble 11.1%" in lines[-1] and "bound [4, 4, 4, 4]" in lines[-1]
    wide = schedules.format_table(schedules.build("interleaved_1f1b", 4, 16, 2), width=80)
    assert all(len(line) <= 80 for line in wide.splitlines()[1:-1]) and "F0.1" in wide and "\n  ticks 10-19:" in wide
    cut = schedules.format_table(schedules.build("gpipe", 4, 64), max_blocks=2).splitlines()
    assert len(cut) == 1 + 4 + 5 + 1 + 1 and cut[-2].startswith("  ... ticks ")
