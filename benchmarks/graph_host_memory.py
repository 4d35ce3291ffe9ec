"""Host memory autograd's graph holds per op on CPU, beyond tensor data (Linux, glibc).

    python benchmarks/graph_host_memory.py [--iterations 30000] [--out FILE.md]

For each pattern, a chain of ``--iterations`` repetitions on tiny tensors (a few bytes of
data each, so what grows is graph nodes, saved-tensor records and tensor objects) is
built with autograd on. Freed heap pages are returned first (glibc ``malloc_trim``), then
the RSS rise is read at the end of the forward (graph and saved tensors alive) and after
backward (saved tensors released, nodes alive until the graph is freed). Aten ops per
repetition (not counting the ``detach`` autograd runs to save an output, as
``Profile.graph_ops`` does not) are counted with a dispatch mode on a short chain. These are the figures behind
``memfit.measure.profile.GRAPH_HOST_BYTES_PER_OP`` and the README's Known limitations.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
from collections.abc import Callable

import torch
from _table import emit  # benchmarks/_table.py, beside this script
from torch.utils._python_dispatch import TorchDispatchMode

_LIBC = ctypes.CDLL("libc.so.6")
_PAGE = 4096


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


_LIBC.mallinfo2.restype = _Mallinfo2


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back (Python's small objects, in pymalloc's
    own arenas, are not in it; RSS has them)."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # as memfit's Profile.graph_ops counts: not the detach autograd runs to save an output
        self.ops += func.overloadpacket.__name__ != "detach"
        return func(*args, **(kwargs or {}))


def _patterns(n: int) -> dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], torch.Tensor]]:
    w = torch.randn(n, requires_grad=True)
    weight = torch.randn(4, 4, requires_grad=True)
    vec = torch.randn(4, requires_grad=True)
    return {
        "x + 1.0": (lambda x, i: x + 1.0, vec),
        "torch.relu(x)": (lambda x, i: torch.relu(x), vec),
        "torch.tanh(x)": (lambda x, i: torch.tanh(x), vec),
        "x * w[i]": (lambda x, i: x * w[i], vec),
        "torch.tanh(x * w[i]) (zoo heavy)": (lambda x, i: torch.tanh(x * w[i]), vec),
        "F.linear(x, W) (1 x 4)": (lambda x, i: torch.nn.functional.linear(x, weight), vec.reshape(1, 4)),
    }


def _chain(f: Callable[[torch.Tensor, int], torch.Tensor], x0: torch.Tensor, n: int) -> torch.Tensor:
    x = x0
    for i in range(n):
        x = f(x, i)
    return x.sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=30_000)
    parser.add_argument("--out")
    ns = parser.parse_args()
    n = ns.iterations
    rows = [
        "| pattern | ops per repetition | RSS at forward end | malloc in use at forward end | malloc in use after backward |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (f, x0) in _patterns(n).items():
        counts = []
        for k in (10, 20):
            with _Count() as count:
                _chain(f, x0, k)
            counts.append(count.ops)
        per = (counts[1] - counts[0]) / 10
        for _ in range(2):  # the first pass warms the allocator's arenas and caches
            gc.collect()
            _LIBC.malloc_trim(0)
            rss, heap = _rss(), _malloc_in_use()
            loss = _chain(f, x0, n)
            forward_rss, forward_heap = _rss() - rss, _malloc_in_use() - heap
            loss.backward()
            backward_heap = _malloc_in_use() - heap
            del loss
            x0.grad = None
        ops = per * n
        cells = " | ".join(f"{b / ops:,.0f} B/op" for b in (forward_rss, forward_heap, backward_heap))
        rows.append(f"| `{name}` | {per:g} | {cells} |")
    emit(rows, "cpu", ns.out)


if __name__ == "__main__":
    main()
