"""The flags more than one command takes, each defined once here, and how they are read.

A command's module (``cli/profile.py``, ...) adds these to its parser with its own help text
where the flag means something particular to it (``--device fake`` plans on fake tensors in
``plan``); the flag's name, type, choices and default are the same everywhere.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import memfit
from memfit.errors import MemfitError, TargetError
from memfit.workload import asked_ranks

DEVICES = ["cpu", "cuda", "fake", "fake-cuda"]
"""``--device``'s values for a command that runs a step."""

# --- the flags --------------------------------------------------------------------------


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, got {text!r}")
    return n


def target_args(p: argparse.ArgumentParser) -> None:
    """TARGET, ``--batch-size`` and ``--size``: what to build (:func:`memfit.load_target`)."""
    p.add_argument(
        "target",
        help="zoo model name (see `memfit zoo`), path/to/file.py:function returning a memfit.Workload, "
        "or torchtitan:MODULE:CONFIG (torchtitan's own job; docs/distributed.md)",
    )
    batch_size_arg(p, "batch size of the example inputs")
    size_arg(p, "zoo model size, e.g. n_layer=24 (several after one --size, or --size again)")


def batch_size_arg(p: argparse.ArgumentParser, help: str, default: int | None = None) -> None:
    p.add_argument("--batch-size", type=int, default=default, help=help)


def size_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument(
        "--size",
        action="append",  # several after one --size too: main() hands argparse one per --size=
        default=[],
        metavar="KEY=VALUE",
        help=help,
    )


def device_arg(p: argparse.ArgumentParser, help: str | None, *, choices: list[str] = DEVICES, default: str = "cpu") -> None:
    p.add_argument("--device", choices=choices, default=default, help=help)


def budget_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--budget", help=help)


def world_size_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--world-size", type=positive, metavar="N", help=help)


def ranks_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--ranks", metavar="R,R|all", help=help)


def json_arg(p: argparse.ArgumentParser, help: str, metavar: str = "PATH") -> None:
    p.add_argument("--json", metavar=metavar, help=help)


def picture_args(p: argparse.ArgumentParser, what: str = "the step") -> None:
    """``--plot`` and ``--html``: the step's timeline (:func:`memfit.cli.common.write_pictures`)."""
    p.add_argument("--plot", metavar="PATH.png", help=f"write a PNG of memory over the step's ticks by category: {what}")
    p.add_argument("--html", metavar="PATH.html", help="write the same as one self-contained page (hover, largest blocks)")


def gpu_options(p: argparse.ArgumentParser, *, capacity: bool = True) -> None:
    from memfit.cuda.gpu import GPUS

    p.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"with --device fake-cuda: the GPU to simulate and judge the step against ({', '.join(GPUS)}; default H100-80GB)",
    )
    if capacity:
        p.add_argument("--capacity", metavar="BYTES", help="device memory to judge the step against ('24GiB'); default the GPU's")


def step_args(p: argparse.ArgumentParser) -> None:
    """A flag for every :class:`memfit.StepOptions` field that changes the step's memory, so a
    step written by hand (gradient accumulation, autocast, ...) is measured as it runs."""
    g = p.add_argument_group("the training step (memfit.StepOptions; default: one pass, zero_grad(set_to_none=True))")
    g.add_argument(
        "--accumulate",
        metavar="K",
        help="gradient accumulation as a loop writes it: K forward+backward passes over the whole batch, no zero_grad "
        "between them, then one optimizer step (each pass holds the whole batch's activations)",
    )
    g.add_argument(
        "--micro-batches",
        metavar="K",
        help="split the batch into K micro-batches, forward+backward each (gradients accumulate), then one optimizer step",
    )
    g.add_argument(
        "--loss-scale",
        metavar="X",
        help="factor on each pass's loss (default 1/(micro-batches x accumulate), none for a single pass)",
    )
    g.add_argument(
        "--keep-grads",
        action="store_true",
        help="the loop calls zero_grad(set_to_none=False): gradients stay allocated between steps (the step starts with them)",
    )
    g.add_argument("--autocast", metavar="DTYPE", help="forward and loss under torch.autocast: bfloat16 or float16")
    g.add_argument("--grad-scaler", action="store_true", help="backward and optimizer step through torch.amp.GradScaler")
    g.add_argument(
        "--param-dtype", metavar="DTYPE", help="parameters, optimizer state and inputs cast to bfloat16 or float16 (a copy)"
    )
    g.add_argument("--foreach", metavar="on|off", help="set the optimizer's foreach flag (default: as it is)")
    g.add_argument(
        "--optimizer-8bit", action="store_true", help="the optimizer replaced by its bitsandbytes 8-bit counterpart"
    )
    g.add_argument(
        "--offload",
        action="store_true",
        help="tensors saved for backward go to pinned host memory (save_on_cpu; a CUDA step)",
    )
    g.add_argument(
        "--forward-before-loop",
        action="store_true",
        help="the program runs the model's forward once before its loop (a target computed with the model, a check): "
        "the forward's cuBLAS workspace exists before the first step (where a CUDA step's blocks are placed)",
    )
    g.add_argument(
        "--holds-output",
        action="store_true",
        help="the loop binds the model's output to a name (output = model(x)) and does not del it: the previous "
        "step's output stays alive until the next step's forward returns (the whole output object; with micro-batches "
        "or --accumulate, each pass's until the next pass's forward returns)",
    )
    g.add_argument(
        "--drops-output",
        action="store_true",
        help="the loop keeps only the loss (loss = model(**batch).loss, as transformers' Trainer): the model's output "
        "and its logits are dropped before backward instead of living through it",
    )


