"""LoRA fine-tunes (peft) for the accuracy benchmark (docs/benchmarks/lora.md): a frozen base
built from a config (random weights, nothing downloaded) with peft's LoRA adapters, as
``get_peft_model(model, LoraConfig(...))`` makes them, trained with AdamW over the adapters.

- ``llama``: transformers' Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, vocab 2000),
  the base in bfloat16, adapters r=8 on q/k/v/o (peft keeps them in float32), batch 4 x 256;
- ``llama_gc``: the same with transformers' gradient checkpointing as peft's recipes enable it
  (``gradient_checkpointing_enable(use_reentrant=True)`` and ``enable_input_require_grads``);
- ``gpt2``: GPT-2 (n_embd 256, 4 layers), the base in float32, adapters r=8 on ``c_attn``;
- ``qlora``: ``llama`` with every linear layer but the head quantized by bitsandbytes on the
  CPU (``Linear4bit``, NF4, double quantization, bfloat16 compute), as QLoRA loads it.
- ``int8``: ``llama`` with every linear layer but the head an LLM.int8 ``Linear8bitLt``
  quantized by bitsandbytes on the CPU (int8 weights, threshold 6.0), as ``load_in_8bit`` loads it.

    python benchmarks/profile_accuracy.py --models benchmarks/workloads/lora.py:llama,benchmarks/workloads/lora.py:llama_gc
    memfit profile benchmarks/workloads/lora.py:llama --device fake-cuda --gpu A10G
"""

import torch

import memfit

SEQ, VOCAB = 256, 2000


def _lora(base: torch.nn.Module, targets: list[str], batch_size: int, name: str, gc: bool = False) -> memfit.Workload:
    from peft import LoraConfig, get_peft_model

    if gc:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.05))
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return memfit.Workload(
        model, {"input_ids": ids, "labels": ids.clone()}, optimizer=lambda params: torch.optim.AdamW(params, lr=2e-4), name=name
    )


def _llama_base() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


def llama(batch_size: int = 4) -> memfit.Workload:
    return _lora(
        _llama_base(), ["q_proj", "k_proj", "v_proj", "o_proj"], batch_size, f"llama LoRA bf16 base, batch {batch_size} x {SEQ}"
    )


def llama_gc(batch_size: int = 4) -> memfit.Workload:
    return _lora(
        _llama_base(),
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        batch_size,
        f"llama LoRA bf16 base + checkpointing, batch {batch_size} x {SEQ}",
        gc=True,
    )


def gpt2(batch_size: int = 4) -> memfit.Workload:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=4, n_head=8, n_positions=SEQ)
    return _lora(transformers.GPT2LMHeadModel(cfg), ["c_attn"], batch_size, f"gpt2 LoRA fp32 base, batch {batch_size} x {SEQ}")


def _quantized(base: torch.nn.Module, quant_type: str = "nf4", double: bool = True) -> torch.nn.Module:
    """Each linear layer but the head as bitsandbytes' Linear4bit, quantized on the CPU by
    bitsandbytes itself (what ``BitsAndBytesConfig(load_in_4bit=True)`` leaves)."""
    import bitsandbytes as bnb

    for parent in list(base.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=double,
                    quant_type=quant_type,
                )
                q.weight = bnb.nn.Params4bit(
                    child.weight.data, requires_grad=False, compress_statistics=double, quant_type=quant_type, module=q
                )
                setattr(parent, name, q.to("cpu"))
    base.is_loaded_in_4bit = True  # as transformers marks it: peft wraps these with its 4-bit LoRA layer
    return base


def qlora(batch_size: int = 4) -> memfit.Workload:
    return _lora(
        _quantized(_llama_base()),
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        batch_size,
        f"llama QLoRA NF4 base (double quant, bf16 compute), batch {batch_size} x {SEQ}",
    )


def _int8(base: torch.nn.Module) -> torch.nn.Module:
    """Each linear layer but the head as bitsandbytes' Linear8bitLt (LLM.int8: int8 weights,
    threshold 6.0), quantized on the CPU by bitsandbytes itself (what
    ``BitsAndBytesConfig(load_in_8bit=True)`` leaves)."""
    import bitsandbytes as bnb

    for parent in list(base.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                q = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=child.bias is not None, has_fp16_weights=False, threshold=6.0
                )
                q.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
                setattr(parent, name, q.to("cpu"))
    base.is_loaded_in_8bit = True  # as transformers marks it: peft wraps these with its 8-bit LoRA layer
    return base


def int8(batch_size: int = 4) -> memfit.Workload:
    return _lora(
        _int8(_llama_base()),
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        batch_size,
        f"llama LoRA on an LLM.int8 base (threshold 6.0), batch {batch_size} x {SEQ}",
    )
