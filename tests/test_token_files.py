"""Token files in llm.c's format as a corpus: written by bin/tokenize_corpus, read as one stream from one
file or a pattern of shards, held to the text they were made of (the oracle: Corpus.load of that text)
and to a header built here from llm.c's own layout, and refused with one line when they are not whole."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xtrain_dist.data import corpus as corpus_module
from xtrain_dist.data import token_files
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.data.sampler import BatchSampler
from xtrain_dist.data.token_files import TokenFiles
from xtrain_dist.errors import XtrainError
from xtrain_dist.eval.evaluate import Evaluator

REPO = Path(__file__).resolve().parent.parent
# a slice of the shipped text with its paragraph breaks, plus what a block cut could split wrongly:
# multi-byte characters, \r\n (kept as it is: Corpus.load decodes bytes without newline translation)
TEXT = DEFAULT_CORPUS.read_text()[:20_000] + "\r\n\r\nJULIETTE. Adieu, ça va — 𝄞 fin.\n\n\nEND\n"


def llmc_file(path: Path, ids, magic=20240520, version=1, dtype="<u2", count=None) -> Path:
    """A token file laid out as llm.c's write_datafile writes one: 256 int32 (magic, version, count, zeros)."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype=dtype).tobytes())
    return path


def tokenize(*args):
    return subprocess.run([sys.executable, "bin/tokenize_corpus", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def text_and_tokens(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    text = folder / "text.txt"
    text.write_bytes(TEXT.encode())
    out = tokenize(DEFAULT_TOKENIZER, text, folder / "text.bin", "--block-chars", 997)  # ~20 blocks
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].startswith(f"wrote {folder / 'text.bin'}: ")
    return text, folder / "text.bin"


def test_a_token_file_made_of_a_text_is_that_text_to_the_trainer(text_and_tokens, tmp_path):
    text, tokens = text_and_tokens
    from_text = Corpus.load(DEFAULT_TOKENIZER, text, cache_dir=tmp_path)
    from_file = Corpus.load(DEFAULT_TOKENIZER, tokens)
    assert isinstance(from_file.train, TokenFiles) and len(from_file.train) == len(from_text.train)
    assert len(from_file.val) == len(from_text.val)
    n = len(from_text.train) - 9
    np.testing.assert_array_equal(from_file.train.windows(np.arange(n), 9),
                                  from_text.train[np.arange(n)[:, None] + np.arange(9)])
    np.testing.assert_array_equal(from_file.val.windows(np.array([0]), len(from_text.val))[0], from_text.val)
    # the digests checkpoints and processes compare: a run on the text resumes on its token file
    assert (from_file.train_sha256, from_file.val_sha256) == (from_text.train_sha256, from_text.val_sha256)


@pytest.mark.parametrize("block_chars", [1, 2, 3, 50, 1 << 20])
def test_encoding_block_by_block_gives_the_ids_of_one_encode(block_chars):
    tokenizer = corpus_module.read_tokenizer(DEFAULT_TOKENIZER)
    text = TEXT[-3000:]
    blocks = corpus_module.text_blocks(io.StringIO(text, newline=""), block_chars)
    streamed = np.concatenate([corpus_module._encode_text(tokenizer, block) for block in blocks])
    np.testing.assert_array_equal(streamed, corpus_module._encode_text(tokenizer, text))


def test_the_header_is_llmc_s_and_llmc_s_files_read_back(text_and_tokens, tmp_path):
    _, tokens = text_and_tokens
    raw = tokens.read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    ids = np.frombuffer(raw[1024:], dtype="<u2")
    assert header[:3].tolist() == [20240520, 1, len(ids)] and not header[3:].any()
    # uint32 ids (llm.c's magic 20240801, version 7) and an id past 65535 under a large vocabulary
    wide = llmc_file(tmp_path / "wide.bin", [3, 70_000, 5, 1], magic=20240801, version=7, dtype="<u4")
    span = token_files._open_token_file("corpus", wide)
    assert span.dtype == np.dtype("<u4") and span.read(0, 4).tolist() == [3, 70_000, 5, 1]
    header_bytes, body = token_files.token_file_chunks(np.array([3, 70_000, 5, 1]), vocab_size=100_000)
    assert header_bytes + body.tobytes() == wide.read_bytes()


def test_shards_are_one_stream_in_name_order_and_sample_as_the_array_does(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4096, size=3000).astype(np.uint16)
    for name, lo, hi in (("b_002.bin", 2500, 3000), ("b_000.bin", 0, 1100), ("b_001.bin", 1100, 2500)):
        llmc_file(tmp_path / name, ids[lo:hi])
    corpus = Corpus.load(DEFAULT_TOKENIZER, tmp_path / "b_*.bin", val_fraction=0.25)
    train, val = ids[:2250], ids[2250:]
    assert len(corpus.train) == 2250 and len(corpus.val) == 750
    starts = np.array([0, 1090, 1095, 2200, 2249 - 40])  # within a shard and straddling each end
    np.testing.assert_array_equal(corpus.train.windows(starts, 41), train[starts[:, None] + np.arange(41)])
    np.testing.assert_array_equal(corpus.val.windows(np.array([0, 709]), 41)[1], val[709:750])
    for rank in range(2):
        in_files, in_memory = (BatchSampler(t, 6, 40, seed=5, rank=rank, world=2) for t in (corpus.train, train))
        for _ in range(4):
            for a, b in zip(in_files.next(), in_memory.next(), strict=True):
                np.testing.assert_array_equal(a, b)
        assert in_files.state() == in_memory.state()
    held_out = [Evaluator(v, 4, 32, 3, 0, 1, backend=_HostOps()).batches for v in (corpus.val, val)]
    for (x, y), (x2, y2) in zip(*held_out, strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)


class _HostOps:
    @staticmethod
    def from_host(a):
        return a


def test_a_validation_corpus_is_held_out_whole_and_the_corpus_trains_whole(text_and_tokens, tmp_path):
    text, tokens = text_and_tokens
    val = llmc_file(tmp_path / "val.bin", [7, 8, 9, 10, 11])
    corpus = Corpus.load(DEFAULT_TOKENIZER, tokens, val_path=val)
    whole = Corpus.load(DEFAULT_TOKENIZER, text, val_fraction=0, cache_dir=tmp_path)
    assert len(corpus.train) == len(whole.train) and corpus.train_sha256 == whole.train_sha256
    assert corpus.val.windows(np.array([0]), 5).tolist() == [[7, 8, 9, 10, 11]]
    assert corpus.val_source == f"validation corpus '{val}'"
    text_val = Corpus.load(DEFAULT_TOKENIZER, tokens, val_path=text, cache_dir=tmp_path)  # text validates too
    assert text_val.val_sha256 == whole.train_sha256


def test_a_corpus_that_is_its_own_validation_corpus_is_read_once(text_and_tokens, monkeypatch):
    """python -m xtrain_dist.evaluate DIR CORPUS holds all of CORPUS out: one pass over the token files for
    the ids' check and digest, not two, and the digest of all of them."""
    _, tokens = text_and_tokens
    whole = Corpus.load(DEFAULT_TOKENIZER, tokens, val_fraction=0).train_sha256
    passes = []
    real = corpus_module._stream_sha256
    monkeypatch.setattr(corpus_module, "_stream_sha256", lambda ids, *rest: passes.append(ids) or real(ids, *rest))
    once = Corpus.load(DEFAULT_TOKENIZER, tokens, val_path=tokens)
    assert len(passes) == 1 and once.val is once.train
    assert once.train_sha256 == once.val_sha256 == whole


def refusal(tmp_path, corpus, **kwargs) -> str:
    with pytest.raises(XtrainError) as err:
        Corpus.load(DEFAULT_TOKENIZER, corpus, cache_dir=tmp_path, **kwargs)
    return str(err.value)


def test_tokenize_corpus_shards_are_the_one_file_cut_where_asked(text_and_tokens, tmp_path):
    """--shard-ids 1000 --val-ids 700: the val shard and then the train shards hold the single file's ids
    in order, 700 then 1000 a shard, and the pattern and --val-corpus read them back as that stream."""
    text, tokens = text_and_tokens
    ids = np.frombuffer(tokens.read_bytes()[1024:], dtype="<u2")
    out = tokenize(DEFAULT_TOKENIZER, text, tmp_path / "t", "--shard-ids", 1000, "--val-ids", 700, "--block-chars", 997)
    assert out.returncode == 0, out.stderr
    n_train = -(-(len(ids) - 700) // 1000)
    names = ["t_val_000000.bin"] + [f"t_train_{i:06d}.bin" for i in range(1, n_train + 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    shards = [np.frombuffer((tmp_path / name).read_bytes()[1024:], dtype="<u2") for name in names]
    assert [len(s) for s in shards[:-1]] == [700] + [1000] * (n_train - 1)
    np.testing.assert_array_equal(np.concatenate(shards), ids)
    corpus = Corpus.load(DEFAULT_TOKENIZER, tmp_path / "t_train_*.bin", val_path=tmp_path / "t_val_000000.bin")
    assert len(corpus.train) == len(ids) - 700
    np.testing.assert_array_equal(corpus.train.windows(np.array([0, 2000]), 500), [ids[700:1200], ids[2700:3200]])
    np.testing.assert_array_equal(corpus.val.windows(np.array([0]), 700)[0], ids[:700])
    # without --val-ids, train shards from 000000
    out = tokenize(DEFAULT_TOKENIZER, text, tmp_path / "u", "--shard-ids", 4000)
    assert out.returncode == 0 and (tmp_path / "u_train_000000.bin").exists(), out.stderr


def test_tokenize_corpus_refuses_shards_it_cannot_write_whole(text_and_tokens, tmp_path):
    text, tokens = text_and_tokens
    n = (len(tokens.read_bytes()) - 1024) // 2
    assert tokenize_error(DEFAULT_TOKENIZER, text, tmp_path / "t", "--val-ids", 5) == \
        "--val-ids needs --shard-ids: the validation ids go into a shard of their own"
    # a text no longer than --val-ids: nothing is written, not a val shard alone
    assert tokenize_error(DEFAULT_TOKENIZER, text, tmp_path / "t", "--shard-ids", 100, "--val-ids", n) == \
        f"the text has {n} ids: --val-ids {n} leaves none to train on"
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "t_train_000007.bin").write_bytes(b"old")
    assert tokenize_error(DEFAULT_TOKENIZER, text, tmp_path / "t", "--shard-ids", 100) == (
        f"output '{tmp_path / 't_train_000007.bin'}' is there from before (1 shard(s) under '{tmp_path / 't'}'): "
        "remove them first, or a pattern over the shards would mix two texts")
    assert [p.name for p in tmp_path.iterdir()] == ["t_train_000007.bin"]


def test_token_files_that_are_not_whole_are_refused_by_name(tmp_path):
    short = llmc_file(tmp_path / "short.bin", [1, 2, 3], count=5)
    assert refusal(tmp_path, short) == (f"corpus '{short}' is not a whole llm.c token file: its header counts 5 ids "
                                        "(1034 bytes with the header), the file has 1030 bytes")
    version = llmc_file(tmp_path / "v2.bin", [1, 2], version=2)
    assert refusal(tmp_path, version) == (f"corpus '{version}' is an llm.c token file of version 2; with magic "
                                          "20240520 this trainer reads version 1")
    cut = tmp_path / "cut.bin"
    cut.write_bytes(llmc_file(tmp_path / "x.bin", [1]).read_bytes()[:100])
    assert refusal(tmp_path, cut) == f"corpus '{cut}' is not an llm.c token file (shorter than its 1024-byte header)"
    # another magic: a token file's header named as such, not the file refused as text that is not UTF-8, by
    # its .bin name or by the zeros that end its header
    for name in ("magic.bin", "magic.tokens"):
        magic = llmc_file(tmp_path / name, [1, 2], magic=20240999)
        assert refusal(tmp_path, magic) == (f"corpus '{magic}' is not an llm.c token file (magic 20240999, not "
                                            "20240520 or 20240801)")
    empty = llmc_file(tmp_path / "empty.bin", [])
    assert refusal(tmp_path, empty) == f"corpus '{empty}' is empty"
    past = llmc_file(tmp_path / "past.bin", [1, 4096, 2])  # the shipped tokenizer has ids 0..4095
    assert refusal(tmp_path, past) == (f"token file '{past}' holds id 4096, outside the 4096 ids of tokenizer "
                                       f"'{DEFAULT_TOKENIZER}': were its tokens made with another tokenizer?")
    assert refusal(tmp_path, DEFAULT_CORPUS, val_path=version).startswith(f"validation corpus '{version}' is an ")


def test_patterns_name_token_files_only(tmp_path):
    assert refusal(tmp_path, tmp_path / "none_*.bin") == f"corpus '{tmp_path / 'none_*.bin'}' matches no file"
    llmc_file(tmp_path / "s_0.bin", [1, 2, 3])
    (tmp_path / "s_1.bin").write_text("some text")
    assert refusal(tmp_path, tmp_path / "s_*.bin") == (
        f"corpus '{tmp_path / 's_*.bin'}' matches '{tmp_path / 's_1.bin'}', which is not an llm.c token file (a "
        "pattern names token files only)")


def test_train_ddp_on_the_token_file_trains_as_on_its_text(text_and_tokens, tmp_path):
    """The same ids, so the same run: losses and parameters bit for bit, with the validation from a file."""
    text, tokens = text_and_tokens
    reports = []
    for corpus in (text, tokens):
        report = tmp_path / f"{corpus.suffix[1:]}.json"
        args = [3, 4, 16, DEFAULT_TOKENIZER, corpus, "--world-size", 2, "--eval-batches", 2, "--val-corpus", tokens,
                "--report", report]
        out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", *map(str, args)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        reports.append(json.loads(report.read_text()))
    a, b = reports
    assert a["losses"] == b["losses"] and a["val_losses"] == b["val_losses"]
    assert a["param_sha256"] == b["param_sha256"]


def tokenize_error(*args) -> str:
    out = tokenize(*args)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1
    return out.stderr.strip().removeprefix("tokenize_corpus: error: ")


def test_tokenize_corpus_refuses_bad_input_in_one_line(tmp_path):
    out = tmp_path / "out.bin"
    assert tokenize_error(DEFAULT_TOKENIZER, tmp_path / "none.txt", out) == f"text '{tmp_path / 'none.txt'}' not found"
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café\n".encode("latin-1"))
    assert tokenize_error(DEFAULT_TOKENIZER, latin1, out) == \
        f"text '{latin1}' is not UTF-8 text (invalid continuation byte)"
    blank = tmp_path / "blank.txt"
    blank.write_text("")
    assert tokenize_error(DEFAULT_TOKENIZER, blank, out) == f"text '{blank}' is empty"
    assert tokenize_error(DEFAULT_TOKENIZER, latin1, latin1) == (
        f"output '{latin1}' is the text '{latin1}': it would be replaced by the token file")
    assert tokenize_error(latin1, latin1, out).startswith(f"tokenizer '{latin1}' is not a tokenizers JSON file")
    assert not out.exists()


def test_tokenize_corpus_names_a_text_its_tokenizer_cannot_encode(tmp_path, unencodable_tokenizer):
    """A new word for a tokenizer with no unknown-word token: one line, as Corpus.load says it."""
    (tmp_path / "c.txt").write_text("cat dog")
    assert tokenize_error(unencodable_tokenizer, tmp_path / "c.txt", tmp_path / "out.bin").startswith(
        f"tokenizer '{tmp_path / 't.json'}' cannot encode text '{tmp_path / 'c.txt'}' (")
    assert not (tmp_path / "out.bin").exists()


def test_train_ddp_names_a_bad_token_file_in_one_line(tmp_path):
    short = llmc_file(tmp_path / "short.bin", [1, 2, 3], count=4)
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "2", "16", str(DEFAULT_TOKENIZER),
                          str(short)], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (2, f"train_ddp: error: corpus '{short}' is not a whole llm.c token file: "
                                               "its header counts 4 ids (1032 bytes with the header), the file has "
                                               "1030 bytes\n")
