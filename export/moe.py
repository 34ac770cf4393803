"""Sparse mixture-of-experts MLP (mixtral, qwen3_moe) as an exact, export-friendly torch block.

Routing follows transformers: softmax over the router logits, the top-k experts' probabilities,
renormalized to sum to 1 when ``norm_topk_prob`` (mixtral always). Every expert runs on every
token and the outputs are combined with the routing weights, zero for experts not chosen: the
same sum the reference computes, with static shapes that every ONNX runtime takes (a gather of
the chosen experts' weights is the fused graph's business, llmx/fused/moe.py).

Weights, stacked over experts in the [in, out] layout of llmx's Linear:
    router [H,E]   gate_up [E,H,2I] (gate | up)   down [E,I,H]
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from llmx.spec import ModelSpec


class SparseMoE(nn.Module):
    def __init__(self, spec: ModelSpec, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        experts, hidden, inner = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.top_k, self.renormalize, self.act = spec.experts_per_token, spec.norm_topk_prob, act
        self.router = nn.Parameter(torch.empty(hidden, experts))
        self.gate_up = nn.Parameter(torch.empty(experts, hidden, 2 * inner))
        self.down = nn.Parameter(torch.empty(experts, inner, hidden))

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N,H] -> [N,E], the top-k experts' weights and zeros elsewhere.
        probs = torch.softmax(torch.matmul(x, self.router), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, index, top)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N,H]
        weights = self.routing_weights(x)  # [N,E]
        gate, up = torch.matmul(x.unsqueeze(0), self.gate_up).chunk(2, dim=-1)  # [E,N,I] each
        out = torch.matmul(self.act(gate) * up, self.down)  # [E,N,H]
        out = (out * weights.t().unsqueeze(-1)).sum(dim=0)
        return out.reshape(shape)
