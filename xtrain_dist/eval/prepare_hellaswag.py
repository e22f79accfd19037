"""Write HellaSwag (hellaswag_val.jsonl) as an llm.c eval file, encoded with a run's own tokenizer.

    xtrain-prepare-hellaswag TOKENIZER hellaswag_val.jsonl OUT.bin [--limit N]
    xtrain-train ... TOKENIZER CORPUS --hellaswag OUT.bin
    xtrain-hellaswag CHECKPOINT OUT.bin

Each line of the JSONL (github.com/rowanz/hellaswag, data/hellaswag_val.jsonl) is an example with a
"ctx", four "endings" and the "label" of the right one. The context is encoded as it is and each
ending with a space before it, as llm.c's dev/data/hellaswag.py does with GPT-2's tokenizer: with
GPT-2's tokenizer.json this writes the ids of llm.c's hellaswag_val.bin. The format is llm.c's
eval file (see xtrain_dist/eval/hellaswag.py), so llm.c reads it too.
"""

import json
import sys
from pathlib import Path

import numpy as np

from xtrain_dist import files
from xtrain_dist.command import OneLineParser, command_name, positive_int, run_command
from xtrain_dist.data.corpus import encode_checked, read_tokenizer
from xtrain_dist.errors import XtrainError
from xtrain_dist.eval.hellaswag import START_EXAMPLE, Example, eval_file_chunks, row_width


def example_of(record, index: int, number: int, tokenizer, tokenizer_path: Path, where: str) -> Example:
    """Example `index` of the file, from the JSONL record on line `number`, or one XtrainError saying what
    the record lacks."""
    bad = f"{where}, line {number}"
    if not isinstance(record, dict):
        raise XtrainError(f"{bad}: not a JSON object")
    ctx, endings, label = record.get("ctx"), record.get("endings"), record.get("label")
    if not isinstance(ctx, str) or not ctx:
        raise XtrainError(f"{bad}: no \"ctx\" text")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) and e for e in endings):
        raise XtrainError(f"{bad}: \"endings\" is not a list of at least two texts")
    if isinstance(label, str) and label.isdigit():  # the JSONL of some HellaSwag copies holds "3"
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise XtrainError(f"{bad}: \"label\" {label!r} is not the index of one of its {len(endings)} endings")

    def ids(text: str) -> np.ndarray:
        return encode_checked(tokenizer, text, tokenizer_path, bad).astype(np.int32)

    return Example(index, label, ids(ctx), tuple(ids(" " + end) for end in endings))


def run(args) -> None:
    files.refuse_output_on_inputs(args.out, "output", [("the tokenizer", args.tokenizer), ("the JSONL", args.jsonl)],
                                  "it would be replaced by the eval file")
    tokenizer = read_tokenizer(args.tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size > START_EXAMPLE:
        raise XtrainError(f"tokenizer '{args.tokenizer}' has {vocab_size} ids; an llm.c eval file holds ids "
                          f"below {START_EXAMPLE} only")
    files.check_writable(args.out, "output")
    examples = []
    try:
        with files.reading("JSONL", args.jsonl), open(args.jsonl, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if args.limit and len(examples) == args.limit:
                    break
                if not line.strip():
                    continue
                try:
                    record = files.loads_json(line)
                except json.JSONDecodeError as err:
                    raise XtrainError(f"JSONL '{args.jsonl}', line {number}: not JSON ({err.msg})") from None
                examples.append(example_of(record, len(examples), number, tokenizer, args.tokenizer,
                                           f"JSONL '{args.jsonl}'"))
    except UnicodeDecodeError as err:
        raise XtrainError(f"JSONL '{args.jsonl}' is not UTF-8 text ({err.reason})") from None
    if not examples:
        raise XtrainError(f"JSONL '{args.jsonl}' holds no examples")
    chunks = eval_file_chunks(examples)
    files.write_atomic(args.out, chunks, "output")
    print(f"wrote {args.out}: {len(examples)} examples of {len(examples[0].completions)} completions, "
          f"{sum(len(c) for c in chunks)} bytes; the longest needs {row_width(examples)} positions")


PROG = "prepare_hellaswag"


def prepare(argv: list[str]) -> None:
    parser = OneLineParser(prog=command_name(PROG), description=__doc__)
    parser.add_argument("tokenizer", type=Path, help="tokenizers JSON file (tokenizer.json)")
    parser.add_argument("jsonl", type=Path, help="HellaSwag's JSONL (one example a line)")
    parser.add_argument("out", type=Path, help="the llm.c eval file to write")
    parser.add_argument("--limit", type=positive_int, default=None, help="take the first N examples only")
    run(parser.parse_args(argv))


def main(argv=None) -> int:
    return run_command(PROG, lambda: prepare(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
