"""memfit where training already happens: transformers' Trainer
(:mod:`memfit.integrations.transformers`) and Lightning (:mod:`memfit.integrations.lightning`).

Each submodule imports its framework and nothing else optional; this package imports
neither, so ``import memfit`` never loads transformers or Lightning.
"""
