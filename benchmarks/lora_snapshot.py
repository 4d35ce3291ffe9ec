"""A QLoRA step recorded on a GPU by ``torch.cuda.memory._dump_snapshot``, predicted on fake CUDA
(issue 27 item 5: allocated within 2%, reserved within 3%).

    MEMFIT_FAKE_CUDA=1 python benchmarks/lora_snapshot.py MIRRORS [--out FILE.md]

``MIRRORS`` holds the fetched repositories as the fetch tool lays them out
(``MIRRORS/<owner>+<name>/repo``, a bare git directory, never committed): here
cranberrii/ftcourse at a8cedf2, whose ``memory_snapshot.pickle`` is the trace of
``Instrumenting_a_training_step_napkin_math.ipynb``'s recorded cell
(``benchmarks/workloads/ftcourse_qlora.py`` says what ran). The recorded peaks are the trace
relived from the state it starts with (:func:`memfit.cuda.snapshot.relive`: the model loaded,
its cuBLAS workspaces, the segments loading left cached), memfit's are ``memfit.profile`` on
fake CUDA as a T4 (a GPU before Hopper: the trace's two 8,519,680 B cuBLAS workspaces).

The step is run as installed (transformers 5.24, bitsandbytes 0.50.2, torch 2.13), then with
the run's libraries' behaviour put back one part at a time (the trace's frames and blocks say
which): transformers 4.41's attention (K and V repeated to every head, so SDPA takes its
memory-efficient kernel on float32 instead of the math path) and loss (a shifted float32
copy of the logits); bitsandbytes 0.43.1's ``MatMul4Bit`` keeping its input for backward
(bitsandbytes#1270, in 0.43.2, stopped it); torch 2.1-2.2's ``MeanBackward1`` keeping the mean's
input (pytorch#109876), which each RMSNorm's ``pow(2).mean(-1)`` hits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# isort: off
import memfit  # noqa: F401  (first: with MEMFIT_FAKE_CUDA=1 it loads fake CUDA before anything imports torch)
from _table import emit  # benchmarks/_table.py, beside this script
from lora_published import repeated_kv, shifted_logits_copy

# isort: on

REPO, COMMIT, TRACE = "cranberrii/ftcourse", "a8cedf28ee118bdd0d50773780885e0e3a4bf027", "memory_snapshot.pickle"


@contextlib.contextmanager
def matmul4bit_0431() -> Iterator[None]:
    """bitsandbytes 0.43.1's ``MatMul4Bit.forward``: the weight dequantized to the dtype it was
    quantized from, cast to the input's dtype, ``F.linear``; and the input kept on ``ctx`` for
    backward (``ctx.tensors = (A, B)``), though backward uses only the weight (bitsandbytes#1270,
    in 0.43.2, stopped keeping it). Today's forward runs bitsandbytes' ``gemm_4bit`` op, which
    dequantizes straight to the input's dtype. Backward is the installed one (the same as 0.43.1's)."""
    import torch
    from bitsandbytes import functional as F
    from bitsandbytes.autograd._functions import MatMul4Bit

    kept = MatMul4Bit.forward

    def forward(ctx, A, B, out=None, bias=None, quant_state=None):  # noqa: ANN001, ANN202, N803
        if A.numel() == 0 or out is not None:
            return kept(ctx, A, B, out, bias, quant_state)
        ctx.is_empty = False
        B = B.view(-1, 1)  # the installed backward's canonical form
        output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype), bias)
        ctx.state = quant_state
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
        ctx.tensors = (A, B) if any(ctx.needs_input_grad[:2]) else (None, None)
        return output

    MatMul4Bit.forward = staticmethod(forward)
    try:
        yield
    finally:
        MatMul4Bit.forward = kept


@contextlib.contextmanager
def mean_keeps_input() -> Iterator[None]:
    """torch before pytorch#109876 was fixed: ``mean``'s backward node keeps its input
    (``_saved_self``). In a Llama that is each RMSNorm's ``pow(2)``, one activation-sized float32
    tensor a norm; the norm is otherwise transformers' own."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class MeanKeepsInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            ctx.save_for_backward(x)
            return x.mean(-1, keepdim=True)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            (x,) = ctx.saved_tensors
            return grad.expand(x.shape) / x.shape[-1]

    kept = LlamaRMSNorm.forward

    def forward(self, hidden_states):  # noqa: ANN001, ANN202
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = MeanKeepsInput.apply(hidden_states.pow(2))
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    LlamaRMSNorm.forward = forward
    try:
        yield
    finally:
        LlamaRMSNorm.forward = kept


@contextlib.contextmanager
def together(*parts: Callable[[], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(part())
        yield


STEPS: list[tuple[str, tuple[Callable[[], contextlib.AbstractContextManager[None]], ...]]] = [
    ("as installed", ()),
    ("+ transformers 4.41's attention and loss", (repeated_kv, shifted_logits_copy)),
    ("+ bitsandbytes 0.43.1's MatMul4Bit", (repeated_kv, shifted_logits_copy, matmul4bit_0431)),
    ("+ torch 2.2's mean backward (the run's step)", (repeated_kv, shifted_logits_copy, matmul4bit_0431, mean_keeps_input)),
]


def recorded(mirrors: Path) -> dict[str, int]:
    from memfit.cuda.snapshot import load_snapshot, relive

    blob = subprocess.run(
        ["git", "--git-dir", str(mirrors / REPO.replace("/", "+") / "repo"), "show", f"{COMMIT}:{TRACE}"],
        check=True, capture_output=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.pickle"
        path.write_bytes(blob)
        rec = relive(load_snapshot(path))
    return {
        "allocated": rec.stats.allocated_peak_bytes,
        "reserved": rec.stats.reserved_peak_bytes,
        "start_allocated": rec.start_allocated_bytes,
        "start_reserved": rec.start_reserved_bytes,
    }


def predicted(parts: tuple[Callable[[], contextlib.AbstractContextManager[None]], ...]) -> tuple[dict[str, int], float]:
    sys.path.insert(0, str(Path(__file__).parent))
    from workloads.ftcourse_qlora import workload

    t0 = time.process_time()
    with together(*parts):
        prof = memfit.profile(workload(), fake="cuda", gpu="T4")
    got = {"allocated": prof.allocated_peak_bytes, "reserved": prof.reserved_peak_bytes, "start": prof.start_bytes}
    return got, time.process_time() - t0


def _pct(a: int, b: int) -> str:
    return f"{100.0 * (a - b) / b:+.2f}%"


def main() -> None:
    if os.environ.get("MEMFIT_FAKE_CUDA") != "1":
        sys.exit("run with MEMFIT_FAKE_CUDA=1 (fake CUDA must be loaded before torch)")
    parser = argparse.ArgumentParser()
    parser.add_argument("mirrors", type=Path)
    parser.add_argument("--out")
    ns = parser.parse_args()
    rec = recorded(ns.mirrors)
    print(f"recorded: {rec}", flush=True)
    rows = [
        "| step | recorded allocated | memfit allocated | error | recorded reserved | memfit reserved | error | CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, parts in STEPS:
        got, cpu = predicted(parts)
        print(f"{name}: {got}", flush=True)
        rows.append(
            f"| {name} | {rec['allocated']:,} | {got['allocated']:,} | {_pct(got['allocated'], rec['allocated'])} | "
            f"{rec['reserved']:,} | {got['reserved']:,} | {_pct(got['reserved'], rec['reserved'])} | {cpu:.1f} |"
        )
    emit(rows, "fake CUDA", ns.out)


if __name__ == "__main__":
    main()
