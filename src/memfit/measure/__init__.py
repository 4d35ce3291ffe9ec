"""Measure: what one training step does with memory and time (mechanism, no policy).

- ``ledger``: plain data (blocks, timeline), no torch;
- ``scope``, ``recorder``: hooks and dispatch modes that observe a step;
- ``sandbox``: running steps without changing the user's objects (real or fake tensors);
- ``step``: the step itself; ``profile``: the public entry point; ``timing``: step times;
- ``replay``: a recorded step through the CUDA caching allocator model (:mod:`memfit.cuda`);
- ``verify``: a recompute plan run on the step for its exact peak (what :mod:`memfit.plan`
  searches with), and ``cache_check``: whether the KV cache switch changes the step's numbers;
- ``distributed``: one rank of a parallelized step on a fake process group.

Physical ground truth (a step measured in a fresh process) is :mod:`memfit.bench`'s job.
"""
