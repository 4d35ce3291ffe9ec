"""The llama of siddddd17/ackaudit (``ackaudit/hf_models.py``, ``hf_models(scale=8)["llama"]``), whose
compiled training step's peak was measured on a GPU at several ``activation_memory_budget`` values
(``experiments/measured_backward/run_d.py``; results under ``results/measured_backward/``, an
NVIDIA GeForce GTX 1650, torch 2.14.0+cu130): transformers' ``LlamaModel`` with 32 layers of width
256 (MLP 688, 8 heads, 8 KV heads), a 1,000-token vocabulary, no KV cache, fp32; token ids 2 x 1024;
the loss is ``last_hidden_state.sum()``.

The script's step after its warm-up: gradients zeroed in place (``zero_grad(set_to_none=False)``),
then ``compiled(ids).backward()`` with no optimizer. memfit's step says the same: ``--keep-grads``,
and SGD with lr 0 (no state, an in-place update that allocates nothing). docs/benchmarks/compile.md
compares (``benchmarks/compile_published.py``).
"""

import torch
from torch import nn

import memfit


class LlamaWrap(nn.Module):
    def __init__(self, layers: int, hidden: int = 256, heads: int = 8, vocab: int = 1000) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=int(hidden * 2.6875),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            vocab_size=vocab,
            use_cache=False,
        )
        self.model = LlamaModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).last_hidden_state.sum()


def workload(batch_size: int = 2, scale: int = 8) -> memfit.Workload:
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (batch_size, 128 * scale))
    return memfit.Workload(
        LlamaWrap(layers=4 * scale),
        (ids,),
        loss_fn=lambda loss: loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        name=f"ackaudit llama scale {scale}",
    )
