"""transformers' packed-sequence check on fake tensors, in one place.

With no ``attention_mask`` and no cache (a training step), transformers' causal-mask code
asks ``masking_utils.find_packed_sequence_indices(position_ids)`` whether the batch holds
packed sequences. It decides by reading the positions; a fake tensor has no values, so it
answers "packed" (a tensor), and the model then builds a seq x seq attention mask in every
layer and, for grouped-query attention, repeats k and v to every head: memory a real step
never uses (at Llama-3-8B, 4096 tokens: ~100 MB per layer). When the model made the
positions itself (the inputs hold no ``position_ids``) they are ``arange``: not packed,
which is what a real step finds. :func:`unpacked_positions` says so for the fake step.
``tests/test_distributed.py`` checks that transformers still answers this way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from memfit.compat import torch_compat

__all__ = ["unpacked_positions"]


@contextmanager
def unpacked_positions(kwargs: dict[str, Any]) -> Iterator[None]:
    """Inside, transformers finds fake positions the model made itself unpacked (as a real
    step does); positions the user passed are left to transformers. Nothing happens when
    transformers is not imported or has no such check."""
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "find_packed_sequence_indices", None)
    if original is None or "position_ids" in kwargs:
        yield
        return

    def find_packed_sequence_indices(position_ids: Any) -> Any:
        found = original(position_ids)  # its own temporaries, as in the real step
        return None if torch_compat.is_fake(position_ids) else found

    module.find_packed_sequence_indices = find_packed_sequence_indices  # type: ignore[union-attr]
    try:
        yield
    finally:
        module.find_packed_sequence_indices = original  # type: ignore[union-attr]
