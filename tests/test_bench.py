"""The benchmark scripts run end to end at toy sizes and write what they promise; the figures they
derive follow the definitions (nccl-tests' bus bandwidth, the overhead model's b*)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bin_scripts import load_script

from xtrain_dist.config import TrainConfig
from xtrain_dist.parallel import ddp as ddp_sync

if importlib.util.find_spec("matplotlib") is None:  # looked for, not imported: each worker would import it
    pytest.skip("matplotlib is not installed (pip install -e '.[plot]')", allow_module_level=True)
BIN = Path(__file__).resolve().parent.parent / "bin"


def script(name, *args, timeout=300, env=None):
    return subprocess.run([sys.executable, str(BIN / name), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def results(made_once):
    """The benchmarks' runs (PyTorch's DDP among them: most of this module's time), made once for the whole run."""
    return made_once("bench-results", _bench_results)


def _bench_results(out):
    coll = script("bench_collectives", "--worlds", "2,3", "--sizes", "4K,64K,16M", "--iters", "3", "--warmup", "1",
                  "--max-mb", "16", "--out", out)  # 16 MiB is measured: --max-mb is the largest size, not above it
    assert coll.returncode == 0, coll.stderr
    # without OPENBLAS_NUM_THREADS (conftest sets it): bench_ddp chooses cores / world itself
    ddp = script("bench_ddp", "--model", "tiny", "--batch", "2", "--seq", "16", "--steps", "1", "--repeats", "1",
                 "--buckets", "0.1,1", "--out", out, env={k: v for k, v in os.environ.items()
                                                           if k != "OPENBLAS_NUM_THREADS"})
    assert ddp.returncode == 0, ddp.stderr
    fit = script("fit_overhead_model", "--collectives", out / "collectives.json", "--ddp", out / "ddp.json")
    assert fit.returncode == 0, fit.stderr
    return out, fit.stdout


@pytest.mark.long
def test_every_script_writes_json_markdown_and_png(results):
    out, _ = results
    for stem in ("collectives", "ddp", "overhead_model"):
        for suffix in (".json", ".md", ".png"):
            assert (out / f"{stem}{suffix}").stat().st_size > 0, f"{stem}{suffix}"
    assert not list(out.glob(".*tmp*"))  # nothing half-written left behind
    assert "Machine: " in (out / "ddp.md").read_text()


def test_bench_cpu_per_op_races_the_same_function_on_both_sides():
    """--per-op times each op of the step against PyTorch's: on the tiny model's shapes each pair computes the
    same result (the input's gradient for a backward), so the race is between two ways of doing one thing."""
    pytest.importorskip("torch")
    bench = load_script("bench_cpu")
    cfg = TrainConfig(steps=1, batch=2, seq=8, model="tiny", seed=1).resolved()
    pairs = bench.op_pairs(cfg, 96)
    assert {"gelu_backward", "layernorm_backward", "matmul_backward classifier"} <= {name for name, *_ in pairs}
    for name, calls, ours, theirs in pairs:
        got, want = ours(), theirs()
        assert calls >= 1 and (got is None) == (want is None), name
        if got is not None:
            np.testing.assert_allclose(got.reshape(want.shape), want.detach().numpy(), rtol=2e-4, atol=1e-5,
                                       err_msg=name)


