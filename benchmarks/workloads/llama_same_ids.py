"""The README's input pattern on a small Llama: ``{"input_ids": ids, "labels": ids}``, one
tensor passed twice (transformers shifts the labels itself). transformers' LlamaForCausalLM,
2 x 128, a 1k vocabulary, random weights, batch 2 x 64. Inputs that share storage are one
block of memory, on the CPU as on (fake) CUDA.
``memfit plan benchmarks/workloads/llama_same_ids.py:llama_same_ids --device fake-cuda --gpu A100-80GB``."""

import torch

import memfit


def _loss(out):
    return out.loss


def llama_same_ids() -> memfit.Workload:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=1024,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    return memfit.Workload(model, {"input_ids": ids, "labels": ids}, loss_fn=_loss, name="llama 2 x 128, ids twice")
