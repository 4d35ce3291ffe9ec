"""The QLoRA step of cranberrii/ftcourse's ``Instrumenting_a_training_step_napkin_math.ipynb`` (commit
a8cedf2), whose GPU recorded it with ``torch.cuda.memory._record_memory_history()`` and dumped
``memory_snapshot.pickle`` beside the notebook: one forward and backward of TinyLlama-1.1B-Chat-v1.0
loaded in 4 bits, prepared by peft's ``prepare_model_for_kbit_training``, LoRA r=16 (alpha 32, dropout
0.05, peft's default targets for Llama: ``q_proj``, ``v_proj``), 1 x 1000 random token ids as both the
input and the labels, ``output = model(data, labels=data); output.loss.backward()``, no optimizer.

What the trace itself says about the run (its blocks and frames; the notebook's text shows another
cell's settings): bitsandbytes 0.43.1 and transformers 4.41 (the frames' line numbers), torch 2.1 or
2.2 (``nn.Module``'s line numbers; memory-efficient attention on float32); 4-bit weights quantized
from a 16-bit dtype (the dequantized weight is 2 bytes a value), no double quantization (float32
absmax, one per 64 values), compute dtype float32 (each matmul casts the dequantized weight to the
float32 input: ``MatMul4Bit.forward``'s ``.to(A.dtype)``); the embeddings, norms and head float32
(the kbit preparation, whose default also makes the embeddings' output require grad), float32
adapters; two 8,519,680 B cuBLAS workspaces (a GPU before Hopper) alive before the trace starts.

``workload`` is the step on the installed libraries; ``benchmarks/lora_snapshot.py`` runs it as
installed and with the run's libraries' behaviour put back, and docs/benchmarks/lora.md compares.
Random weights, nothing downloaded.
"""

from pathlib import Path

import torch

import memfit
from memfit.integrations.finetune import LoraSpec, lora_model

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tinyllama-1.1b-chat-v1.0.json")
SPEC = LoraSpec(
    rank=16,
    alpha=32,
    targets=("q_proj", "v_proj"),
    dropout=0.05,
    base_dtype="float16",  # transformers' default for a bitsandbytes load without torch_dtype
    quant="4bit",
    quant_type="fp4",  # BitsAndBytesConfig's default; nf4 holds the same bytes
    double_quant=False,
    compute_dtype="float32",
    kbit_prep=True,
)


def workload(batch_size: int = 1, seq_len: int = 1000) -> memfit.Workload:
    model = lora_model(CONFIG, SPEC)
    # prepare_model_for_kbit_training(model) with its default use_gradient_checkpointing=True turns
    # transformers' checkpointing on and makes the embeddings' output require grad; from_pretrained
    # left the model in eval mode, where transformers does not checkpoint, so only the second
    # changes the step (the first layer's saved tensors; the trace keeps them)
    model.enable_input_require_grads()
    data = torch.randint(0, 10000, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return memfit.Workload(
        model,
        {"input_ids": data, "labels": data, "use_cache": False},  # labels=data: the same tensor
        # no optimizer in the notebook: SGD with lr 0 keeps no state and updates in place
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        name=f"ftcourse TinyLlama QLoRA (fp4, no double quant, float32 compute, kbit prep) batch {batch_size} x {seq_len}",
    )
