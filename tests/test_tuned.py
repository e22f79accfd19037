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


def test_a_products_key_names_everything_the_heuristic_is_asked_but_the_alignment():
    """cublaslt.product_key: GPT-2's c_attn forward at 8192 rows in bf16 through the bias epilogue, c_fc's
    GELU, and a plain float32 weight gradient with TF32, as the products section keys them."""
    from xtrain_dist.backend.cuda import cublaslt

    assert cublaslt.product_key(0, 0, 2304, 8192, 768, 14, 2304, 768, 14, 2304, 14, 68,
                                cublaslt.CUBLASLT_EPILOGUE_BIAS, 0) == \
        "NN 2304x8192x768 bf16>bf16 ld 2304,768,2304 compute 32F BIAS bf16"
    assert cublaslt.product_key(0, 0, 3072, 8192, 768, 14, 3072, 768, 14, 3072, 14, 68,
                                cublaslt.CUBLASLT_EPILOGUE_GELU_AUX_BIAS, 3072) == \
        "NN 3072x8192x768 bf16>bf16 ld 3072,768,3072 compute 32F GELU_AUX_BIAS bf16 aux ld 3072"
    assert cublaslt.product_key(0, 1, 768, 768, 8192, 0, 768, 768, 0, 768, -1, 77,
                                cublaslt.CUBLASLT_EPILOGUE_DEFAULT, 0) == \
        "NT 768x768x8192 f32>f32 ld 768,768,768 compute 32F_FAST_TF32 DEFAULT"


def test_product_entries_are_read_as_their_algorithms_words_or_stop_with_one_line(tmp_path):
    """gemm.product_choices: no table is no choices; an entry is its 8 words; an entry without them is one
    line naming the table and the product."""
    from xtrain_dist.backend.cuda import cublaslt, gemm

    assert gemm.product_choices("NVIDIA H200", tmp_path) == {}
    words = [hex(w) for w in (0x5EED, 1, 2, 3, 4, 5, 6, 2**64 - 1)]
    path = tuned.write_section("NVIDIA H200", "products", {"NN 8x8x8": {"algo": words, "rank": 6}}, {}, tmp_path)
    assert gemm.product_choices("NVIDIA H200", tmp_path) == {"NN 8x8x8": (0x5EED, 1, 2, 3, 4, 5, 6, 2**64 - 1)}
    algo = cublaslt.MatmulAlgo()
    algo.data[:] = [0x5EED, 1, 2, 3, 4, 5, 6, 2**64 - 1]
    assert cublaslt.algo_words(algo) == words  # what the search writes is what the backend reads
    for entry, got in (({"rank": 2}, "None"), ({"algo": words[:7]}, repr(words[:7])),
                       ({"algo": ["0x1"] * 7 + ["zz"]}, repr(["0x1"] * 7 + ["zz"])), ("fast", "None")):
        tuned.write_section("NVIDIA H200", "products", {"NN 8x8x8": entry}, {}, tmp_path)
        with pytest.raises(XtrainError) as error:
            gemm.product_choices("NVIDIA H200", tmp_path)
        assert str(error.value) == (f"tuning table '{path}': product 'NN 8x8x8' has no algorithm of 8 hexadecimal "
                                    f"words (got {got})")