# --- reading them -----------------------------------------------------------------------


def gpu_args(ns: argparse.Namespace) -> tuple[Any, int | None]:
    """``--gpu`` and ``--capacity``, checked before any work: the GPU spec (None) and bytes (None)."""
    from memfit.cuda.gpu import GpuError, find_gpu

    spec = find_gpu(ns.gpu) if getattr(ns, "gpu", None) else None
    if spec is not None and ns.device != "fake-cuda":
        raise GpuError(
            f"--gpu {ns.gpu} is the GPU fake CUDA simulates: add --device fake-cuda (on --device {ns.device}, "
            "give --capacity BYTES to judge the step against a memory size)"
        )
    capacity = getattr(ns, "capacity", None)
    return spec, None if capacity is None else memfit.parse_bytes(capacity)


def read_budget(ns: argparse.Namespace) -> tuple[Any, str]:
    """``--budget``, or the (simulated) GPU's memory less the CUDA context estimate: the budget
    and how to print it. Sets the GPU fake CUDA simulates."""
    from memfit.cuda.gpu import CUDA_CONTEXT

    spec, capacity = gpu_args(ns)
    if spec is not None:
        from memfit.cuda import fake as fake_cuda

        fake_cuda.set_gpu(spec)
    if ns.budget is not None:
        if spec is not None or capacity is not None:
            raise MemfitError("give --budget, or --gpu/--capacity to take the budget from the GPU's memory, not both")
        return ns.budget, ns.budget
    if capacity is None and spec is None:
        raise MemfitError(
            "give --budget BYTES, or --gpu NAME / --capacity BYTES (the budget is then that memory less "
            "the CUDA context estimate)"
        )
    total = capacity if capacity is not None else spec.total_memory
    cuda = ns.device in ("cuda", "fake-cuda")
    budget = total - (CUDA_CONTEXT.bytes if cuda else 0)
    label = f"{memfit.format_bytes(total)}" + (f" {spec.key}" if spec is not None and capacity is None else "")
    if cuda:
        label += f" - {memfit.format_bytes(CUDA_CONTEXT.bytes)} CUDA context estimate"
    return budget, label


def rank_budget(ns: argparse.Namespace, work: Any, raw: Any, label: str) -> tuple[Any, str]:
    """A per-rank budget: with ``--gpu``/``--capacity`` on fake CUDA, the GPU's memory less the
    CUDA context (:func:`read_budget`) and less NCCL's buffers for the rank's communicators,
    which live outside the caching allocator; a ``--budget`` as given."""
    if ns.device != "fake-cuda" or ns.budget is not None:
        return raw, label
    from memfit.measure.distributed import nccl_outside, world_size_of

    spec, _ = gpu_args(ns)
    nccl = nccl_outside(work.parallel, world_size_of(work, ns.world_size), spec)
    return raw - nccl.bytes, f"{label} - {memfit.format_bytes(nccl.bytes)} NCCL estimate"


_DTYPE_CHOICES = ("bfloat16", "float16")


