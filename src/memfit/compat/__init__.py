"""Compat: memfit's adapters to other libraries' private or fragile corners, in one place.

- ``torch_compat``: torch's private APIs (fake tensors, FLOP formulas, optimizer kernels);
- ``optim8bit``: bitsandbytes' 8-bit optimizers (the ``8bit`` lever) and paged optimizers' state;
- ``bnb4bit``: bitsandbytes' 4-bit linear layers (QLoRA bases built on meta, their quantization
  state, what their matmul allocates on CUDA);
- ``bnb8bit``: bitsandbytes' LLM.int8 linear layers (8-bit bases built on meta, their row scales,
  their int8 ops as the CUDA kernels allocate, the outlier columns assumed);
- ``hf_fake``: transformers' packed-sequence check on fake tensors.

Each is exercised by a test (``tests/test_torch_compat.py``, ``tests/test_fit.py``,
``tests/test_distributed.py``, ``tests/test_qlora.py``, ``tests/test_int8.py``), so a release that moves what it leans on fails there first.
The bottom layer: it imports nothing of memfit but its errors.
"""
