"""python -m xtrain_dist.train_ddp STEPS BATCH SEQ [TOKENIZER CORPUS] [options]: the training command.

The command lives in train/cli.py; this module keeps the design's entry point."""

import sys

from .train.cli import main

if __name__ == "__main__":
    sys.exit(main())