def _count_flag(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise MemfitError(f"{flag} takes a positive integer, got {text!r}")
    return n


def _choice_flag(flag: str, text: str | None, choices: tuple[str, ...]) -> str | None:
    if text is not None and text not in choices:
        raise MemfitError(f"{flag} takes one of {', '.join(choices)}, got {text!r}")
    return text


def step_options(ns: argparse.Namespace) -> memfit.StepOptions | None:
    """The step options the command line gives (:func:`step_args`), checked before any work:
    None when it gives none (the usual step, or a saved profile's). Bad values are one line."""
    loss_scale = None
    if ns.loss_scale is not None:
        try:
            loss_scale = float(ns.loss_scale)
        except ValueError:
            loss_scale = float("nan")
        if not (loss_scale > 0 and loss_scale != float("inf")):
            raise MemfitError(f"--loss-scale takes a positive number (0.25), got {ns.loss_scale!r}")
    foreach = _choice_flag("--foreach", ns.foreach, ("on", "off"))
    given = dict(
        micro_batches=_count_flag("--micro-batches", ns.micro_batches),
        accumulate=_count_flag("--accumulate", ns.accumulate),
        loss_scale=loss_scale,
        autocast=_choice_flag("--autocast", ns.autocast, _DTYPE_CHOICES),
        grad_scaler=ns.grad_scaler or None,
        set_to_none=False if ns.keep_grads else None,
        param_dtype=_choice_flag("--param-dtype", ns.param_dtype, _DTYPE_CHOICES),
        foreach=None if foreach is None else foreach == "on",
        optimizer_8bit=ns.optimizer_8bit or None,
        offload=ns.offload or None,
        inference=getattr(ns, "eval", False) or None,
        forward_before_loop=ns.forward_before_loop or None,
        holds_output=ns.holds_output or None,
        drops_output=ns.drops_output or None,
    )
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    try:
        return memfit.StepOptions(**given)
    except MemfitError as exc:  # the options' own checks, said in the flags' names
        text = str(exc).replace("an inference step", "--eval (an inference step)")
        for field, flag in _STEP_FLAGS.items():
            text = re.sub(rf"(?<![(\w-]){re.escape(field)}\b", flag, text)  # not StepOptions(offload=...)
        raise MemfitError(text) from None


_STEP_FLAGS = {
    "set_to_none=False": "--keep-grads",
    "micro_batches": "--micro-batches",
    "grad_scaler": "--grad-scaler",
    "optimizer_8bit": "--optimizer-8bit",
    "param_dtype": "--param-dtype",
    "loss_scale": "--loss-scale",
    "accumulate": "--accumulate",
    "foreach": "--foreach",
    "offload": "--offload",
    "forward_before_loop": "--forward-before-loop",
    "holds_output": "--holds-output",
    "drops_output": "--drops-output",
}
"""StepOptions' field names as the command line spells them, for its errors."""


def step_label(step: memfit.StepOptions | None) -> str:
    """What the command line asked of the step, for titles: ``" (accumulate 4, keep grads)"``."""
    if step is None:
        return ""
    default = memfit.StepOptions()
    said = [
        f"{name.replace('_', ' ')} {value}" if not isinstance(value, bool) else name.replace("_", " ")
        for name, value in step.to_dict().items()
        if value != getattr(default, name) and name not in ("set_to_none", "inference", "foreach")
    ]
    said += ["zero_grad(set_to_none=False)"] if not step.set_to_none else []
    said += [f"foreach {'on' if step.foreach else 'off'}"] if step.foreach is not None else []
    said += ["evaluation"] if step.inference else []
    return f" ({', '.join(said)})" if said else ""


def read_ranks(text: str | None, world_size: int) -> list[int]:
    """``--ranks``: ranks separated by commas, or 'all' (checked as the Python API's ``ranks=``)."""
    if text is None or text == "all":
        return asked_ranks(text, world_size)
    return asked_ranks(int_list("--ranks", text, "0,3"), world_size, name="--ranks")


def planned_ranks(text: str | None, workload: Any, world_size: int) -> list[int]:
    """``--ranks`` of ``plan`` and ``fit``: as :func:`read_ranks`, but under memfit's own pipeline
    parallelism every stage rank by default (each stage holds its own modules and is planned on its own)."""
    from memfit.measure.pipeline import own_pipeline

    return read_ranks("all" if text is None and own_pipeline(workload) else text, world_size)


def int_list(flag: str, text: str, example: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise TargetError(f"{flag} takes integers separated by commas ({example}), got {text!r}") from None


def compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="the step of torch.compile(model, backend=BACKEND) (default inductor; aot_eager, aot_eager_decomp_partition), "
        "run compiled and read from the CPU allocator; on --device fake|fake-cuda compiled on fake tensors, inductor's "
        "kernels not run (fake-cuda: inductor's CUDA code where Triton is installed, else the host's; replayed through "
        "the caching allocator model)",
    )
    p.add_argument(
        "--memory-budget",
        metavar="F[,F...]",
        help="with --compile: torch._functorch.config.activation_memory_budget value(s) to compile with, fractions from 0 to 1 "
        "(profile: default torch's; plan: the values tried, default 1,0.8,0.6,0.4,0.2,0)",
    )


def read_memory_budgets(ns: argparse.Namespace) -> list[float] | None:
    """``--memory-budget`` as fractions, or None when not given."""
    if ns.memory_budget is None:
        return None
    if not ns.compile:
        raise MemfitError("--memory-budget is torch.compile's activation_memory_budget: give --compile too")
    out = []
    for item in ns.memory_budget.split(","):
        try:
            v = float(item)
        except ValueError:
            v = -1.0
        if not 0.0 <= v <= 1.0:
            raise MemfitError(f"--memory-budget takes fractions from 0 to 1 separated by commas (e.g. 1,0.5,0), got {item!r}")
        out.append(v)
    return out
