"""python -m xtrain_dist.prepare_hellaswag: the command itself is eval/prepare_hellaswag.py."""

import sys

from .eval.prepare_hellaswag import main

if __name__ == "__main__":
    sys.exit(main())
