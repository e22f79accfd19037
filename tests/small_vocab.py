"""The shipped corpus through a 512-id tokenizer, for the training tests that run on the CUDA simulator.

Those tests compare runs with each other (the CUDA backend against numpy's, two virtual ranks against one, a
resumed run against an uninterrupted one): no figure of theirs depends on the vocabulary. On the simulator the
classifier is most of a tiny model's step (its logits, softmax and wte's gradient, norm and AdamW grow with the
vocabulary: wte is 71% of the tiny model's parameters at 4096 ids), so the same tests at 512 ids take about a
third less time (their simulator runs in tests/test_cudasim.py: about 217 CPU-seconds at 4096 ids, 152 at 512).
Every kernel still runs, the classifier included: the op tests hold each kernel to numpy at the shipped 4096 ids
and at vocabularies that are not multiples of a block.

`tokenizer_512.json` is `bin/train_tokenizer data/shakespeare.txt tests/tokenizer_512.json --vocab-size 512`
(sha256 30f86edab38a208cbf697fb38fc83e6ffee082206cc9df53ca31239b96a081df; the shipped corpus is 2,545,230 of its
tokens). Its ids are cached on disk as the shipped tokenizer's are (data/corpus.py)."""

from pathlib import Path

TOKENIZER_512 = Path(__file__).resolve().with_name("tokenizer_512.json")


def corpus():
    from xtrain_dist.data.corpus import DEFAULT_CORPUS, Corpus

    return Corpus.load(TOKENIZER_512, DEFAULT_CORPUS)
