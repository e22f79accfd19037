"""python -m xtrain_dist.plot_metrics: the command itself is train/plot_metrics.py."""

import sys

from .train.plot_metrics import main

if __name__ == "__main__":
    sys.exit(main())
