"""python -m xtrain_dist.plan: the command itself is planner/cli.py."""

import sys

from .planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
