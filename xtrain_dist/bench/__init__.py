"""What the benchmarks in bin/ share (results, extras) and the PyTorch peer they race (torch_gpt2)."""