@pytest.mark.long
def test_bench_cpu_writes_its_rows_and_both_sides_learn_the_same(tmp_path):
    """numpy against PyTorch: the same weights and batches give the same losses to float32 rounding,
    each side's figure is the median of its steps, and the three files are written; --beside-a-busy-core adds
    the default's step and each thread count's beside a busy core, and the ratio to the best."""
    pytest.importorskip("torch")
    run = script("bench_cpu", "--presets", "tiny", "--batch", "4", "--seq", "16", "--steps", "3", "--warmup", "1",
                 "--repeats", "2", "--beside-a-busy-core", "--out", tmp_path)
    assert run.returncode == 0, run.stderr
    for suffix in (".json", ".md", ".png"):
        assert (tmp_path / f"cpu_step{suffix}").stat().st_size > 0
    data = json.loads((tmp_path / "cpu_step.json").read_text())
    assert data["command"].startswith("bench_cpu --presets tiny") and data["machine"]["cores"] >= 1
    (row,) = data["rows"]
    assert row["max_loss_diff"] < 1e-5
    for side in ("numpy", "torch", "torch_sdpa"):
        assert 0 < row[f"{side}_ms_min"] <= row[f"{side}_ms"]
    assert row["numpy_over_torch"] == pytest.approx(row["numpy_ms"] / row["torch_ms"])
    assert "| tiny | 4 x 16 |" in (tmp_path / "cpu_step.md").read_text()
    (busy,) = data["busy_core_rows"]
    assert list(busy["threads_ms"]) == [str(t) for t in range(1, len(os.sched_getaffinity(0)) + 1)]
    assert busy["default_over_best"] == pytest.approx(busy["default_ms"] / min(busy["threads_ms"].values()))
    assert "### World 1 beside a process that keeps one core busy" in (tmp_path / "cpu_step.md").read_text()


