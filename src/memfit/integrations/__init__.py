"""memfit where training already happens: transformers' Trainer
(:mod:`memfit.integrations.transformers`), accelerate (:mod:`memfit.integrations.accelerate`)
and Lightning (:mod:`memfit.integrations.lightning`).

Each submodule imports its framework and nothing else optional (accelerate's loads
transformers only for ``estimate_memory``, when called); this package imports none of
them, so ``import memfit`` never loads transformers, accelerate or Lightning.
"""
