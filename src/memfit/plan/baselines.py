"""The plans users write by hand today, as memfit choices, for comparison.

- ``every_block``: full recompute of every block;
- ``every_other_block``: the same, every second block.

"Blocks" are the children of ``nn.ModuleList``/``nn.Sequential`` containers that are of
the type occurring most often as such a child (ties go to the type with parameters):
``transformer.h.*`` in a GPT, ``encoder.layer.*`` in BERT, every Bottleneck across a
ResNet's four stages, the Linear layers of a deep MLP.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

__all__ = ["blocks", "every_block", "every_other_block"]


def blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks, in model order."""
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            found += [(f"{name}.{n}" if name else n, c) for n, c in mod.named_children()]
    kinds = Counter(type(c) for _, c in found)
    if not kinds:
        return []

    def has_parameters(kind: type) -> bool:
        return any(any(True for _ in c.parameters()) for _, c in found if type(c) is kind)

    kind = max(kinds, key=lambda k: (kinds[k], has_parameters(k)))
    return [n for n, c in found if type(c) is kind]


def every_block(model: nn.Module) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {name: ("full", ()) for name in blocks(model)}


def every_other_block(model: nn.Module) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {name: ("full", ()) for name in blocks(model)[::2]}
