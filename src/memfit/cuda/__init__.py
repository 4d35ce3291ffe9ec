"""CUDA from a CPU: what a CUDA GPU would do with a step, simulated (plain data, no GPU).

- ``allocator``: a model of PyTorch's CUDA caching allocator (blocks, segments, the
  ``PYTORCH_CUDA_ALLOC_CONF`` options), replaying allocations and frees;
- ``snapshot``: a GPU's recorded memory snapshot, read, re-lived and replayed through it;
- ``gpu``: GPU datasheets (memory, compute capability, rates) and whether a step fits one;
- ``fake``: fake CUDA on a CPU build of torch (a small C++ shim, ``fake.cpp``, built once).

A measured step replayed through the allocator is :mod:`memfit.measure.replay`. Below
``measure``: it imports nothing of memfit but its errors.
"""
