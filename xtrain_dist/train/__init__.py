"""The training job: its command line (cli), the checks before ranks start (preflight), the job in this
process (job), the loop every rank runs (loop) and what it decides each step (cadence).

See docs/architecture.md for how the rooms fit together."""
