"""The Hugging Face layout of a checkpoint, out and in.

Out: the config.json and tokenizer_config.json a save writes beside the model, so that
GPT2LMHeadModel.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR) load the folder as it is.
In: the GPT-2 folder a run starts from (--init-from) or `sample`, `evaluate` and `hellaswag` read: one of
our checkpoints, or any folder with a Hugging Face GPT-2's config.json and model.safetensors
(save_pretrained's, the Hub's "gpt2"), its config checked to be a GPT-2 this trainer implements and its
weights taken under our names. Both ways wte has the tokenizer's V rows: the model pads them to its layout's
padded_vocab_size on load (GPT2.load_state_dict) and leaves the padding out on save (GPT2.state_dict).
"""

import re
from pathlib import Path

import numpy as np
import tokenizers

from ..config import GPTConfig
from ..errors import XtrainError
from ..files import read_regular
from .store import CONFIG, MODEL, Checkpoint, Shared, is_checkpoint, open_checkpoint

EOS = "<|endoftext|>"
# each block's causal-mask buffers in Hugging Face's GPT-2 (older files save them): not parameters
GPT2_MASK_BUFFER = re.compile(r"transformer\.h\.\d+\.attn\.(masked_)?bias")


def hf_config(config: GPTConfig, tokenizer: tokenizers.Tokenizer | None = None) -> dict:
    """config.json as transformers' GPT2Config reads it (without a tokenizer, no bos/eos ids).

    Dropout is 0: this trainer uses none, and the config describes the model as trained, so
    GPT2LMHeadModel in train() mode computes the same function as ours (GPT-2's own 0.1 is one
    assignment away for whoever fine-tunes with dropout)."""
    eos = tokenizer.token_to_id(EOS) if tokenizer is not None else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_ctx,
        "n_ctx": config.n_ctx,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def tokenizer_config(config: GPTConfig, tokenizer: tokenizers.Tokenizer) -> dict:
    special = {"bos_token": EOS, "eos_token": EOS} if tokenizer.token_to_id(EOS) is not None else {}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.n_ctx,
            "clean_up_tokenization_spaces": False, **special}


def open_pretrained(path, read=(MODEL, CONFIG), what: str = "--init-from") -> Checkpoint:
    """The files `read` of a GPT-2 folder that a run starts from (--init-from) or `sample` draws from:
    one of our checkpoints (verified against its manifest), or any folder with a Hugging Face GPT-2's
    config.json and model.safetensors (and tokenizer.json where it is read), such as save_pretrained
    writes and the Hub's "gpt2" holds. `what` names the folder in errors."""
    path = Path(path)
    if is_checkpoint(path):  # ours, also one cut short by a save: open_checkpoint reads both
        return open_checkpoint(path, read=read)
    if not path.is_dir():
        raise XtrainError(f"{what} '{path}' " + ("not found" if not path.exists() else "is not a folder"))
    contents = {}
    for name in read:
        try:
            contents[name] = read_regular(path / name)
        except FileNotFoundError:
            needed = f"{', '.join(read[:-1])} and {read[-1]}"
            raise XtrainError(f"{what} '{path}' has no {name}: give a folder with a Hugging Face GPT-2's "
                              f"{needed} (or one of our checkpoints)") from None
        except OSError as err:
            raise XtrainError(f"{what} '{path}': cannot read {name} ({err.strerror})") from None
    return Checkpoint(path, path, {}, contents)


def gpt_config(ckpt: Checkpoint) -> GPTConfig:
    """The model's shape from config.json, refusing a GPT-2 variant this trainer does not implement."""
    c = ckpt.json(CONFIG)
    expected = {"model_type": "gpt2", "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "tie_word_embeddings": True, "n_inner": None, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False}
    for key, value in expected.items():
        if c.get(key, value) != value:
            raise XtrainError(f"checkpoint '{ckpt.path}': {CONFIG} has {key}={c[key]!r}; this trainer "
                              f"implements GPT-2 with {key}={value!r}")
    for key in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd"):
        # an integer as JSON writes it: 12.7 or "12" is no shape, and int() would quietly take it
        if key not in c:
            raise ckpt.corrupt(f"{CONFIG} has no {key}")
        if not isinstance(c[key], int) or isinstance(c[key], bool) or c[key] < 1:
            raise ckpt.corrupt(f"{CONFIG}: {key} is {c[key]!r}, expected an integer >= 1")
    if c.get("n_ctx", c["n_positions"]) != c["n_positions"]:
        raise ckpt.corrupt(f"{CONFIG} has n_ctx {c['n_ctx']!r} != n_positions {c['n_positions']}")
    try:
        return GPTConfig(vocab_size=c["vocab_size"], n_ctx=c["n_positions"], n_layer=c["n_layer"],
                         n_head=c["n_head"], n_embd=c["n_embd"])
    except XtrainError as err:  # a shape this trainer cannot build (n_embd not a multiple of n_head)
        raise XtrainError(f"checkpoint '{ckpt.path}': {CONFIG}: {err}") from None


def pretrained_state(ckpt: Checkpoint, config: GPTConfig) -> dict[str, np.ndarray]:
    """model.safetensors of any GPT-2 folder as Checkpoint.model_state's name -> float32 array.

    Beside our names (GPT2LMHeadModel's, which save_pretrained writes) it reads the Hub's own GPT-2
    files: GPT2Model's names without "transformer.", with each block's causal-mask buffers
    (h.N.attn.bias, h.N.attn.masked_bias), which are not parameters and are dropped. A lm_head.weight
    must be wte's (GPT-2 ties them, and so does this trainer); float16 widens to float32 exactly."""
    tensors = {}
    for name, array in ckpt.tensors(MODEL)[0].items():
        if name != "lm_head.weight" and not name.startswith("transformer."):
            name = f"transformer.{name}"
        if GPT2_MASK_BUFFER.fullmatch(name):
            continue
        tensors[name] = array.astype(np.float32) if array.dtype == np.float16 else array
    head = tensors.pop("lm_head.weight", None)
    if head is not None and not np.array_equal(head, tensors.get("transformer.wte.weight")):
        raise XtrainError(f"'{ckpt.path}': its lm_head.weight is not its transformer.wte.weight; this trainer's "
                          "GPT-2 ties the output projection to the token embedding")
    return ckpt.checked_model(tensors, config)


def load_pretrained(source, model) -> None:
    """Start `model` from pretrained weights: a Shared of them, or a folder (open_pretrained)."""
    if not isinstance(source, Shared):
        source = Shared(1, pretrained_state(open_pretrained(source), model.config), path=source)
    with source.use() as tensors:
        model.load_state_dict(tensors)
