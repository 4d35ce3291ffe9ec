"""Measure: what one training step does with memory and time (mechanism, no policy).

- ``ledger``: plain data (blocks, timeline), no torch;
- ``scope``, ``recorder``: hooks and dispatch modes that observe a step;
- ``sandbox``: running steps without changing the user's objects (real or fake tensors);
- ``step``: the step itself; ``profile``: the public entry point;
- ``groundtruth``: the physical peak of a step in a fresh process (RSS or CUDA allocator).
"""
