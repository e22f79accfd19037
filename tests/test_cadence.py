"""train/cadence.py: which steps of a run log, evaluate, sample, save where and stop, for every "every N
steps" option at once, in a run resumed after step 2 (so that the first step it logs is 3, not 1)."""

from pathlib import Path

from xtrain_dist.config import TrainConfig
from xtrain_dist.train.cadence import Cadence

STEPS = range(3, 11)  # the steps a run of 10 resumed after step 2 takes


def cadence(start=2, eval_batches=20) -> Cadence:
    cfg = TrainConfig(steps=10, batch=2, seq=8, log_every=4, eval_every=3, eval_batches=eval_batches,
                      sample_every=5, save_dir="run", save_every=4, keep_every=6).resolved()
    return Cadence(cfg, start)


def test_each_decision_at_its_steps():
    c = cadence()
    assert [s for s in STEPS if c.evaluates(s)] == [3, 6, 9, 10]          # every 3rd, and the last
    assert [s for s in STEPS if c.samples(s)] == [5, 10]                   # every 5th, and the last
    # the run's first step, every 4th, the last, and every step that evaluates or samples
    assert [s for s in STEPS if c.logs(s, stopping=False)] == [3, 4, 5, 6, 8, 9, 10]
    assert {s: c.saves(s, stopping=False) for s in STEPS if c.saves(s, stopping=False)} == {
        4: [Path("run")], 6: [Path("run.step000006")], 8: [Path("run")], 10: [Path("run")]}
    # the steps whose loss is read before the next is queued: those that evaluate, sample or save, the last
    assert [s for s in STEPS if c.reads_at_once(s)] == [3, 4, 5, 6, 8, 9, 10]
    assert [s for s in STEPS if cadence(eval_batches=0).reads_at_once(s)] == [4, 5, 6, 8, 10]


def test_a_stop_request_logs_and_saves_that_step_unless_it_is_the_last():
    c = cadence()
    assert c.stops(7, requested=True) and not c.stops(7, requested=False)
    assert not c.stops(10, requested=True)  # the run ends there anyway
    assert c.logs(7, stopping=True) and not c.logs(7, stopping=False)
    assert c.saves(7, stopping=True) == [Path("run")]


def test_kept_steps_start_after_the_checkpoint_resumed_from():
    assert list(cadence(start=2).kept_steps) == [6]
    assert list(cadence(start=6).kept_steps) == []  # step 6's folder was kept by the run that made it


def test_nothing_to_evaluate_means_no_evaluation_step():
    c = cadence(eval_batches=0)
    assert [s for s in STEPS if c.evaluates(s)] == []
    assert [s for s in STEPS if c.logs(s, stopping=False)] == [3, 4, 5, 8, 10]
