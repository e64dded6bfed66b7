"""`sdpa_gqa`: PyTorch SDPA with grouped key/value heads passed as they are, on CPU.

transformers' "sdpa" repeats every key/value head `num_key_value_groups` times (a full copy of
the KV cache, every layer, every step) whenever an attention mask is given, because CUDA's
fast kernels cannot take a mask together with `enable_gqa`. The CPU kernel can, so on CPU the
copy is skipped and a decode step's attention gets much faster (docs/benchmarks.md, "Decoding").
Off the CPU this defers to "sdpa" unchanged. Same kernel, same mask, same result (the tests
compare logits with "sdpa").

One exception, a decode step (one query token) in bf16/fp16 on CPU: there the SDPA kernel is
slower than in float32, so `grouped_decode_attention` computes it as two matmuls per KV head
group with a float32 softmax, faster than either (docs/benchmarks.md, "Decoding"). Its outputs
differ from the bf16 kernel's by bf16 rounding: its scores come out of a bf16 matmul (as in eager
attention; the kernel keeps them in float32), and the probabilities are rounded to bf16 for the
value matmul, as flash kernels do.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_SDPA = "sdpa_gqa"


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function registered as `sdpa_gqa` (transformers' attention-function signature)."""
    on_cpu = query.device.type == "cpu" and kwargs.get("position_bias") is None
    if on_cpu and query.shape[2] == 1 and query.dtype in (torch.bfloat16, torch.float16) and not dropout:
        return grouped_decode_attention(query, key, value, attention_mask, scaling), None
    if not on_cpu or getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """Attention of Q query tokens [B, H, Q, D] over grouped KV heads [B, KV, T, D] without copying
    them: the H / KV query heads of a group share one matmul (its scores then scaled, masked and
    softmaxed in float32).
    `attention_mask`: sdpa's (bool, True = attend, or additive float), [B or 1, 1, Q, T], or None
    (attend to everything: a single query token is the last one). Returns [B, Q, H, D]."""
    rows, heads, queries, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    scores = torch.matmul(query.reshape(rows, kv_heads, groups * queries, dim), key.transpose(-1, -2))
    scores = scores.float().mul_(scale).view(rows, kv_heads, groups, queries, columns)
    if attention_mask is not None:
        mask = attention_mask[:, :, None]  # broadcast over the groups
        if mask.dtype == torch.bool:
            scores = scores.masked_fill_(~mask, torch.finfo(torch.float32).min)
        else:
            scores = scores.add_(mask.float())
    probs = scores.softmax(-1).to(value.dtype).view(rows, kv_heads, groups * queries, columns)
    output = torch.matmul(probs, value).view(rows, heads, queries, dim)
    return output.transpose(1, 2).contiguous()


def register() -> None:
    """Make "sdpa_gqa" a known attention implementation (with sdpa's masks); idempotent."""
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def use_gqa_sdpa(model) -> None:
    """Switch a `PreTrainedModel` that runs "sdpa" to "sdpa_gqa" (any other implementation is left alone)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        register()
        model.set_attn_implementation(GQA_SDPA)
