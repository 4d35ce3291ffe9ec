"""Measure: what one training step does with memory and time (mechanism, no policy).

- ``ledger``: plain data (blocks, timeline), no torch;
- ``scope``, ``recorder``: hooks and dispatch modes that observe a step;
- ``sandbox``: running steps without changing the user's objects (real or fake tensors);
- ``step``: the step itself; ``profile``: the public entry point; ``timing``: step times.

Physical ground truth (a step measured in a fresh process) is :mod:`memfit.bench`'s job.
"""
