"""python -m xtrain_dist.sample DIR [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S]

Prints the prompt followed by N tokens drawn from the model in checkpoint DIR, encoded and decoded
with the checkpoint's own tokenizer.json: DIR is all it needs. DIR may also be a Hugging Face GPT-2
folder with those three files, such as the Hub's gpt2. The same checkpoint, arguments and
backend give the same text (the draws come from PCG64(seed)).

The context runs through the model once; after that each new token runs alone, its attention reading
the keys and values cached for the positions before it (model.KVCache), so a token costs about one
position's forward pass rather than the whole context's. Past the model's n_ctx positions the window
slides and every token re-runs the last n_ctx (`--no-cache` does that from the start).
"""

import sys
from pathlib import Path

import numpy as np

from ..backend import BACKENDS, get_backend
from ..checkpoint.hf import EOS, gpt_config, open_pretrained, pretrained_state
from ..checkpoint.store import CONFIG, MODEL, STATE, TOKENIZER, is_checkpoint
from ..command import (
    OneLineParser,
    command_name,
    non_negative_float,
    non_negative_int,
    positive_int,
    run_command,
    utf8_text,
)
from ..data.corpus import encode_checked
from ..errors import XtrainError
from ..model import GPT2, KVCache

PROG = "sample"


def load(path, backend):
    """(model, tokenizer, checkpoint) of the checkpoint folder at `path`: one of ours (its trainer state
    read too, in the one verifying pass, for what the run measured), or a Hugging Face GPT-2 folder with
    config.json, model.safetensors and tokenizer.json (the Hub's gpt2 has them)."""
    wanted = (MODEL, CONFIG, TOKENIZER) + ((STATE,) if is_checkpoint(path) else ())  # only ours: our trainer state
    ckpt = open_pretrained(path, read=wanted, what="checkpoint")
    try:
        config = gpt_config(ckpt)
    except XtrainError as err:
        # GPTConfig's own checks (n_embd divisible by n_head, ...) do not know which file they read
        if str(err).startswith(f"checkpoint '{ckpt.path}'"):
            raise
        raise XtrainError(f"checkpoint '{ckpt.path}': {CONFIG}: {err}") from None
    model = GPT2(config, backend)
    model.load_state_dict(pretrained_state(ckpt, config))
    tokenizer = ckpt.tokenizer()
    if tokenizer.get_vocab_size(with_added_tokens=True) > config.vocab_size:
        raise XtrainError(f"checkpoint '{path}': its tokenizer has more ids than the model's vocabulary "
                          f"({config.vocab_size})")
    return model, tokenizer, ckpt


def load_for_command(prog: str, path, backend: str):
    """load() for a command line: (model, tokenizer, checkpoint) of the checkpoint at `path` on `backend`
    (its device 0), with the checkpoint's note, if it has one, on stderr."""
    model, tokenizer, ckpt = load(path, get_backend(backend, 0))
    if ckpt.note:
        print(f"{prog}: {ckpt.note}", file=sys.stderr)
    return model, tokenizer, ckpt