@pytest.mark.long
def test_bench_sample_races_equal_draws(tmp_path):
    """Ours with and without the cache and transformers' generate draw the same greedy tokens; a prompt
    that would pass the model's positions is skipped, not timed on a path that no longer caches."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    run = script("bench_sample", "--presets", "tiny", "--prompts", "5,100,125", "--tokens", "8", "--repeats", "2",
                 "--out", tmp_path)
    assert run.returncode == 0, run.stderr
    assert "tiny, prompt 125: skipped, 125 + 8 tokens pass its 128 positions (where no side caches)" in run.stdout
    data = json.loads((tmp_path / "sample.json").read_text())
    assert [(r["prompt"], r["same_tokens"]) for r in data["rows"]] == [(5, True), (100, True)]
    for r in data["rows"]:
        assert r["cached_speedup"] == pytest.approx(r["uncached_ms_per_token"] / r["cached_ms_per_token"])
    assert "| tiny | 100 |" in (tmp_path / "sample.md").read_text()


@pytest.mark.long
def test_bench_recompute_times_every_level_and_checks_their_bits(tmp_path):
    run = script("bench_recompute", "3", "4", "32", "--model", "tiny", "--repeats", "2", "--out", tmp_path)
    assert run.returncode == 0, run.stderr
    data = json.loads((tmp_path / "recompute.json").read_text())
    rows = data["rows"]
    assert [r["level"] for r in rows] == [0, 1, 2]
    assert len({r["param_sha256"] for r in rows}) == 1
    # level 1 keeps B*T*4C fewer float32s a layer (tiny: 2 layers, C 64), level 2 also 2 B*T*C
    per_layer = 4 * 32 * 64 * 4
    assert rows[0]["activations_bytes"] - rows[1]["activations_bytes"] == 2 * 4 * per_layer
    assert rows[1]["activations_bytes"] - rows[2]["activations_bytes"] == 2 * 2 * per_layer
    for r in rows:
        assert len(r["rounds_ms"]) == 2 and r["ms_per_step"] == pytest.approx(sorted(r["rounds_ms"])[0] / 2 +
                                                                               sorted(r["rounds_ms"])[1] / 2)
        assert r["time_ratio"] == pytest.approx(r["ms_per_step"] / rows[0]["ms_per_step"])
        assert r["held_ratio"] == pytest.approx(r["held_bytes"] / rows[0]["held_bytes"])
    assert "same parameters at every level" in run.stdout
    assert "| 2 |" in (tmp_path / "recompute.md").read_text()


def test_bench_recompute_fails_when_a_level_changes_the_bits(tmp_path, monkeypatch, capsys):
    from bin_scripts import load_script

    bench_recompute = load_script("bench_recompute")

    def fake_train(args, level, report):
        digest = "b" if level == 2 else "a"
        return {"step_ms": [9.0, 1.0, 1.0], "param_sha256": [digest],
                "memory": {"rank0_bytes_at_least": {"activations": 10}, "peak_rss_bytes": 100}}

    monkeypatch.setattr(bench_recompute, "train_once", fake_train)
    monkeypatch.setattr(sys, "argv", ["bench_recompute", "2", "4", "16", "--out", str(tmp_path)])
    assert bench_recompute.run_command("bench_recompute", bench_recompute.main) == 2
    assert capsys.readouterr().err == ("bench_recompute: error: --recompute 2 ended with other parameters than "
                                       "--recompute 0: recomputing must give the same bits\n")
    assert list(tmp_path.iterdir()) == []


def test_collective_bandwidths_follow_nccl_tests(results):
    out, _ = results
    rows = json.loads((out / "collectives.json").read_text())["rows"]
    assert {(r["op"], r["world"]) for r in rows} == {(op, w) for op in ("all_reduce", "reduce_scatter", "all_gather",
                                                                        "broadcast", "ring_all_reduce") for w in (2, 3)}
    factor = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
              "ring_all_reduce": lambda n: 2 * (n - 1) / n}
    assert {r["size"] for r in rows} == {4096, 65536, 16 << 20}  # K and M are 2^10 and 2^20
    assert all(r["iters"] == 3 for r in rows)  # the timed iterations only: --warmup's are not in the mean
    assert "| all_reduce | 2 | 4 KiB | 3 |" in (out / "collectives.md").read_text()
    for r in rows:
        assert r["bytes"] % (4 * r["world"]) == 0 and r["size"] - r["bytes"] < 4 * r["world"]
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / r["mean_s"] / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * factor[r["op"]](r["world"]))


def test_ddp_rows_and_exactness(results):
    out, _ = results
    data = json.loads((out / "ddp.json").read_text())
    names = [r["name"] for r in data["rows"]]
    realtime = ddp_sync.comm_priority("auto") == "realtime"  # then the smallest bucket again at normal priority
    assert names == ["per-param", "flat", "bucketed 0.1 MiB", "bucketed 1 MiB",
                     *(["bucketed 0.1 MiB, normal priority"] if realtime else []), "flat + ZeRO-1",
                     "bucketed 25 MiB + ZeRO-1", "PyTorch DDP (gloo)"]
    auto = "realtime" if realtime else "normal"
    assert [r["comm_priority"] for r in data["rows"]] == [  # of the rows with a communication thread
        None, None, auto, auto, *(["normal"] if realtime else []), None, auto, None]
    *ours, peer = data["rows"]
    # PyTorch's DDP, run by the script's own processes: the same run as our flat row to float32 rounding
    assert peer["ranks_equal"] and peer["max_loss_rel_diff_vs_flat"] < 1e-5
    assert peer["param_bytes"] == ours[0]["param_bytes"] and peer["comm_ms"] is None
    plain = [r for r in ours if not r["zero"]]
    assert all(r["same_bits_as_flat"] and r["ranks_equal"] for r in plain)
    zero = [r for r in data["rows"] if r["zero"]]
    full = plain[0]["optimizer_state_bytes"]
    assert all(r["optimizer_state_bytes"] == full // 2 for r in zero)  # the tiny model splits evenly at world 2
    assert full == 2 * plain[0]["param_bytes"]  # per rank: AdamW's m and v, float32 like the parameters
    flat = plain[1]
    for r in data["rows"]:
        assert r["vs_flat"] == pytest.approx(r["step_ms"] / flat["step_ms"])
        assert [len(run) for run in r["step_ms_runs"]] == [1]  # --steps 1 after the (default) one warm-up step
    assert data["blas_threads"] == str(max(1, (os.cpu_count() or 1) // 2))  # cores / 2 ranks


def test_the_fit_prints_b_star_from_its_own_o_and_w(results):
    out, stdout = results
    fit = json.loads((out / "overhead_model.json").read_text())
    assert fit["b_star_bytes"] == pytest.approx(math.sqrt(fit["S_bytes"] * fit["w_bytes_per_s"] * fit["o_s"]))
    assert fit["S_bytes"] == json.loads((out / "ddp.json").read_text())["rows"][1]["grad_bytes"]
    assert "predicted best bucket b* = sqrt(S·w·o)" in stdout and "measured best bucket" in stdout


MPIRUN = Path(sys.executable).parent / "mpirun"


@pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun beside this Python: pip install -e '.[mpi]'")
def test_collectives_over_mpi_processes(tmp_path):
    """Two processes under mpirun: one writes the results, every row is world 2 with nccl-tests' busbw."""
    out = subprocess.run([str(MPIRUN), "-n", "2", sys.executable, str(BIN / "bench_collectives"), "--comm", "mpi",
                          "--worlds", "2", "--sizes", "4K,64K", "--iters", "3", "--warmup", "1", "--out", tmp_path],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("wrote ") == 1
    data = json.loads((tmp_path / "collectives.json").read_text())
    assert data["comm"] == "mpi" and len(data["rows"]) == 10
    for row in data["rows"]:
        assert row["world"] == 2 and row["algbw_gbs"] > 0
        factor = {"all_reduce": 1.0, "ring_all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5,
                  "broadcast": 1.0}[row["op"]]
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * factor)


