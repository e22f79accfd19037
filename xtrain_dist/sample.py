"""python -m xtrain_dist.sample: the command lives in eval/sample.py; this module keeps its entry point."""

import sys

from .eval.sample import main

if __name__ == "__main__":
    sys.exit(main())