def generate(model, ids: list[int], n_tokens: int, temperature: float, top_k: int | None,
             rng: np.random.Generator, cache: bool = True) -> list[int]:
    """`n_tokens` ids drawn one at a time after `ids`: greedy at temperature 0, else from
    softmax(logits / temperature) restricted to the top_k most likely ids.

    With `cache`, the context runs once and then each new id runs alone, attending over a KVCache of
    the positions before it, until the model's n_ctx positions are all cached; without it (and past
    that point) each draw runs the forward pass over the last n_ctx ids. The logits are the same to
    float32 rounding."""
    ops, n_ctx = model.ops, model.config.n_ctx
    # with pipeline parallelism every stage of the group runs this together, each draw from the last stage's logits
    forward = model.forward if getattr(model, "pp", None) is None else model.pipelined_logits
    ids = list(ids)
    new = []
    kv = KVCache(model, batch=1) if cache else None
    pending = ids[-n_ctx:]  # what the next forward pass adds to the cache: first the whole context
    for _ in range(n_tokens):
        if kv is not None and kv.length + len(pending) <= n_ctx:
            out = forward(ops.from_host(np.asarray(pending, dtype=np.int32)[None, :]), cache=kv)
        else:  # n_ctx ids seen: the window slides, and the positions of every cached key would shift
            kv = None
            out = forward(ops.from_host(np.asarray(ids[-n_ctx:], dtype=np.int32)[None, :]))
        logits = ops.to_host(out[0, -1]).astype(np.float64)
        if temperature == 0:
            token = int(np.argmax(logits))
        else:
            # shift before scaling: the likeliest id then stays at 0 for any temperature, where
            # logits / T first would overflow to inf (and inf - inf is NaN) for a tiny T
            logits -= logits.max()
            if top_k is not None and top_k < logits.size:
                logits[logits < np.partition(logits, -top_k)[-top_k]] = -np.inf
            # the others go to -inf as T -> 0, which is the limit wanted (probability 0: greedy), so
            # that overflow is not an error
            with np.errstate(over="ignore"):
                logits /= temperature
            probs = np.exp(logits)
            cumulative = np.cumsum(probs)
            token = int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"),
                            logits.size - 1))
        ids.append(token)
        new.append(token)
        pending = [token]
    return new


def prompt_ids(tokenizer, prompt: str, tokenizer_path, flag: str = "--prompt") -> list[int]:
    """The ids a draw continues: the prompt's, or <|endoftext|> alone (where GPT-2's documents start) for
    none. One XtrainError where the tokenizer cannot encode the prompt or has no <|endoftext|>."""
    if prompt:
        ids = encode_checked(tokenizer, prompt, tokenizer_path, f"the {flag}").tolist()
        if not ids:
            raise XtrainError(f"the {flag} {prompt!r} encodes to no ids: nothing to continue")
        return ids
    if tokenizer.token_to_id(EOS) is None:
        raise XtrainError(f"give a {flag}: the tokenizer has no {EOS} to start from")
    return [tokenizer.token_to_id(EOS)]


def continuation(model, tokenizer, ids: list[int], n_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 1337, show_prompt: bool = True, cache: bool = True) -> str:
    """The text of `n_tokens` drawn after `ids` (generate, from PCG64(seed)), after the prompt's own text
    where show_prompt: the same model, ids and seed give the same text."""
    new = generate(model, ids, n_tokens, temperature, top_k, np.random.Generator(np.random.PCG64(seed)), cache=cache)
    return tokenizer.decode((ids if show_prompt else []) + new, skip_special_tokens=False)


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=command_name(f"python -m xtrain_dist.{PROG}"),
                      description="Print text sampled from a checkpoint.")
    p.add_argument("checkpoint", metavar="DIR", help="a checkpoint folder (xtrain-train --save-dir)")
    p.add_argument("--prompt", default="", type=utf8_text, help="text to continue (default: start from <|endoftext|>)")
    p.add_argument("--tokens", type=positive_int, default=100, help="tokens to draw (default 100)")
    p.add_argument("--temperature", type=non_negative_float, default=1.0, help="0: always the likeliest token")
    p.add_argument("--top-k", type=positive_int, default=None, help="draw among the K likeliest tokens only")
    p.add_argument("--seed", type=non_negative_int, default=1337, help="the draws' random stream")
    p.add_argument("--backend", choices=BACKENDS, default="numpy", help="where the model runs: numpy (CPU) or cuda")
    p.add_argument("--no-cache", action="store_true",
                   help="re-run the forward pass over the whole context for every token instead of caching keys "
                        "and values (slower; the same logits to float32 rounding)")
    return p


def sample_text(argv) -> str:
    args = build_parser().parse_args(argv)
    model, tokenizer, _ = load_for_command(PROG, args.checkpoint, args.backend)
    ids = prompt_ids(tokenizer, args.prompt, Path(args.checkpoint) / TOKENIZER)
    return continuation(model, tokenizer, ids, args.tokens, args.temperature, args.top_k, args.seed,
                        show_prompt=bool(args.prompt), cache=not args.no_cache)


def main(argv=None) -> int:
    return run_command(PROG, lambda: print(sample_text(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
