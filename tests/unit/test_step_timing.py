"""A step's wall time by stage (step_timing.py): the framework's share is what the stages leave, never negative, and
generation hidden behind training is not subtracted twice."""

from __future__ import annotations

import pytest

from verifiers_rl.trainer.step_timing import StepClock, decompose


def test_remainder_is_the_framework_share():
    out = decompose(10.0, {"rollouts_wait": 1.0, "train": 5.0, "optimizer": 1.0, "sync": 1.0})
    assert out["timing/framework_s"] == pytest.approx(2.0)
    assert out["timing/framework_frac"] == pytest.approx(0.2)
    assert out["timing/wall_s"] == 10.0
    assert out["timing/train_s"] == 5.0 and out["timing/sync_s"] == 1.0


def test_overlapped_generation_is_not_subtracted():
    # 6 s of generation, of which the trainer waited 1 s: the other 5 s ran behind training
    stages = {"rollouts_wait": 1.0, "train": 5.0, "optimizer": 1.0, "sync": 1.0}
    out = decompose(10.0, stages, generation_s=6.0)
    assert out["timing/framework_s"] == pytest.approx(2.0)
    assert out["timing/generation_overlapped_s"] == pytest.approx(5.0)
    # on-policy: the whole generation was waited for, nothing overlapped
    assert decompose(10.0, stages, generation_s=1.0)["timing/generation_overlapped_s"] == 0.0


def test_remainder_never_negative():
    out = decompose(1.0, {"train": 0.8, "sync": 0.5})  # spans that overlap or outrun a coarse clock
    assert out["timing/framework_s"] == 0.0 and out["timing/framework_frac"] == 0.0
    assert decompose(0.0, {})["timing/framework_frac"] == 0.0
    assert decompose(2.0, {"train": -1.0})["timing/framework_s"] == 2.0  # a negative span counts nothing


def test_clock_laps_between_log_points():
    t = [0.0]
    clock = StepClock(now=lambda: t[0])
    clock.start()
    with clock.span("rollouts_wait"):
        t[0] = 1.5
    clock.add("train", 2.0)
    clock.open("optimizer")
    t[0] = 4.0
    clock.close("optimizer")
    clock.close("optimizer")  # closed twice: counted once
    t[0] = 5.0
    clock.start()  # a later step's start keeps the running lap
    wall, spans = clock.lap()
    assert wall == 5.0 and spans == {"rollouts_wait": 1.5, "train": 2.0, "optimizer": 2.5}
    t[0] = 7.0
    wall, spans = clock.lap()  # the next lap starts where the last ended: no second counted twice
    assert wall == 2.0 and spans == {}
