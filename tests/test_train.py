"""Exact data parallelism on thread ranks: every world size follows the world-1 loss curve, ranks hold
bitwise-equal parameters, runs are reproducible to the bit, and training learns."""

import json
import re

import numpy as np
import pytest
from ddp_oracle import hand_synced_run

from xtrain_dist.config import TrainConfig
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.optim import lr_at
from xtrain_dist.train import loop as train_module
from xtrain_dist.train.job import train
from xtrain_dist.train.launch import RankFailed


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def run(corpus, world, steps=20, batch=8, seq=32, seed=7, log=lambda line: None, **kw):
    cfg = TrainConfig(steps=steps, batch=batch, seq=seq, model="tiny", seed=seed, world_size=world, **kw).resolved()
    return train(cfg, corpus, log=log)


@pytest.fixture(scope="module")
def world1(corpus):
    return run(corpus, 1)


def assert_curves_close(a, b, rtol):
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape
    worst = np.max(np.abs(a - b) / np.abs(b))
    assert worst <= rtol, f"worst relative difference {worst:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_world_sizes_follow_world1_with_bitwise_equal_ranks(corpus, world1, world):
    """The run is tests/ddp_oracle.py's hand-written step at its world size to the bit; that differs from
    world 1 only in the order float32 adds the ranks' gradients (a few ulps, 2^-24 relative, of an element),
    which AdamW's normalised step carries into the parameters at the same relative size: measured 1.2e-7
    on the losses over 20 steps, where rank 0's gradient alone in the sum moves them by 7.8e-3."""
    report = run(corpus, world)
    cfg = TrainConfig(steps=20, batch=8, seq=32, model="tiny", seed=7, world_size=world).resolved()
    oracle = hand_synced_run(corpus, cfg)
    assert report["losses"] == oracle["losses"] and report["grad_norms"] == oracle["grad_norms"]
    assert report["param_sha256"] == [oracle["param_sha256"]] * world
    assert_curves_close(report["losses"], world1["losses"], 1e-5)


def test_world1_learns(world1):
    losses = world1["losses"]
    assert losses[0] == pytest.approx(np.log(4096), rel=0.05)  # an untrained model is close to uniform
    assert np.mean(losses[-3:]) < losses[0] - 0.5


def test_log_every_prints_the_first_step_its_multiples_and_the_last(corpus, tmp_path):
    """--log-every 4 on 10 steps: 1, 4, 8, 10; resumed after step 5, the resumed run's first step, 6, then 8, 10."""
    def printed_steps(**kw):
        lines = []
        run(corpus, 1, steps=10, batch=2, seq=16, log=lines.append, log_every=4, **kw)
        return [int(re.match(r"step +(\d+)/10 ", line)[1]) for line in lines if line.startswith("step ")]

    assert printed_steps() == [1, 4, 8, 10]
    run(corpus, 1, steps=5, batch=2, seq=16, lr_decay_steps=10, save_dir=str(tmp_path / "ck"))
    assert printed_steps(lr_decay_steps=10, resume=str(tmp_path / "ck")) == [6, 8, 10]


def test_same_command_twice_gives_the_same_bits(corpus, world1):
    again = run(corpus, 1)
    assert again["param_sha256"] == world1["param_sha256"]
    assert again["losses"] == world1["losses"]
    twice = [run(corpus, 2, steps=5)["param_sha256"] for _ in range(2)]
    assert twice[0] == twice[1]


def test_a_config_made_in_code_trains_on_the_shipped_data_by_default(world1):
    """TrainConfig without tokenizer or corpus, and no Corpus given: the shipped files, as the command line
    does (they were '' and read as the current folder: "tokenizer '.' is a directory")."""
    cfg = TrainConfig(steps=20, batch=8, seq=32, model="tiny", seed=7).resolved()
    assert train(cfg, log=lambda line: None)["param_sha256"] == world1["param_sha256"]


def test_batch_not_divisible_by_world_is_still_exact(corpus):
    """5 sequences on 2 ranks (3 + 2) is the same optimisation problem as 5 on 1 rank."""
    one = run(corpus, 1, batch=5, steps=10)
    two = run(corpus, 2, batch=5, steps=10)
    three = run(corpus, 3, batch=5, steps=10)
    assert_curves_close(two["losses"], one["losses"], 1e-4)
    assert_curves_close(three["losses"], one["losses"], 1e-4)
    assert len(set(two["param_sha256"])) == 1 and len(set(three["param_sha256"])) == 1


def test_different_seeds_differ(corpus, world1):
    other = run(corpus, 1, seed=8)
    assert other["param_sha256"] != world1["param_sha256"]


def test_report_fields(world1):
    for key in ("config", "losses", "param_sha256", "tokens_per_s", "ms_per_step", "grad_norms", "lrs"):
        assert key in world1
    assert len(world1["losses"]) == 20 and world1["tokens_per_s"] > 0
    # the rate each step used is the schedule's at that step (counted from 0), not the next one's
    cfg = TrainConfig(**world1["config"])
    assert world1["lrs"] == [lr_at(s, cfg) for s in range(20)]
    assert world1["lrs"][0] == pytest.approx(1e-3)  # 20 steps: one warmup step
    assert world1["lrs"][-1] < world1["lrs"][1]


