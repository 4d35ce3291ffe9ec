"""The 1.1B Llama of issue 24 item 5 for plan-time benchmarks: transformers' Llama at
TinyLlama's dimensions (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632,
vocab 32000), random weights, batch 8 x 2048 tokens, labels given (the loss is output.loss).
Meant for fake CUDA, where nothing is allocated:
``memfit plan benchmarks/workloads/tinyllama.py:workload --device fake-cuda --gpu A100-80GB --budget 50%``.
``small`` is the same model at 4 layers and batch 1 x 512, to profile the planner quickly."""

import torch

import memfit


def _llama(layers: int, batch: int, seq: int, name: str) -> memfit.Workload:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return memfit.Workload(model, {"input_ids": ids, "labels": ids.clone()}, name=name)


def workload() -> memfit.Workload:
    return _llama(22, 8, 2048, "tinyllama 1.1B, batch 8 x 2048")


def small() -> memfit.Workload:
    return _llama(4, 1, 512, "tinyllama 4 layers, batch 1 x 512")
