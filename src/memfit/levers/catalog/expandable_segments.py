"""``expandable_segments``: the CUDA caching allocator grows segments in place instead of
caching fixed ones. The same step and numerics, less reserved memory; a setting of the
allocator, so not a lever at all (nor named) off CUDA."""

from __future__ import annotations

from memfit.levers.catalog.base import Lever, Lines, Reason, Why


def _settings(s):
    if not s.cuda:
        return ()
    if s.settings is not None and s.settings.expandable_segments:
        return Reason(Why.ALREADY_ON, "already on (PYTORCH_CUDA_ALLOC_CONF)")
    return (True,)


LEVER = Lever(
    name="expandable_segments",
    exact=True,
    does="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the CUDA caching allocator grows segments "
    "in place instead of caching fixed ones (less reserved, the same numerics)",
    settings=_settings,
    used=lambda combo, plan, s: combo.expandable,
    step=lambda combo, s: {},
    words=lambda step, plan, optimizer_type: "expandable_segments:True",
    field="expandable",
    # an environment variable, read when CUDA's allocator starts: set before the training script runs
    lines=lambda recipe: Lines(
        environment=(
            f"# run the training script with the environment line PYTORCH_CUDA_ALLOC_CONF={recipe.allocator_conf} "
            "(the allocator reads it when CUDA starts)",
        )
    ),
    cuda_only=True,
)