def test_lr_schedule_warms_up_then_follows_the_cosine():
    cfg = TrainConfig(steps=100, batch=1, seq=1, lr=1.0, min_lr=0.1, warmup_steps=10, lr_decay_steps=60).resolved()
    assert [lr_at(s, cfg) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(35, cfg) == pytest.approx(0.55)  # half way through the cosine: the mean of lr and min_lr
    assert lr_at(60, cfg) == pytest.approx(0.1) and lr_at(99, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(9, 70))
    # warmup as long as the schedule: the last warmup step is at lr, the next one already at min_lr
    short = TrainConfig(steps=8, batch=1, seq=1, lr=1.0, min_lr=0.1, warmup_steps=5, lr_decay_steps=5).resolved()
    assert [lr_at(s, short) for s in range(7)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 0.1, 0.1])
    # the default warmup: a twentieth of the schedule, at least one step
    assert [TrainConfig(steps=n, batch=1, seq=1).resolved().warmup_steps for n in (10, 100, 1000)] == [1, 5, 50]


def test_the_other_lr_schedules():
    def schedule(name, **kw):
        cfg = TrainConfig(steps=100, batch=1, seq=1, lr=1.0, min_lr=0.1, warmup_steps=10, lr_decay_steps=60,
                          lr_schedule=name, **kw).resolved()
        return lambda step: lr_at(step, cfg)

    linear = schedule("linear")  # the same warmup, then a straight line to min_lr at step 60
    assert [linear(s) for s in (4, 9, 11, 35, 59, 60, 99)] == pytest.approx([0.5, 1.0, 0.982, 0.55, 0.118, 0.1, 0.1])
    constant = schedule("constant")
    assert [constant(s) for s in (4, 9, 10, 60, 99)] == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0])
    # wsd: lr until the cooldown's 20 steps before step 60, then 1 - sqrt(progress) of the way to min_lr
    wsd = schedule("wsd", cooldown_steps=20)
    assert [wsd(s) for s in (4, 10, 39, 40, 45, 55, 60, 99)] == \
        pytest.approx([0.5, 1.0, 1.0, 1.0, 0.55, 0.1 + 0.9 * (1 - 0.75 ** 0.5), 0.1, 0.1])
    assert all(wsd(s) >= wsd(s + 1) for s in range(9, 70))
    # the default cooldown: a fifth of the schedule, and only a wsd run has one
    assert TrainConfig(steps=100, batch=1, seq=1, lr_schedule="wsd").resolved().cooldown_steps == 20
    assert TrainConfig(steps=100, batch=1, seq=1).resolved().cooldown_steps is None


def test_a_run_follows_its_lr_schedule(corpus):
    lines = []
    report = run(corpus, 1, steps=12, lr_schedule="wsd", warmup_steps=2, cooldown_steps=4, log=lines.append)
    cooldown = [1e-3 - 9e-4 * 0.25 ** 0.5, 1e-3 - 9e-4 * 0.5 ** 0.5, 1e-3 - 9e-4 * 0.75 ** 0.5]  # steps 9 to 11
    assert report["lrs"] == pytest.approx([5e-4] + [1e-3] * 8 + cooldown)
    assert [float(line.split("| lr ")[1].split()[0]) for line in lines if line.startswith("step")] == \
        pytest.approx(report["lrs"], rel=5e-3)  # the progress line prints the rate each step used


def test_overfitting_one_batch_drives_its_loss_toward_zero(corpus):
    """--overfit-batch, the sanity check llm.c's tests use: forward, backward, the all-reduce and AdamW
    together can memorise 8 sequences, which the same run on fresh batches cannot; and the ranks stay equal."""
    common = dict(steps=60, lr=1e-2, lr_schedule="constant", eval_batches=2)
    overfit = run(corpus, 2, overfit_batch=True, **common)
    fresh = run(corpus, 2, **common)
    assert overfit["losses"][0] == fresh["losses"][0]  # the same first batch
    assert overfit["losses"][-1] < 0.1 < 5.0 < fresh["losses"][-1]
    assert overfit["val_losses"][-1][1] > fresh["val_losses"][-1][1]  # memorised, not learned
    assert len(set(overfit["param_sha256"])) == 1


