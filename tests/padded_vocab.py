"""A tokenizer whose vocabulary is not a multiple of 128 (config.VOCAB_ALIGN), so that the model's wte has
padded rows: the shipped tokenizer's 4096 ids need none. Trained as bin/train_tokenizer trains the shipped
one, on the first part of the shipped corpus, which it writes beside it."""

from pathlib import Path

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
