"""python -m xtrain_dist.tokenize_corpus: the command itself is data/tokenize_corpus.py."""

import sys

from .data.tokenize_corpus import main

if __name__ == "__main__":
    sys.exit(main())
