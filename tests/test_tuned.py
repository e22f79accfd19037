"""The per-GPU tuning tables (xtrain_dist/backend/cuda/tuned.py): absent means defaults, present is read
whole, damaged is one line, and writing one section keeps the others."""

import pytest

from xtrain_dist.backend.cuda import tuned
from xtrain_dist.errors import XtrainError


def test_a_gpu_name_becomes_its_file_name():
    assert tuned.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert tuned.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    with pytest.raises(XtrainError, match="gives no tuning-table name"):
        tuned.gpu_slug(" -- ")


def test_no_table_means_no_choices(tmp_path):
    assert tuned.load_table("NVIDIA H200", tmp_path) == {}
    assert tuned.load_section("NVIDIA H200", "products", tmp_path) == {}


def test_writing_a_section_keeps_the_other_sections(tmp_path):
    tuned.write_section("NVIDIA H200", "products", {"768x768": 3}, {"command": "bench_gemm"}, tmp_path)
    tuned.write_section("NVIDIA H200", "attention", {"1024": "q64"}, {"command": "bench_attention"}, tmp_path)
    assert tuned.load_section("NVIDIA H200", "products", tmp_path) == {"768x768": 3}
    assert tuned.load_table("NVIDIA H200", tmp_path)["measured"] == {
        "products": {"command": "bench_gemm"}, "attention": {"command": "bench_attention"}}


@pytest.mark.parametrize(("text", "line"), [
    ("{not json", r"tuning table '.*nvidia-h200.json' cannot be read \(Expecting property name"),
    ("[1, 2]", r"tuning table '.*nvidia-h200.json' is not a JSON object"),
    ('{"products": [1]}', r"tuning table '.*nvidia-h200.json': section 'products' is not an object"),
])
def test_a_damaged_table_is_one_line_not_a_silent_default(tmp_path, text, line):
    (tmp_path / "nvidia-h200.json").write_text(text)
    with pytest.raises(XtrainError, match=line):
        tuned.load_section("NVIDIA H200", "products", tmp_path)
