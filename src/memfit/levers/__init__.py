"""Levers: search for the fastest way to fit a training step in a budget. ``fit`` weighs
recompute plans from :mod:`memfit.plan` combined with micro-batches, precision (autocast,
bfloat16 parameters), optimizer options (foreach, 8-bit state) and activation offload;
``max_batch`` finds the largest batch that fits; ``rank_fit`` does both per rank of an FSDP2
step (resharding, reduce dtype). What they produce is a :class:`~memfit.levers.recipe.Recipe`
(plain data, JSON), which :func:`memfit.apply_recipe` puts on a model."""
