"""What the framework integrations share and no framework is needed for."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["rng_kept", "say", "generators", "first_batch_of"]


def say(message: str) -> None:
    print(f"memfit: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def rng_kept(*generators: torch.Generator) -> Iterator[None]:
    """Drawing a batch starts a sampler, which takes a seed from torch's generator (or
    advances its own): put every generator back, so the framework's data order and
    dropout are as they would be without memfit."""
    state = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py = random.getstate()
    npstate = np.random.get_state()
    own = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        torch.set_rng_state(state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        np.random.set_state(npstate)
        for g, st in own:
            g.set_state(st)


def generators(loader: object) -> list[torch.Generator]:
    """The torch generators a DataLoader (or accelerate's wrapper) draws its order from."""
    found: list[torch.Generator] = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        for name in ("generator", "synchronized_generator"):
            g = getattr(owner, name, None)
            if isinstance(g, torch.Generator) and all(g is not h for h in found):
                found.append(g)
    return found


def first_batch_of(loader: Any) -> Any:
    """The first batch of ``loader`` (a DataLoader, or accelerate's wrapper of one), drawn
    without moving any random generator: the run's data order and dropout stay as they were.
    None when the loader is empty. From accelerate's wrapper, the plain DataLoader inside it
    is read (the wrapper registers itself with accelerate's gradient state until it is
    iterated to the end), so the batch is on the host."""
    with rng_kept():
        base = getattr(loader, "base_dataloader", loader)
        with rng_kept(*generators(base), *generators(loader)):
            return next(iter(base), None)
