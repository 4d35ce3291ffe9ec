"""Shared by the benchmark scripts that run real gloo ranks on this CPU (benchmarks do not
import tests/conftest.py, whose ``gloo_ranks`` this mirrors)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_ranks(fn: Callable[..., Any], world_size: int, *args: Any, start_method: str = "spawn") -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a real gloo process group of
    ``world_size`` processes; what each rank returned (JSON data). ``spawn`` starts each rank
    afresh (glibc reads MALLOC_* settings at start, RSS starts clean); ``fork`` is quicker."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        args = (world_size, free_port(), out, fn, args)
        mp.start_processes(_rank, args=args, nprocs=world_size, join=True, start_method=start_method)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world_size)]


def _rank(rank: int, world_size: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        Path(f"{out}.{rank}").write_text(json.dumps(fn(rank, world_size, *args)))
    finally:
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
