"""Checkpoint folders: written whole or not at all (store), the Hugging Face layout (hf), and what a
resume checks and restores (resume)."""
