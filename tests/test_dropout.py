"""--dropout (backend/dropout.py, model.py, train/loop.py): Philox-4x32-10 against Random123's known answers,
masks keyed by what an element is (so the same bits at every layout, and a resume draws them again), the
gradient through a mask against float64 finite differences, and no dropout outside training."""

import os
import subprocess
import sys
import threading
from typing import ClassVar

import numpy as np
import pytest
from finite_differences import assert_gradients_match_finite_differences

from xtrain_dist.backend import numpy_ops
from xtrain_dist.backend.dropout import (
    ATTENTION_PROBS,
    EMBEDDINGS,
    MLP_OUT,
    DropoutSite,
    keep_mask,
    philox4x32_10,
)
from xtrain_dist.backend.numpy_ops import NumpyBackend
from xtrain_dist.comm.launch_env import Launch
from xtrain_dist.config import GPTConfig, TrainConfig
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError
from xtrain_dist.model import GPT2
from xtrain_dist.train import loop
from xtrain_dist.train.cli import parse_config
from xtrain_dist.train.job import train

SMALL = GPTConfig(vocab_size=13, n_ctx=8, n_layer=2, n_head=2, n_embd=8)


# Random123 1.14's tests/kat_vectors, the three "philox4x32 10" lines: counter (4 words), key (2), expected (4)
PHILOX_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_gives_random123s_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32_10(*counter, *key)) == expected


def site(p=0.25, seed=7, step=3, layer=1, kind=MLP_OUT, seq0=0, stride=1, groups=1, group0=0):
    return DropoutSite(p, seed, np.array([step], dtype=np.uint32), layer, kind, seq0, stride, groups, group0)


def test_a_mask_keeps_one_minus_p_and_scales_what_it_keeps():
    x = np.random.default_rng(0).standard_normal((4, 16, 64)).astype(np.float32) + 3  # no zero
    s = site(p=0.25)
    out = NumpyBackend().dropout(x, s)
    kept = out != 0
    assert np.array_equal(kept, keep_mask(x.shape, s, 3))
    assert abs(kept.mean() - 0.75) < 0.02  # 4096 draws: 4.4 standard deviations
    assert np.array_equal(out[kept], x[kept] * np.float32(4 / 3))
    # another step, layer, site, seed or sequence is another mask
    for other in (site(step=4), site(layer=0), site(kind=EMBEDDINGS), site(seed=8), site(seq0=1)):
        assert not np.array_equal(keep_mask(x.shape, other, int(other.step[0])), kept)


@pytest.mark.parametrize("shape, groups, group0", [((2, 3, 5), 1, 0), ((2, 3, 5, 5), 3, 2), ((1, 2, 4, 4), 2, 1)])
def test_every_element_takes_its_word_of_its_counter(shape, groups, group0):
    """keep_mask's shared draws against the definition, one element at a time: word e & 3 of counter
    (e >> 2, sequence, step, layer * 4 + site), e = (group0 + g) * L + l (groups not starting on a multiple of 4)."""
    s = site(p=0.5, seed=2**40 + 9, kind=ATTENTION_PROBS, seq0=3, stride=5, groups=groups, group0=group0)
    mask = keep_mask(shape, s, 11).reshape(shape[0], groups, -1)
    L = mask.shape[-1]
    for b in range(shape[0]):
        for g in range(groups):
            for l_ in range(L):
                e = (group0 + g) * L + l_
                words = philox4x32_10(e >> 2, 3 + 5 * b, 11, 1 * 4 + ATTENTION_PROBS, 9, 2**8)
                assert mask[b, g, l_] == (int(words[e & 3]) >= 2**31), (b, g, l_)


def test_a_slice_of_the_batch_or_the_heads_gets_that_slice_of_the_whole_mask():
    """What a rank holds (every world-th sequence; a tensor-parallel rank's heads) is keyed by its global place."""
    B, NH, T = 6, 4, 8
    whole = keep_mask((B, NH, T, T), site(kind=ATTENTION_PROBS, groups=NH), 3)
    for world in (2, 3):
        for rank in range(world):
            for tp in (2, 4):
                for tp_rank in range(tp):
                    heads = NH // tp
                    part = site(kind=ATTENTION_PROBS, seq0=rank, stride=world, groups=heads, group0=tp_rank * heads)
                    mine = keep_mask((len(range(rank, B, world)), heads, T, T), part, 3)
                    assert np.array_equal(mine, whole[rank::world, tp_rank * heads:(tp_rank + 1) * heads])


def randomised_model(dropout, seed=0):
    """A float64 model with every parameter random (as tests/test_model.py's), dropping with probability p."""
    model = GPT2(SMALL, numpy_ops, seed=seed, dtype=np.float64, dropout=dropout)
    rng = np.random.default_rng(seed)
    for s in model.layout:
        view = model.params[s.offset: s.offset + s.hf_size]
        view[:] = rng.standard_normal(view.size) * 0.3
    return model


def test_the_gradient_through_dropout_matches_finite_differences():
    """Every dropout's backward draws its forward's mask again: the gradient of the loss with those masks held
    (the same step and sequences) is its finite difference."""
    model = randomised_model(dropout=0.3)
    model.set_dropout_step(5)
    rng = np.random.default_rng(1)
    B, T = 3, SMALL.n_ctx
    ids, targets = (rng.integers(0, SMALL.vocab_size, (B, T)).astype(np.int32) for _ in range(2))
    rows = (4, 2)  # sequences 4, 6 and 8 of the global batch
    dloss = 1.0 / (B * T)
    model.zero_grad()
    losses, tape = model.stage_forward(ids, None, targets, dloss, rows=rows)
    model.stage_backward(tape)
    plain = model.forward(ids, targets)  # evaluation: no dropout, another loss
    assert not np.allclose(plain, losses)

    def loss():
        return float(model.stage_forward(ids, None, targets, rows=rows)[0].sum() * dloss)

    assert loss() == pytest.approx(float(losses.sum() * dloss), rel=1e-14)  # the same masks again
    assert_gradients_match_finite_differences(model, loss, rng)


