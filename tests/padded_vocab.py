"""A tokenizer whose vocabulary is not a multiple of 128 (config.VOCAB_ALIGN), so that the model's wte has
padded rows: the shipped tokenizer's 4096 ids need none. Trained as bin/train_tokenizer trains the shipped
one, on the first part of the shipped corpus, which it writes beside it."""

from pathlib import Path

import numpy as np
from bin_scripts import load_script

from xtrain_dist.config import VOCAB_ALIGN
from xtrain_dist.data.corpus import DEFAULT_CORPUS

ODD_VOCAB = 1000  # 1024 rows in the layout: 24 padded


def odd_vocab_files(folder: Path) -> tuple[Path, Path]:
    """(tokenizer.json, corpus.txt) in `folder`: a ByteLevel BPE of ODD_VOCAB ids (<|endoftext|> the last)."""
    tokenizer, corpus = folder / "tokenizer.json", folder / "corpus.txt"
    if not tokenizer.exists():
        text = DEFAULT_CORPUS.read_text(encoding="utf-8")[:200_000]
        corpus.write_text(text, encoding="utf-8")
        trained = load_script("train_tokenizer").train(text, ODD_VOCAB)
        assert trained.get_vocab_size(with_added_tokens=True) == ODD_VOCAB and ODD_VOCAB % VOCAB_ALIGN
        tokenizer.write_text(trained.to_str(pretty=True), encoding="utf-8")
    return tokenizer, corpus


def padded_rows(model, flat) -> np.ndarray:
    """wte's padded rows (V..Vp-1) in one of the model's flat buffers, as raw bits (-0.0 is not +0.0)."""
    wte = next(s for s in model.layout if s.name == "transformer.wte.weight")
    rows = model.ops.to_host(flat)[wte.offset + wte.hf_size: wte.offset + wte.size]
    return rows.view(f"u{rows.itemsize}")


def train_steps(model, steps: int, seed: int = 0):
    """`steps` AdamW steps (weight decay 0.1, clipping) on random batches; returns the optimizer and losses."""
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.optim import AdamW

    ops, V = model.ops, model.config.vocab_size
    optimizer = AdamW(model, TrainConfig(steps=steps, batch=2, seq=16, weight_decay=0.1))
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        ids = rng.integers(0, V, (2, 17)).astype(np.int32)
        model.zero_grad()
        losses.append(ops.to_host(model.forward(ops.from_host(ids[:, :-1]), ops.from_host(ids[:, 1:]), 1 / 32)))
        model.backward()
        optimizer.step(1e-2, ops.clip_coefficient(ops.global_norm_squared(model.grads), 1.0))
    return optimizer, losses


def assert_padded_rows_stay_zero(model, steps: int = 3) -> None:
    """After `steps` AdamW steps (weight decay, clipping) the padded rows of wte, their gradient and AdamW's m
    and v there are +0.0, bit for bit, on the model's backend; the real rows have moved."""
    assert model.config.padded_vocab_size > model.config.vocab_size
    start = model.state_dict()["transformer.wte.weight"]
    optimizer, _ = train_steps(model, steps)
    for what, flat in (("params", model.params), ("grads", model.grads), ("m", optimizer.m), ("v", optimizer.v)):
        bits = padded_rows(model, flat)
        assert bits.size == (model.config.padded_vocab_size - model.config.vocab_size) * model.config.n_embd
        assert not bits.any(), f"{what}: wte's padded rows are not +0.0"
    if model.lowp_copy is not None:  # bf16: the copy forward reads
        assert not padded_rows(model, model.lowp_copy).any(), "params_lowp: wte's padded rows are not +0"
    wte = model.state_dict()["transformer.wte.weight"]
    assert wte.shape == start.shape and not np.array_equal(wte, start)
