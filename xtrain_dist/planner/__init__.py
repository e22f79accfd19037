"""The planner: a run projected onto many GPUs (projection), and its command line (cli, xtrain-plan).

See docs/planning.md."""
