"""python -m xtrain_dist.hellaswag: the command lives in eval/hellaswag.py; this module keeps its entry point."""

import sys

from .eval.hellaswag import main

if __name__ == "__main__":
    sys.exit(main())
