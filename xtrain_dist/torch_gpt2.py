"""The same GPT-2 in PyTorch: the peer that the benchmarks race and a second implementation to check against.

Same parameter names, shapes (Conv1D (in, out) weights), tied embedding and initial values as
model.GPT2 (load its state_dict). torch is imported here only: it is a benchmark and test extra,
never a dependency of the trainer.
"""

import math

from .config import GPTConfig


def build(config: GPTConfig, state_dict: dict | None = None, device: str = "cpu", sdpa: bool = True):
    """A torch.nn.Module computing GPT-2's mean cross-entropy: module(ids, targets) -> loss.

    sdpa=True uses torch's fused scaled_dot_product_attention (what a PyTorch user would run);
    False writes attention out like our backends do (scores, causal softmax, weighted sum)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    C, NH = config.n_embd, config.n_head

    def conv1d(n_in, n_out):
        return nn.ParameterDict({"weight": nn.Parameter(torch.zeros(n_in, n_out)),
                                 "bias": nn.Parameter(torch.zeros(n_out))})

    def linear(x, p):
        return torch.addmm(p["bias"], x.reshape(-1, x.shape[-1]), p["weight"]).reshape(*x.shape[:-1], -1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C, eps=1e-5), nn.LayerNorm(C, eps=1e-5)
            self.attn = nn.ModuleDict({"c_attn": conv1d(C, 3 * C), "c_proj": conv1d(C, C)})
            self.mlp = nn.ModuleDict({"c_fc": conv1d(C, 4 * C), "c_proj": conv1d(4 * C, C)})

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = linear(self.ln_1(x), self.attn["c_attn"]).split(C, dim=-1)
            q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
            if sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // NH)
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
                y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            x = x + linear(y.transpose(1, 2).reshape(B, T, C), self.attn["c_proj"])
            h = F.gelu(linear(self.ln_2(x), self.mlp["c_fc"]), approximate="tanh")
            return x + linear(h, self.mlp["c_proj"])

    class GPT2Torch(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict({
                "wte": nn.Embedding(config.vocab_size, C), "wpe": nn.Embedding(config.n_ctx, C),
                "h": nn.ModuleList(Block() for _ in range(config.n_layer)), "ln_f": nn.LayerNorm(C, eps=1e-5)})

        def forward(self, ids, targets):
            t = self.transformer
            x = t["wte"](ids) + t["wpe"].weight[: ids.shape[1]]
            for block in t["h"]:
                x = block(x)
            logits = t["ln_f"](x) @ t["wte"].weight.T  # tied output projection
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    module = GPT2Torch()
    if state_dict is not None:
        # ParameterDict entries are named "...c_attn.weight" like Hugging Face's, so names match as they are
        module.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
    return module.to(device)