def test_a_rank_that_raises_ends_the_run(corpus, monkeypatch):
    real_backward = train_module.GPT2.stage_backward
    calls = {"n": 0}

    def backward(self, tape, dout=None, on_grads_ready=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_backward(self, tape, dout, on_grads_ready)

    monkeypatch.setattr(train_module.GPT2, "stage_backward", backward)
    with pytest.raises(RankFailed) as info:
        run(corpus, 2, steps=5)
    assert str(info.value.error) == "injected failure"


def test_a_gradient_norm_that_overflows_stops_the_run_though_the_loss_is_finite(corpus, monkeypatch, tmp_path):
    """The loss of a step is computed before its update: a gradient of inf leaves it finite, and only the
    norm says that the update about to be saved has made the parameters nan."""
    real_backward = train_module.GPT2.stage_backward
    calls = {"n": 0}

    def backward(self, tape, dout=None, on_grads_ready=None):
        calls["n"] += 1
        if calls["n"] == 2:
            self.grads[0] = np.inf
        return real_backward(self, tape, dout, on_grads_ready)

    monkeypatch.setattr(train_module.GPT2, "stage_backward", backward)
    with pytest.raises(RankFailed) as info:
        run(corpus, 1, steps=3, save_dir=str(tmp_path / "ck"), save_every=1)
    assert re.fullmatch(r"step 2: training diverged \(loss 8\.\d+, gradient norm inf\): the parameters are no "
                        r"longer finite, so the run stops here and saves nothing; lower --lr", str(info.value.error))
    assert json.loads((tmp_path / "ck" / "trainer_state.json").read_text())["step"] == 1


@pytest.mark.parametrize("dtype, rtol", [("fp32", 1e-5), ("bf16", 5e-3)])
def test_flash_attention_trains_like_the_standard_one(corpus, dtype, rtol):
    """The same function computed another way: the curves agree to rounding (bf16 rounds the
    probabilities at other points), and ranks stay bitwise equal."""
    standard = run(corpus, 2, steps=6, dtype=dtype)
    flash = run(corpus, 2, steps=6, dtype=dtype, attention="flash")
    assert_curves_close(flash["losses"], standard["losses"], rtol)
    assert len(set(flash["param_sha256"])) == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_recompute_changes_memory_not_bits(corpus, dtype):
    """Backward recomputing GELU (1) and the layernorms (2) runs the same ops on the same inputs as forward
    did: the same parameters to the bit, with flash attention and gradient accumulation too."""
    kept = run(corpus, 2, steps=4, dtype=dtype, attention="flash", grad_accum=2)
    for level in (1, 2):
        recomputed = run(corpus, 2, steps=4, dtype=dtype, attention="flash", grad_accum=2, recompute=level)
        assert recomputed["param_sha256"] == kept["param_sha256"], level
        assert recomputed["losses"] == kept["losses"]


def test_a_recompute_level_that_does_not_exist_is_one_line(corpus, capsys):
    from xtrain_dist.errors import XtrainError
    from xtrain_dist.train.cli import main

    assert main(["2", "4", "16", "--recompute", "3"]) == 2
    assert capsys.readouterr().err.splitlines() == \
        ["train_ddp: error: --recompute must be one of 0, 1, 2, got '3'"]
    with pytest.raises(XtrainError) as info:  # a TrainConfig built in code, past argparse
        run(corpus, 1, steps=1, recompute=3)
    assert str(info.value) == "--recompute must be one of 0, 1, 2, got '3'"


def test_flash_attention_on_cuda_needs_bf16_and_64_channel_heads():
    from xtrain_dist.backend.cuda.attention import check_flash_attention
    from xtrain_dist.errors import XtrainError

    check_flash_attention("bf16", 64, "gpt2-124m")
    with pytest.raises(XtrainError, match=r"^--attention flash on --backend cuda needs --dtype bf16 "):
        check_flash_attention("fp32", 64, "gpt2-124m")
    with pytest.raises(XtrainError) as info:
        check_flash_attention("bf16", 16, "tiny")
    assert str(info.value) == ("--attention flash on --backend cuda needs 64-channel heads (GPT-2's); "
                               "model 'tiny' has 16")


def test_the_progress_line_s_time_left_is_the_steps_to_go_at_the_pace_since_the_first_step():
    from xtrain_dist.train.metrics import Progress, clock_time, progress_line

    now = [100.0]
    progress = Progress(steps=10, clock=lambda: now[0])
    now[0] = 130.0  # the first step: 30 s, compilation included; its own time stands in for the pace
    assert progress.times(1, 30.0) == (30.0, 9 * 30.0)
    now[0] = 134.0  # 4 s a step since the first ended
    assert progress.times(2, 4.0) == (34.0, 8 * 4.0)
    now[0] = 150.0  # step 3 evaluated: 16 s more, and the pace since step 1 is (150 - 130) / 2
    assert progress.times(3, 5.0) == (50.0, 7 * 10.0)
    assert [clock_time(s) for s in (0, 0.4, 59.6, 65, 3599, 3600, 90061)] == \
        ["0:00:00", "0:00:00", "0:01:00", "0:01:05", "0:59:59", "1:00:00", "25:01:01"]
    record = {"step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "ms": 5.0, "tokens_per_s": 10.0, "val_loss": 1.5}
    assert progress_line(record, 10, (50.0, 70.0)).endswith(" tok/s | 0:00:50 elapsed, 0:01:10 left | val 1.5000")
    assert "elapsed" not in progress_line(record, 10)