def test_results_files_say_what_ran_where(results):
    """Every results file names the command, date, commit and machine (with the load average after the
    run too); the Markdown repeats them above the table."""
    from xtrain_dist.bench.results import default_results_dir, markdown_table

    out, _ = results
    data = json.loads((out / "ddp.json").read_text())
    assert data["command"].startswith("bench_ddp --model tiny --batch 2")
    assert data["date"][:4].isdigit() and data["git_commit"]
    m = data["machine"]
    assert m["cores"] == os.cpu_count() and "loadavg_1m" in m and "loadavg_1m_after" in m
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kib = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        assert m["memory_gib"] == pytest.approx(kib / 2**20, abs=0.2)
    md = (out / "ddp.md").read_text()
    assert md.startswith("## DDP step, tiny (")
    assert f"`{data['command']}`, {data['date']}, commit {data['git_commit']}" in md
    assert f"Machine: {m['cpu']}, {m['cores']} cores, " in md
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n| --- | --- |\n| 1 | x |\n"
    assert default_results_dir("gpu").parts[-3:-1] == ("bench", "results")
    assert default_results_dir("cpu").parts[-3:-1] == ("bench", "cpu")
    with pytest.raises(ValueError, match=r"^results kind must be 'cpu' or 'gpu', not 'tpu'$"):
        default_results_dir("tpu")


def test_the_padded_pytorch_peer_trains_the_same_model():
    """bench_gpu's padded PyTorch rows (wte at Vp rows, as nanoGPT runs GPT-2) compute the unpadded model's
    function: the same losses step after step (float64, to rounding), the first V rows of wte the same, and
    the padded rows zero before and after AdamW, as they get no gradient and weight decay keeps zero at zero."""
    torch = pytest.importorskip("torch")
    from xtrain_dist.backend import numpy_ops
    from xtrain_dist.bench import torch_gpt2
    from xtrain_dist.config import TrainConfig, model_config
    from xtrain_dist.model import GPT2

    mcfg = model_config("tiny", 1000)  # pads to 1024
    state = GPT2(mcfg, numpy_ops, seed=1).state_dict()
    plain, padded = (torch_gpt2.build(mcfg, state, vocab_rows=rows).double() for rows in (None, 1024))
    assert tuple(padded.transformer["wte"].weight.shape) == (1024, mcfg.n_embd)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, dims=1)
    cfg = TrainConfig(steps=3, batch=2, seq=16, lr=1e-2, warmup_steps=1).resolved()
    optimizers = [torch_gpt2.adamw(m, cfg) for m in (plain, padded)]
    for step in range(3):
        (loss, norm), (padded_loss, padded_norm) = (torch_gpt2.train_step(m, o, ids, targets, step, cfg)
                                                    for m, o in zip((plain, padded), optimizers, strict=True))
        assert padded_loss.item() == pytest.approx(loss.item(), rel=1e-12)
        assert padded_norm.item() == pytest.approx(norm.item(), rel=1e-12)
    wte, padded_wte = plain.transformer["wte"].weight.detach(), padded.transformer["wte"].weight.detach()
    assert torch.count_nonzero(padded_wte[1000:]) == 0
    assert torch.allclose(padded_wte[:1000], wte, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match=r"^vocab_rows 999 is below the vocabulary \(1000\)$"):
        torch_gpt2.build(mcfg, state, vocab_rows=999)
