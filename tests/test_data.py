"""Tests of xtrain_dist.data: the shipped corpus and tokenizer, Corpus loading and caching, and the
BatchSampler's sharding, determinism and resumption."""

import json
import os
import pathlib
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from xtrain_dist.data import corpus as corpus_module
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.data.sampler import BatchSampler
from xtrain_dist.errors import XtrainError

# --- BatchSampler -------------------------------------------------------------------------------


def draw(sampler: BatchSampler, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [sampler.next() for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [5, 12])  # 12 splits evenly over every world here, 5 only over 1
def test_ranks_together_draw_exactly_the_world_1_batch(world, batch):
    tokens = np.arange(1000, dtype=np.uint16)
    whole = draw(BatchSampler(tokens, batch, seq=16, seed=7), 3)
    shards = [draw(BatchSampler(tokens, batch, seq=16, seed=7, rank=r, world=world), 3) for r in range(world)]
    for step, (x, y) in enumerate(whole):
        for rank in range(world):
            x_rank, y_rank = shards[rank][step]
            assert x_rank.shape == (len(range(rank, batch, world)), 16)
            np.testing.assert_array_equal(x_rank, x[rank::world])
            np.testing.assert_array_equal(y_rank, y[rank::world])


def test_n_local_counts_this_ranks_sequences():
    assert [BatchSampler(np.arange(100), 5, 8, 0, rank=r, world=3).n_local for r in range(3)] == [2, 2, 1]
    assert [BatchSampler(np.arange(100), 5, 8, 0, rank=r, world=2).n_local for r in range(2)] == [3, 2]


def test_windows_are_contiguous_with_targets_shifted_by_one_and_reach_both_ends():
    # With tokens[i] == i, a window is correct exactly when it counts up from its offset.
    tokens = np.arange(11, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch=64, seq=8, seed=3)
    x, y = sampler.next()
    assert x.dtype == y.dtype == np.int32 and x.shape == y.shape == (64, 8)
    np.testing.assert_array_equal(x, x[:, :1] + np.arange(8))
    np.testing.assert_array_equal(y, x + 1)
    # 11 tokens leave room for offsets 0, 1 and 2 only, and 64 draws see all three.
    assert sorted(set(x[:, 0])) == [0, 1, 2]


def test_offsets_come_from_pcg64_seeded_with_seed_and_1():
    tokens = np.arange(500, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch=6, seq=10, seed=42)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([42, 1])))
    for _ in range(3):
        x, _ = sampler.next()
        np.testing.assert_array_equal(x[:, 0], rng.integers(0, 500 - 10, size=6))


@pytest.mark.parametrize("world", [1, 2])
def test_overfit_draws_the_first_global_batch_every_time_and_its_state_never_moves(world):
    tokens = np.arange(1000, dtype=np.uint16)
    first = BatchSampler(tokens, 5, seq=16, seed=7).next()
    for rank in range(world):
        sampler = BatchSampler(tokens, 5, seq=16, seed=7, rank=rank, world=world, overfit=True)
        state = sampler.state()
        for x, y in draw(sampler, 3):
            np.testing.assert_array_equal(x, first[0][rank::world])
            np.testing.assert_array_equal(y, first[1][rank::world])
        assert {**sampler.state(), "batches_drawn": 0} == state  # only the count moves


def test_same_seed_agrees_and_another_seed_differs():
    tokens = np.arange(10_000, dtype=np.uint16)
    first, again, other = (draw(BatchSampler(tokens, 4, 32, seed), 2) for seed in (1, 1, 2))
    for (x1, y1), (x2, y2) in zip(first, again, strict=True):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(first[0][0], other[0][0])


