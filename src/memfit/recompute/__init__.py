"""Recompute: the mechanism on the user's model, reversible, and what makes it safe.

- ``checkpoint``: chosen modules recompute their forward in backward (``apply_choices``,
  ``remove``), with their buffers, RNG and Python state guarded;
- ``cache``: transformers' KV cache off while training, as its own gradient checkpointing
  does (a recompute would write the cache again);
- ``stateful``: which modules change Python state in forward, which a recompute would
  change again.

Below ``measure`` (which measures steps with recompute applied) and ``plan`` (which chooses
it); putting a whole :class:`~memfit.Plan` or :class:`~memfit.Recipe` on a model is
:mod:`memfit.apply`.
"""
