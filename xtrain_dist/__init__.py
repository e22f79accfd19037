"""xtrain-dist: data-parallel GPT-2 training you can read end to end."""

__version__ = "0.1.0"
