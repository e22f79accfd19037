"""python -m xtrain_dist.evaluate: the command lives in eval/evaluate.py; this module keeps its entry point."""

import sys

from .eval.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