def test_evaluation_and_sampling_run_without_dropout():
    """model.eval()'s semantics: a forward without `rows` (evaluation, HellaSwag, sampling) drops nothing."""
    ids = np.random.default_rng(2).integers(0, SMALL.vocab_size, (2, SMALL.n_ctx)).astype(np.int32)
    with_dropout, without = GPT2(SMALL, numpy_ops, seed=3, dropout=0.5), GPT2(SMALL, numpy_ops, seed=3)
    with_dropout.set_dropout_step(1)
    assert np.array_equal(with_dropout.forward(ids, ids), without.forward(ids, ids))
    assert np.array_equal(with_dropout.forward(ids), without.forward(ids))
    assert not np.array_equal(with_dropout.stage_forward(ids, None, ids, rows=(0, 1))[0], without.forward(ids, ids))


# ---------------------------------------------------------------------------------------------- in training
@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def run(corpus, tmp_path, name, **kw):
    kw = {"steps": 2, "batch": 4, "seq": 16, "model": "tiny", "seed": 7, "eval_batches": 0, "cpu_threads": 1,
          "dropout": 0.1, "save_dir": str(tmp_path / name), **kw}
    return train(TrainConfig(**kw).resolved(), corpus, log=lambda line: None)


class Recording(NumpyBackend):
    """The numpy backend, noting every mask its dropout op applies, by global place: (step, layer, site,
    global sequence, global head) -> the row's keep bits, drawn by the op itself (on ones, so that no
    element's zero hides its bit)."""

    masks: ClassVar[dict] = {}
    lock = threading.Lock()

    def dropout(self, x, s, wide=False):
        keep = super().dropout(np.ones_like(x), s, wide=True) != 0
        keep = keep.reshape(x.shape[0], s.groups, -1)
        with self.lock:
            for b in range(x.shape[0]):
                for g in range(s.groups):
                    where = (int(s.step[0]), s.layer, s.site, s.seq0 + b * s.seq_stride, s.group0 + g)
                    bits = keep[b, g].tobytes()
                    assert self.masks.setdefault(where, bits) == bits, where  # a second rank: the same bits
        return super().dropout(x, s, wide)


@pytest.mark.parametrize("layout", [{"world_size": 2}, {"world_size": 2, "tp": 2}, {"world_size": 2, "pp": 2},
                                    {"grad_accum": 2}, {"world_size": 4, "tp": 2, "pp": 2, "grad_accum": 2}])
def test_every_layout_draws_world_ones_masks(corpus, tmp_path, monkeypatch, layout):
    """The same masks, bit for bit, where world 1 draws them: over data-parallel ranks, tensor-parallel heads,
    pipeline stages and micro-batches (two steps of every site of every layer of every sequence)."""
    monkeypatch.setattr(loop, "get_backend", lambda *args, **kw: Recording(kw.get("dtype", "fp32")))
    Recording.masks = {}
    one = run(corpus, tmp_path, "one")
    world_one = Recording.masks
    Recording.masks = {}
    other = run(corpus, tmp_path, "other", **layout)
    assert Recording.masks.keys() == world_one.keys()
    assert len(world_one) == 2 * 4 * (1 + 2 * (1 + 4 + 1))  # steps x sequences x (embeddings + layers x sites)
    assert Recording.masks == world_one
    # the same function trained: the losses agree to float32 sums in another order
    np.testing.assert_allclose(other["losses"], one["losses"], rtol=1e-6)


def test_a_run_with_dropout_stops_and_resumes_bitwise(corpus, tmp_path):
    whole = run(corpus, tmp_path, "whole", steps=4)
    run(corpus, tmp_path, "part", steps=2)
    resumed = run(corpus, tmp_path, "resumed", steps=4, resume=str(tmp_path / "part"))
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["losses"] == whole["losses"][2:]
    # and dropout is on: without it the run is another
    assert run(corpus, tmp_path, "off", steps=4, dropout=0.0)["param_sha256"] != whole["param_sha256"]


# ---------------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("value", ["-0.1", "1", "1.5", "nan", "inf", "half"])
def test_a_bad_dropout_is_one_line(value):
    with pytest.raises(XtrainError) as err:
        parse_config(["2", "4", "16", f"--dropout={value}"], Launch("single"))
    assert str(err.value) == f"--dropout must be a number >= 0 and < 1, got '{value}'"


def test_dropout_with_flash_attention_is_one_line_and_exit_status_2():
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "4", "16", "--dropout", "0.1",
                          "--attention", "flash"], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == ["train_ddp: error: --dropout 0.1 needs --attention standard: --attention flash "
                                       "fuses the softmax into its kernels and keeps no probabilities to drop"]


@pytest.mark.parametrize("text, message", [
    ("dropout = 0.1", None),
    ("dropout = 1", "dropout must be a number >= 0 and < 1, got '1'"),
    ("dropout = true", "dropout must be a number, got true")])
def test_a_config_file_gives_dropout_as_a_number(tmp_path, text, message):
    (tmp_path / "run.toml").write_text(f"steps = 2\nbatch = 4\nseq = 16\n{text}\n")
    argv = ["--config", str(tmp_path / "run.toml")]
    if message is None:
        assert parse_config(argv, Launch("single")).dropout == 0.1
        return
    with pytest.raises(XtrainError) as err:
        parse_config(argv, Launch("single"))
    assert str(err.value) == f"--config '{tmp_path / 'run.toml'}': {message}"
