"""files.write_atomic and files.check_writable: how every command writes its outputs (the --report, the
benchmarks' results, the tokenizer and the corpus)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from xtrain_dist import files
from xtrain_dist.errors import XtrainError

ROOT = Path(__file__).resolve().parents[1]


def test_text_and_bytes_land_whole_in_folders_made_for_them(tmp_path):
    files.write_atomic(tmp_path / "a" / "b" / "report.json", "héllo\n", "--report")
    files.write_atomic(tmp_path / "plot.png", b"\x89PNG\x00\xff", "results file")
    assert (tmp_path / "a" / "b" / "report.json").read_bytes() == "héllo\n".encode()
    assert (tmp_path / "plot.png").read_bytes() == b"\x89PNG\x00\xff"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "plot.png"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text("old")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full_disk)
    with pytest.raises(XtrainError) as info:
        files.write_atomic(out, "new", "--report")
    assert str(info.value) == f"--report '{out}' cannot be written (No space left on device)"
    assert out.read_text() == "old" and list(tmp_path.iterdir()) == [out]


def test_a_symlink_stays_and_the_file_it_names_is_replaced(tmp_path):
    (tmp_path / "runs").mkdir()
    target, link = tmp_path / "runs" / "tokenizer.json", tmp_path / "latest.json"
    target.write_text("old")
    link.symlink_to(target)
    files.write_atomic(link, "new", "output")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "runs"]  # no temporary beside the link
    assert [p.name for p in target.parent.iterdir()] == ["tokenizer.json"]


def test_a_device_is_written_as_it_is(tmp_path):
    assert files.written_in_place(Path("/dev/null"))
    files.write_atomic("/dev/null", "discarded", "--report")
    assert Path("/dev/null").is_char_device()
    files.check_writable("/dev/null", "--report")


def test_unwritable_places_are_named_before_any_work(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    cases = [(tmp_path, f"--out '{tmp_path}' is a folder, not a file"),
             (blocker / "x.txt", f"--out '{blocker / 'x.txt'}' cannot be written (a part of its folder is a file)")]
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((locked / "x.txt", f"--out '{locked / 'x.txt'}' cannot be written (Permission denied)"))
    for path, message in cases:
        with pytest.raises(XtrainError) as info:
            files.check_writable(path, "--out")
        assert str(info.value) == message
    before = sorted(tmp_path.iterdir())
    files.check_writable(tmp_path / "new" / "deeper" / "x.txt", "--out")
    files.check_writable(tmp_path / "y.txt", "--out")
    assert sorted(tmp_path.iterdir()) == before  # no probe, and no folder made for a run refused later


def test_train_tokenizer_replaces_the_file_a_symlink_names(tmp_path):
    """The outputs of bin/ scripts go through write_atomic too: a tokenizer written through a link."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 20)
    (tmp_path / "store").mkdir()
    target, link = tmp_path / "store" / "tok.json", tmp_path / "tok.json"
    target.write_text("old")
    link.symlink_to(target)
    run = subprocess.run([sys.executable, "bin/train_tokenizer", str(corpus), str(link), "--vocab-size", "270"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert link.is_symlink() and target.read_text().startswith("{")


def test_a_path_through_a_file_is_one_line_even_without_the_check(tmp_path):
    """write_atomic on its own (the token cache calls it without check_writable): a folder part that is a
    file fails the mkdir, and the clean-up of a temporary that never was must not raise in its turn."""
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "sub" / "x.json"
    with pytest.raises(XtrainError) as info:
        files.write_atomic(out, "{}", "--report")
    assert str(info.value) == f"--report '{out}' cannot be written (a part of its folder is a file)"


def test_an_unusable_results_folder_is_named_before_any_work(tmp_path):
    """check_out_dir: the folder a benchmark writes its results into (--out)."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    cases = [(blocker, f"--out '{blocker}' is a file, not a folder"),
             (blocker / "sub", f"--out '{blocker / 'sub'}' cannot be written (a part of its path is a file)")]
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((locked, f"--out '{locked}' cannot be written (Permission denied)"))
    for path, message in cases:
        with pytest.raises(XtrainError) as info:
            files.check_out_dir(path, "--out")
        assert str(info.value) == message
    (tmp_path / "link").symlink_to(tmp_path / "new", target_is_directory=True)
    (tmp_path / "new").mkdir()
    files.check_out_dir(tmp_path / "link" / "results" / "run1", "--out")  # probed through the link
    assert list((tmp_path / "new").iterdir()) == []  # no folder made, and the probe is gone
    files.write_atomic(tmp_path / "link" / "results" / "run1" / "a.json", "{}", "results file")
    assert (tmp_path / "new" / "results" / "run1" / "a.json").read_text() == "{}"  # the write makes them


def test_paths_not_made_yet_are_one_file_where_their_symlinks_lead_there(tmp_path):
    """--report d/x.json and --metrics link/x.json with link -> d are one file before either exists."""
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to("d")
    assert files.same_file(tmp_path / "d" / "x.json", tmp_path / "link" / "x.json")
    assert files.same_file(tmp_path / "d" / "x.json", tmp_path / "d" / ".." / "d" / "x.json")
    assert not files.same_file(tmp_path / "d" / "x.json", tmp_path / "link" / "y.json")


def test_an_input_that_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path):
    """A named pipe would block open() until a writer came (forever), a device such as /dev/zero would be
    read until memory ran out: check_regular refuses them by their mode, before any open()."""
    import socket

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(fifo)  # followed: the link names a pipe
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "sock"))
        for path, kind in ((fifo, "a named pipe"), (link, "a named pipe"), ("/dev/null", "a character device"),
                           (tmp_path / "sock", "a socket")):
            with pytest.raises(XtrainError) as info, files.reading("corpus", Path(path)):
                raise AssertionError("the block ran")
            assert str(info.value) == f"corpus '{path}' is {kind}, not a regular file"
            with pytest.raises(files.NotRegularFile):
                files.read_regular(path)
    with pytest.raises(XtrainError, match=r"is a directory, not a file$"), files.reading("corpus", tmp_path):
        raise AssertionError("the block ran")
    regular = tmp_path / "text.txt"
    regular.write_text("words")
    assert files.read_regular(regular) == b"words"
    files.check_input("corpus", regular)
    files.check_input("corpus", tmp_path / "none")  # missing: the reader's own open() says so in its words
    with pytest.raises(XtrainError) as info:
        files.check_input("corpus", fifo)
    assert str(info.value) == f"corpus '{fifo}' is a named pipe, not a regular file"
