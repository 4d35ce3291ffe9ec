"""The ledger is plain data: these tests build one by hand, with no torch involved."""

from memfit import Block, Category, Ledger, Phase, Tick
from memfit.measure.ledger import START_TICK, ancestors

F, B, OPT = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER


def _ledger() -> Ledger:
    ticks = [Tick(F, "a", "mm"), Tick(F, "a.b", "relu"), Tick(B, "a", "mm"), Tick(B, "a", "free"), Tick(OPT, None, "add")]
    blocks = [
        Block(0, 100, Category.PARAMETER, Phase.START, None, START_TICK, None),
        Block(1, 40, Category.ACTIVATION, F, "a", 0, 3, ("a",)),
        Block(2, 30, Category.TEMPORARY, F, "a.b", 1, 2),
        Block(3, 100, Category.GRADIENT, B, "a", 2, None),
        Block(4, 5, Category.TEMPORARY, OPT, None, 4, None),
    ]
    return Ledger(blocks, ticks)


def test_curve_peak_breakdown():
    led = _ledger()
    assert led.start_bytes == 100
    # after each tick: +40, +30, (+100 -30), -40, +5
    assert led.curve() == [140, 170, 240, 200, 205]
    assert led.peak_bytes == 240
    assert led.peak_tick == 2
    bd = led.breakdown()
    assert bd[Category.PARAMETER] == 100 and bd[Category.ACTIVATION] == 40 and bd[Category.GRADIENT] == 100
    assert bd[Category.TEMPORARY] == 0  # the temporary died at the peak tick
    assert sum(bd.values()) == led.peak_bytes
    assert led.end_bytes == 205
    assert led.phase_peaks() == {Phase.START: 100, F: 170, B: 240, OPT: 205}


def test_empty_step_peaks_at_start():
    led = Ledger([Block(0, 10, Category.PARAMETER, Phase.START, None, START_TICK, None)], [])
    assert led.peak_bytes == 10 and led.peak_tick == START_TICK
    assert led.breakdown()[Category.PARAMETER] == 10


def test_round_trip():
    led = _ledger()
    again = Ledger.from_dict(led.to_dict())
    assert again.blocks == led.blocks and again.ticks == led.ticks
    assert again.curve() == led.curve()


def test_ancestors():
    assert list(ancestors("a.b.c")) == ["a.b.c", "a.b", "a", ""]
    assert list(ancestors("")) == [""]
