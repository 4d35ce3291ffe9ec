"""Shared ending of the benchmark scripts: a markdown table headed by the machine."""

from __future__ import annotations

import platform

import torch


def emit(rows: list[str], device: str, out: str | None) -> None:
    """Print ``rows`` under a line naming torch, device and host; also write to ``out``."""
    head = f"torch {torch.__version__}, {device}, {platform.machine()}, {torch.get_num_threads()} threads"
    text = head + "\n\n" + "\n".join(rows) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
