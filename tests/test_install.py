"""The built wheel is the whole product: installed into a new virtual environment in a temporary folder, away
from the checkout, its console scripts answer --help, it trains on the data it carries, samples from the
checkpoint it wrote, and finds the kernel sources it ships.

No network: the wheel is built with the build tools already installed here (--no-build-isolation), and the new
environment sees this one's packages (numpy, tokenizers) through a .pth file behind its own site-packages, so
the xtrain_dist it imports is the installed wheel's, not the checkout's.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from xtrain_dist.config_file import tomllib

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])
# what a build reads: the wheel is built from a copy of these, since a build in the checkout would reuse its
# build/ folder, which keeps files that a previous build saw and that are gone since
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", "xtrain_dist", "kernels", "data"]


def run(args, cwd, env, timeout=120) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out


@pytest.fixture(scope="module")
def installed(made_once, tmp_path_factory):
    """(the new environment's bin folder, a working folder outside the checkout, the environment to run in). The
    wheel is built and installed once for the run (conftest's made_once); each process works in a folder of its own."""
    bin_dir, env = made_once("install", _install)
    return bin_dir, tmp_path_factory.mktemp("work"), env


def _install(root):
    source = root / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env["XTRAIN_CACHE"] = str(root / "cache")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", root / "wheels", source], cwd=root, env=env)
    (wheel,) = (root / "wheels").glob("xtrain_dist-*.whl")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root, env=env)
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root, env)
                .stdout.strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        cwd=root, env=env)
    return venv / "bin", env


@pytest.mark.long
def test_the_wheel_holds_the_kernels_and_the_data(installed):
    bin_dir, work, env = installed
    where = json.loads(run([bin_dir / "python", "-c", "import json, xtrain_dist, xtrain_dist.shipped as s; "
                            "print(json.dumps([xtrain_dist.__file__, str(s.KERNEL_DIR), str(s.DATA_DIR)]))"],
                           work, env).stdout)
    package = Path(where[0]).parent
    assert package.is_relative_to(bin_dir.parent) and not package.is_relative_to(REPO)
    assert (Path(where[1]), Path(where[2])) == (package / "kernels", package / "shipped_data")
    for name, shipped in (("kernels", Path(where[1])), ("data", Path(where[2]))):
        # every file, kernels/tuned/ (the tuning tables and the variants' register record) too
        files = sorted(p.relative_to(REPO / name) for p in (REPO / name).rglob("*") if p.is_file())
        assert sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file()) == files, name
        for path in files:
            assert (shipped / path).read_bytes() == (REPO / name / path).read_bytes(), path


@pytest.mark.long
def test_every_console_script_answers_help(installed):
    bin_dir, work, env = installed
    assert SCRIPTS == ["xtrain-eval", "xtrain-hellaswag", "xtrain-plan", "xtrain-plot", "xtrain-prepare-hellaswag",
                       "xtrain-sample", "xtrain-tokenize", "xtrain-train"]
    for script in SCRIPTS:
        out = run([bin_dir / script, "--help"], work, env)
        assert out.stdout.startswith(f"usage: {script} "), (script, out.stdout)
    # and a bad argument's line names the command as it was started, not the module behind it
    bad = subprocess.run([bin_dir / "xtrain-train", "0", "2", "16"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=120)
    assert (bad.returncode, bad.stderr) == (2, "xtrain-train: error: STEPS must be a positive integer, got '0'\n")


@pytest.mark.long
def test_the_installed_trainer_trains_samples_and_compiles_as_the_checkout_does(installed, tmp_path):
    bin_dir, work, env = installed
    args = [3, 2, 16, "--eval-batches", 1]
    run([bin_dir / "xtrain-train", *args, "--save-dir", "ckpt", "--report", "installed.json"], work, env)
    run([sys.executable, "-m", "xtrain_dist.train_ddp", *args, "--report", tmp_path / "checkout.json"], REPO,
        {**env, "PYTHONPATH": str(REPO)})
    installed_run = json.loads((work / "installed.json").read_text())
    checkout_run = json.loads((tmp_path / "checkout.json").read_text())
    assert installed_run["param_sha256"] == checkout_run["param_sha256"]  # the same data, tokenizer and code
    assert Path(installed_run["config"]["corpus"]).is_relative_to(bin_dir.parent)
    text = run([bin_dir / "xtrain-sample", "ckpt", "--tokens", 8], work, env).stdout
    assert text.strip()
    # the kernel sources as the installed package hands them to NVRTC: every file, includes pasted in
    sources = json.loads(run([bin_dir / "python", "-c", "import json; from xtrain_dist.backend.cuda import compile "
                              "as c; print(json.dumps({f: c.kernel_source(f) for f in c.KERNELS}))"], work, env).stdout)
    assert sorted(sources) == sorted(p.stem for p in (REPO / "kernels").glob("*.cu"))
    assert "__global__" in sources["scale"] and "#line 1 \"common.cuh\"" in sources["scale"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        (tmp_path / "scale.cu").write_text(sources["scale"])
        run([nvcc, "-std=c++17", "--ptx", "-arch=sm_90", "-o", tmp_path / "scale.ptx", tmp_path / "scale.cu"],
            tmp_path, env)
        assert ".entry" in (tmp_path / "scale.ptx").read_text()