# An odd number of offsets drawn so far leaves half of a 64-bit draw buffered in the generator (has_uint32):
# (5, 1) and (3, 3) stop there, and a state without that half resumes on another stream.
@pytest.mark.parametrize("batch, drawn, half_buffered", [(6, 3, 0), (5, 1, 1), (3, 3, 1), (5, 2, 0)])
def test_state_resumes_the_exact_stream_even_at_another_world_size(batch, drawn, half_buffered):
    tokens = np.arange(10_000, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch=batch, seq=32, seed=5)
    draw(sampler, drawn)
    state = json.loads(json.dumps(sampler.state()))  # must survive a trip through a JSON checkpoint
    assert state["pcg64"]["has_uint32"] == half_buffered
    expected = draw(sampler, 4)

    resumed = BatchSampler(tokens, batch=batch, seq=32, seed=5)
    resumed.load_state(state)
    for (x, y), (x_resumed, y_resumed) in zip(expected, draw(resumed, 4), strict=True):
        np.testing.assert_array_equal(x, x_resumed)
        np.testing.assert_array_equal(y, y_resumed)

    rank_1 = BatchSampler(tokens, batch=batch, seq=32, seed=5, rank=1, world=2)
    rank_1.load_state(state)
    np.testing.assert_array_equal(rank_1.next()[0], expected[0][0][1::2])


@pytest.mark.parametrize("changed", [{"seq": 16}, {"batch": 5}, {"seed": 1}, {"tokens": np.arange(999)}])
def test_state_from_another_stream_is_refused(changed):
    """Any of these gives other batches from the same generator state: another corpus (or val_fraction) too."""
    state = BatchSampler(np.arange(1000), batch=4, seq=8, seed=0).state()
    other = BatchSampler(**{"tokens": np.arange(1000), "batch": 4, "seq": 8, "seed": 0, **changed})
    with pytest.raises(XtrainError) as caught:
        other.load_state(state)
    saved = {"seed": 0, "batch": 4, "seq": 8, "n_tokens": 1000}
    assert str(caught.value) == f"sampler state was saved for {saved}, but this sampler draws {other._stream()}"


@pytest.mark.parametrize("rank, world", [(3, 3), (-1, 2), (0, 0)])
def test_sampler_refuses_a_rank_outside_the_world(rank, world):
    with pytest.raises(XtrainError) as caught:
        BatchSampler(np.arange(100), batch=4, seq=8, seed=0, rank=rank, world=world)
    assert str(caught.value) == f"rank {rank} is not one of the {world} ranks of this world"


def test_sampler_refuses_a_stream_shorter_than_seq_plus_one():
    with pytest.raises(XtrainError) as caught:
        BatchSampler(np.arange(8), batch=1, seq=8, seed=0)
    assert str(caught.value) == "a stream of 8 tokens is too short for SEQ=8: at least 9 are needed"
    BatchSampler(np.arange(9), batch=1, seq=8, seed=0).next()


# --- Corpus: loading and caching ----------------------------------------------------------------

LINES = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog", "on the mat sat a cat"]


