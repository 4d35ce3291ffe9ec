"""A small mixture-of-experts decoder: transformers' Qwen2-MoE, 2 layers, 8 experts, top-2
routing, fp32 on CPU, random weights, batch 2 x 64 tokens with labels (the README's input
pattern, the same tensor twice). transformers runs the experts as one grouped GEMM
(``aten._grouped_mm``), whose fake kernel accepts bf16 only.
``memfit plan benchmarks/workloads/qwen_moe.py:qwen_moe --budget 50%``."""

import torch

import memfit


def _loss(out):
    return out.loss


def qwen_moe() -> memfit.Workload:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    model = transformers.Qwen2MoeForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    return memfit.Workload(model, {"input_ids": ids, "labels": ids}, loss_fn=_loss, name="qwen2-moe 2L 8x top-2")
