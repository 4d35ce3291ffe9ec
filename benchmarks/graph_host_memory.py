"""Host memory of autograd's graph on CPU, per node and per saved tensor (Linux, glibc).

    python benchmarks/graph_host_memory.py [--iterations 30000] [--out FILE.md]
    python benchmarks/graph_host_memory.py --pattern NAME [--checkpoint]   (one measurement, JSON)

Each pattern is a chain of ``--iterations`` repetitions on tiny tensors (a few bytes of
data each, so what grows is graph nodes, saved-tensor records and tensor objects), built
and run backward in a fresh process with the protocol of memfit's ground truth
(:mod:`memfit.bench.child`): one warm-up pass, freed heap returned to the OS (glibc
``malloc_trim``), RSS high-water mark reset, then forward and backward; the peak is
``VmHWM`` over the start. The autograd nodes and saved tensors per repetition are counted
as memfit's recorder counts them (a dispatch mode, a saved-tensor hook).

The figures fit ``peak = nodes x N + saved x S`` by least squares (relative error) over
every pattern but zoo ``heavy``'s, which is held out to check the fit: these are
``memfit.measure.ledger.GRAPH_NODE_BYTES`` and ``GRAPH_SAVED_BYTES``. The same chains cut
into non-reentrant checkpoints of 100 repetitions give the checkpoint's own bookkeeping per
node (``CHECKPOINT_BYTES_PER_NODE``, the median over the fitted patterns): what it adds
beyond the saved records it replaces.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys

import numpy as np

_HELD_OUT = "heavy"
_PATTERNS = {
    # name: (code of one repetition on x, repetition i; description)
    "add": ("x + 1.0", "`x + 1.0`"),
    "relu": ("torch.relu(x)", "`torch.relu(x)`"),
    "tanh": ("torch.tanh(x)", "`torch.tanh(x)`"),
    "mulw": ("x * w[i]", "`x * w[i]`"),
    "linear": ("F.linear(x, W)", "`F.linear(x, W)` (1 x 4)"),
    "sigmul": ("x * torch.sigmoid(x)", "`x * torch.sigmoid(x)`"),
    "exp2": ("torch.exp(x) * 0.5 + x", "`torch.exp(x) * 0.5 + x`"),
    "heavy": ("torch.tanh(x * w[i])", "`torch.tanh(x * w[i])` (zoo heavy, held out)"),
}
_BLOCK = 100  # repetitions per checkpoint


def _measure(name: str, n: int, checkpointed: bool) -> dict:
    import torch
    import torch.nn.functional as F  # noqa: N812  (the patterns' spelling)
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    libc = ctypes.CDLL("libc.so.6")

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    class Nodes(TorchDispatchMode):
        """Forward ops that record a node, as memfit's recorder decides it."""

        def __init__(self) -> None:
            super().__init__()
            self.nodes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            self.nodes += (
                func.overloadpacket.__name__ != "detach"
                and torch.is_grad_enabled()
                and any(t.requires_grad for t in tensors)
                and isinstance(out, torch.Tensor)
                and out.is_floating_point()
            )
            return out

    w = torch.randn(n, requires_grad=True)
    W = torch.randn(4, 4, requires_grad=True)  # noqa: N806
    x0 = torch.randn(1, 4, requires_grad=True) if name == "linear" else torch.randn(4, requires_grad=True)
    step = eval(f"lambda x, i: {_PATTERNS[name][0]}", {"torch": torch, "F": F, "w": w, "W": W})  # noqa: S307

    def chain(k: int, ckpt: bool) -> torch.Tensor:
        def block(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            for i in range(start, stop):
                x = step(x, i)
            return x

        x = x0
        for s in range(0, k, _BLOCK if ckpt else k):
            stop = min(k, s + (_BLOCK if ckpt else k))
            x = checkpoint(block, x, s, stop, use_reentrant=False) if ckpt else block(x, s, stop)
        return x.sum()

    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    counts = []
    for k in (_BLOCK, 2 * _BLOCK):  # the difference leaves out the sum and the chain's ends
        saved[0] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Nodes() as mode:
            loss = chain(k, False)
        counts.append((mode.nodes, saved[0]))
        del loss
    nodes, saved_per = ((b - a) / _BLOCK for a, b in zip(*counts))

    peak = 0
    for _ in range(2):  # the first pass is the warm-up
        for t in (w, W, x0):
            t.grad = None
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = status("VmRSS")
        chain(n, checkpointed).backward()
        peak = status("VmHWM") - start
    return {"pattern": name, "checkpoint": checkpointed, "nodes": nodes, "saved": saved_per, "peak_per_rep": peak / n}


def _run(name: str, n: int, checkpointed: bool) -> dict:
    cmd = [sys.executable, __file__, "--pattern", name, "--iterations", str(n)] + (["--checkpoint"] if checkpointed else [])
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=30_000)
    parser.add_argument("--pattern", choices=sorted(_PATTERNS))
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--out")
    ns = parser.parse_args()
    if ns.pattern:
        print(json.dumps(_measure(ns.pattern, ns.iterations, ns.checkpoint)))
        return
    from _table import emit  # benchmarks/_table.py, beside this script

    plain = {name: _run(name, ns.iterations, False) for name in _PATTERNS}
    ckpt = {name: _run(name, ns.iterations, True) for name in _PATTERNS}
    fitted = [name for name in _PATTERNS if name != _HELD_OUT]
    a = np.array([[plain[k]["nodes"], plain[k]["saved"]] for k in fitted])
    y = np.array([plain[k]["peak_per_rep"] for k in fitted])
    (node, saved), *_ = np.linalg.lstsq(a / y[:, None], np.ones(len(y)), rcond=None)
    bookkeeping = {
        k: (ckpt[k]["peak_per_rep"] - plain[k]["peak_per_rep"] + plain[k]["saved"] * saved) / plain[k]["nodes"] for k in _PATTERNS
    }
    rows = [
        f"fit over {len(fitted)} patterns ({ns.iterations:,} repetitions each): node {node:,.0f} B, saved tensor "
        f"{saved:,.0f} B; checkpoint bookkeeping per node (median) {statistics.median(bookkeeping[k] for k in fitted):,.0f} B",
        "",
        "| pattern | nodes / rep. | saved / rep. | measured peak / rep. | fit | error | checkpointed peak / rep. | checkpoint bookkeeping / node |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, (_, label) in _PATTERNS.items():
        p = plain[k]
        fit = p["nodes"] * node + p["saved"] * saved
        rows.append(
            f"| {label} | {p['nodes']:g} | {p['saved']:g} | {p['peak_per_rep']:,.0f} B | {fit:,.0f} B | "
            f"{fit / p['peak_per_rep'] - 1:+.1%} | {ckpt[k]['peak_per_rep']:,.0f} B | {bookkeeping[k]:,.0f} B |"
        )
    emit(rows, "cpu", ns.out)


if __name__ == "__main__":
    main()