def word_level_tokenizer(path: pathlib.Path) -> pathlib.Path:
    """A tokenizer of another kind than ours: whole words, with an unknown-word token."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(LINES, trainer=trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tokenizer.save(str(path))
    return path


@pytest.fixture
def small_corpus(tmp_path):
    tokenizer = word_level_tokenizer(tmp_path / "words.json")
    corpus = tmp_path / "small.txt"
    corpus.write_text("\n\n".join(LINES * 10) + "\n", encoding="utf-8")
    return tokenizer, corpus


def test_a_word_level_tokenizer_works(small_corpus, tmp_path):
    tokenizer_path, corpus_path = small_corpus
    corpus = Corpus.load(tokenizer_path, corpus_path, val_fraction=0.25, cache_dir=tmp_path / "cache")
    assert corpus.vocab_size == 10  # [UNK] and the 9 different words
    assert len(corpus.train) + len(corpus.val) == 23 * 10  # one id per word
    assert len(corpus.val) == int(0.25 * (len(corpus.train) + len(corpus.val)))
    assert corpus.train.dtype == np.uint16 and not corpus.train.flags.writeable
    assert corpus.decode(corpus.encode("the dog sat on a mat")) == "the dog sat on a mat"
    assert corpus.decode(corpus.encode("the unicorn")) == "the [UNK]"


@pytest.mark.parametrize("vocab_size, dtype", [(65_536, np.uint16), (65_537, np.uint32)])
def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path, vocab_size, dtype):
    """At the boundary: id 65535 still fits uint16, id 65536 (the 65537th) would wrap to 0."""
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "big.json"))
    top = vocab_size - 1
    (tmp_path / "big.txt").write_text(f"w1 w{top} w65535 w2\n")
    corpus = Corpus.load(tmp_path / "big.json", tmp_path / "big.txt", val_fraction=0, cache_dir=tmp_path)
    assert corpus.vocab_size == vocab_size and corpus.train.dtype == dtype
    assert corpus.train.tolist() == [1, top, 65_535, 2]


def test_a_tokenizer_saved_with_truncation_and_padding_still_gives_every_token(small_corpus, tmp_path):
    tokenizer_path, corpus_path = small_corpus
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.enable_truncation(max_length=3)  # every line has 5 or 6 words
    tokenizer.enable_padding(length=8, pad_id=0, pad_token="[UNK]")
    tokenizer.save(str(tokenizer_path))
    corpus = Corpus.load(tokenizer_path, corpus_path, val_fraction=0, cache_dir=tmp_path / "cache")
    assert len(corpus.train) == 23 * 10  # one id per word, none cut, none added
    assert corpus.decode(corpus.train) == " ".join(LINES * 10)


def test_the_second_load_reads_the_cache_instead_of_encoding(small_corpus, tmp_path, monkeypatch):
    tokenizer_path, corpus_path = small_corpus
    cache = tmp_path / "cache"
    first = Corpus.load(tokenizer_path, corpus_path, cache_dir=cache)
    assert len(list(cache.glob("tokens-*.npz"))) == 1

    def no_encoding(*args):
        raise AssertionError("encoded although the ids were cached")

    monkeypatch.setattr(corpus_module, "_encode_text", no_encoding)
    second = Corpus.load(tokenizer_path, corpus_path, cache_dir=cache)
    np.testing.assert_array_equal(first.train, second.train)
    assert not second.train.flags.writeable


def test_the_cache_is_keyed_by_the_corpus_and_the_tokenizer(small_corpus, tmp_path):
    tokenizer_path, corpus_path = small_corpus
    cache = tmp_path / "cache"
    before = Corpus.load(tokenizer_path, corpus_path, val_fraction=0, cache_dir=cache)
    corpus_path.write_text("a dog sat on the cat\n")
    after = Corpus.load(tokenizer_path, corpus_path, val_fraction=0, cache_dir=cache)
    assert after.decode(after.train) == "a dog sat on the cat"
    assert len(after.train) != len(before.train)

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.add_tokens(["unicorn"])
    tokenizer.save(str(tokenizer_path))
    Corpus.load(tokenizer_path, corpus_path, val_fraction=0, cache_dir=cache)
    assert len(list(cache.glob("tokens-*.npz"))) == 3


def test_the_cache_dir_defaults_to_xtrain_cache(small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XTRAIN_CACHE", str(tmp_path / "from-env"))
    Corpus.load(*small_corpus)
    assert len(list((tmp_path / "from-env").glob("tokens-*.npz"))) == 1


def test_a_cache_dir_that_cannot_be_written_means_no_cache(small_corpus, tmp_path):
    (tmp_path / "a-file").write_text("")
    corpus = Corpus.load(*small_corpus, cache_dir=tmp_path / "a-file" / "cache")  # works even as root
    assert len(corpus.train) > 0


def test_a_damaged_cache_file_is_rebuilt(small_corpus, tmp_path):
    cache = tmp_path / "cache"
    expected = Corpus.load(*small_corpus, cache_dir=cache).train
    (cached,) = cache.glob("tokens-*.npz")
    cached.write_bytes(b"PK\x03\x04")
    np.testing.assert_array_equal(Corpus.load(*small_corpus, cache_dir=cache).train, expected)
    with np.load(cached) as rebuilt:
        np.testing.assert_array_equal(rebuilt["ids"][: len(expected)], expected)
    # a well-formed file whose ids were edited (here: cut short) does not match its digest
    with np.load(cached) as good:
        ids, digest = good["ids"], good["sha256"]
    np.savez(cached, ids=ids[:9], sha256=digest)
    np.testing.assert_array_equal(Corpus.load(*small_corpus, cache_dir=cache).train, expected)
    with np.load(cached) as rebuilt:
        assert np.array_equal(rebuilt["ids"], ids)
    # the right ids with their digest, in another dtype than the vocabulary's (a cache of another version)
    wide = ids.astype(np.int64)
    np.savez(cached, ids=wide, sha256=corpus_module._ids_digest(wide))
    reloaded = Corpus.load(*small_corpus, cache_dir=cache).train
    assert reloaded.dtype == np.uint16
    np.testing.assert_array_equal(reloaded, expected)


# --- Corpus: bad input gives one line that names the file ---------------------------------------


def load_error(tokenizer, corpus, tmp_path, seq=None) -> str:
    with pytest.raises(XtrainError) as caught:
        corpus_data = Corpus.load(tokenizer, corpus, cache_dir=tmp_path / "cache")
        if seq is not None:
            corpus_data.check_seq(seq)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_tokenizer_files(small_corpus, tmp_path):
    _, corpus = small_corpus
    missing, folder, garbage, not_utf8 = (tmp_path / n for n in ("x.json", "d.json", "bad.json", "b.json"))
    folder.mkdir()
    garbage.write_text('{"model": ')
    not_utf8.write_bytes(b"\xff\xfe{}")
    assert load_error(missing, corpus, tmp_path) == f"tokenizer '{missing}' not found"
    assert load_error(folder, corpus, tmp_path) == f"tokenizer '{folder}' is a directory, not a file"
    assert load_error(not_utf8, corpus, tmp_path) == (
        f"tokenizer '{not_utf8}' is not a tokenizers JSON file (not UTF-8 text)"
    )
    other = tmp_path / "other.json"
    other.write_text('{"vocab": ["a", "b"]}')  # JSON, but not a tokenizer
    for bad in (garbage, other):
        # The reason in brackets is the library's own, and its wording may change between versions.
        expected = rf"tokenizer '{re.escape(str(bad))}' is not a tokenizers JSON file \(.+\)"
        assert re.fullmatch(expected, load_error(bad, corpus, tmp_path))


@pytest.mark.parametrize("vocab", [{}, {"a": 0}])
def test_a_tokenizer_of_fewer_than_two_tokens_is_refused(small_corpus, tmp_path, vocab):
    """With one token every loss is 0 from the first step (nothing to predict); with none every corpus is empty."""
    _, corpus = small_corpus
    path = tmp_path / "few.json"
    Tokenizer(models.WordLevel(vocab, unk_token="a" if vocab else None)).save(str(path))
    words = "1 token" if vocab else "0 tokens"
    assert load_error(path, corpus, tmp_path) == (
        f"tokenizer '{path}' has {words} in its vocabulary: a language model needs at least 2 to choose between")


def test_bad_corpus_files(small_corpus, tmp_path):
    tokenizer, _ = small_corpus
    missing, folder, binary, empty = (tmp_path / n for n in ("c.txt", "dir.txt", "bin.txt", "empty.txt"))
    folder.mkdir()
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    empty.write_text(" \n\n")
    assert load_error(tokenizer, missing, tmp_path) == f"corpus '{missing}' not found"
    assert load_error(tokenizer, folder, tmp_path) == f"corpus '{folder}' is a directory, not a file"
    assert load_error(tokenizer, binary, tmp_path) == f"corpus '{binary}' is not UTF-8 text"
    assert load_error(tokenizer, empty, tmp_path) == f"corpus '{empty}' is empty"


def test_an_unreadable_file(small_corpus, tmp_path, monkeypatch):
    tokenizer, corpus = small_corpus
    corpus.chmod(0)
    if os.access(corpus, os.R_OK):  # root reads anything: make the refusal happen another way
        read_bytes = pathlib.Path.read_bytes

        def refuse(path):
            if path == corpus:
                raise PermissionError(13, "Permission denied", str(path))
            return read_bytes(path)

        monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)
    assert load_error(tokenizer, corpus, tmp_path) == f"corpus '{corpus}' cannot be read (permission denied)"


def test_a_corpus_too_short_for_seq(small_corpus, tmp_path):
    tokenizer, corpus = small_corpus
    corpus.write_text(" ".join(["cat"] * 55))  # 55 tokens: 50 train, 5 val
    assert load_error(tokenizer, corpus, tmp_path, seq=64) == (
        f"corpus '{corpus}' is too short for SEQ=64: its train split has 50 tokens, at least 65 are needed"
    )
    assert load_error(tokenizer, corpus, tmp_path, seq=50) == (  # a window of 50 needs its 51st token as target
        f"corpus '{corpus}' is too short for SEQ=50: its train split has 50 tokens, at least 51 are needed"
    )
    Corpus.load(tokenizer, corpus, cache_dir=tmp_path / "cache").check_seq(49)


def test_a_word_the_tokenizer_cannot_encode(tmp_path, unencodable_tokenizer):
    (tmp_path / "c.txt").write_text("cat dog")
    message = load_error(unencodable_tokenizer, tmp_path / "c.txt", tmp_path)
    assert message.startswith(f"tokenizer '{tmp_path}/t.json' cannot encode corpus '{tmp_path}/c.txt' (")


# --- the shipped files --------------------------------------------------------------------------


def test_the_shipped_corpus_is_1_to_5_mb_of_clean_text():
    raw = DEFAULT_CORPUS.read_bytes()
    assert 1_000_000 <= len(raw) <= 5_000_000
    text = raw.decode("utf-8")
    assert "\r" not in text and "gutenberg" not in text.lower()


def test_the_shipped_tokenizer_is_byte_level_bpe_with_4096_ids_and_round_trips_a_passage(monkeypatch):
    monkeypatch.setattr(corpus_module, "_ENCODE_GROUP", 7)  # the passage's ~400 paragraphs go in many groups
    tokenizer = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 4096
    assert tokenizer.token_to_id("<|endoftext|>") == 4095
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    passage = text[len(text) // 2 : len(text) // 2 + 50_000]
    batch_sizes = []

    class CountingTokenizer:
        def encode_batch(self, texts, **options):
            batch_sizes.append(len(texts))
            return tokenizer.encode_batch(texts, **options)

    ids = corpus_module._encode_text(CountingTokenizer(), passage)
    assert max(batch_sizes) == 7 and len(batch_sizes) > 50, batch_sizes
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == passage
    # Encoding paragraph by paragraph, a group at a time, must give exactly the ids of one encode of the whole passage.
    assert ids.tolist() == tokenizer.encode(passage, add_special_tokens=False).ids
    # Bytes outside the corpus's ASCII still round-trip: that is what the 256 byte symbols are for.
    odd = "Ægir’s naïve café — 東京 🎭 <|endoftext|>"
    assert tokenizer.decode(corpus_module._encode_text(tokenizer, odd).tolist(), skip_special_tokens=False) == odd


def test_the_shipped_corpus_loads_into_read_only_uint16_splits(tmp_path):
    corpus = Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS, val_fraction=0.1, cache_dir=tmp_path)
    n = len(corpus.train) + len(corpus.val)
    assert corpus.vocab_size == 4096 and corpus.train.dtype == corpus.val.dtype == np.uint16
    assert len(corpus.val) == int(0.1 * n) and not corpus.val.flags.writeable
    start = DEFAULT_CORPUS.read_text(encoding="utf-8")[:2000]
    assert corpus.decode(corpus.train[:2000]).startswith(start[:1000])
