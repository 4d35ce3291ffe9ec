"""``memfit finetune``: a LoRA fine-tune of a transformers model, from its config.json alone,
on a named GPU (fake CUDA): the step's allocated and reserved peaks by category, the largest
batch or sequence that fits, and the cheapest levers when it does not."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

import memfit
from memfit import zoo
from memfit.cli.common import require_device
from memfit.cli.options import batch_size_arg, gpu_options, json_arg, read_budget, size_arg
from memfit.errors import TargetError

DEVICE = "fake-cuda"
"""The only device: the question is about a GPU this machine need not have."""
DEFAULT_GPU = "H100-80GB"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "finetune",
        help="a LoRA fine-tune (peft) from a transformers config.json on a named GPU: peaks, largest batch, levers that fit",
    )
    p.add_argument(
        "config",
        help="a local config.json (or its folder) or a transformers model type (llama, mistral, ...: its default sizes); "
        "nothing is downloaded, no weights are made",
    )
    batch_size_arg(p, "sequences in the step (default 1)", default=1)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R", help="LoRA rank r (default 16)")
    p.add_argument(
        "--lora-alpha", type=float, metavar="A", help="LoRA alpha (default: the rank); scales the adapters' output, no memory"
    )
    p.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        metavar="NAMES",
        help="modules to adapt, comma-separated, as peft's target_modules (default q_proj,v_proj; or all-linear)",
    )
    p.add_argument("--lora-dropout", type=float, default=0.0, metavar="P", help="LoRA dropout (default 0: none)")
    p.add_argument(
        "--base-dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="the frozen base's dtype (default bfloat16); the adapters are float32, as peft keeps them",
    )
    p.add_argument(
        "--autocast-adapter-dtype",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="peft's get_peft_model(autocast_adapter_dtype=...): on (default) the adapters are float32; off, the dtype "
        "peft makes them in: the base layer's (bfloat16 over a bfloat16 base; float32 over a 4-bit base)",
    )
    _quant_options(p)
    p.add_argument(
        "--attn",
        default="sdpa",
        choices=["sdpa", "flash_attention_2"],
        help="the attention implementation (default sdpa, transformers' default); flash_attention_2 as transformers "
        "runs the flash-attn package: float32 inputs cast to 16 bits, grouped K/V as they are (unpadded batches)",
    )
    _step_flags(p)
    gpu_options(p)
    p.add_argument(
        "--max",
        choices=["batch", "seq"],
        help="also the largest batch (at --seq-len) or sequence length (at --batch-size) whose step fits the GPU as it is",
    )
    p.add_argument("--multiple-of", type=int, default=1, metavar="N", help="with --max: sizes that are multiples of N")
    p.add_argument("--no-levers", action="store_true", help="when the step does not fit, do not search for the levers that fit")
    size_arg(p, "config override, e.g. num_hidden_layers=16")
    json_arg(p, "also write the answers as JSON")
    p.set_defaults(func=run, device=DEVICE, budget=None)


def _step_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the training step itself: the optimizer, accumulation, autocast, checkpointing."""
    p.add_argument(
        "--optim",
        default="adamw_torch",
        choices=["adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit"],
        help="the optimizer, by the Trainer's optim names (default adamw_torch); a paged one's paged state is CUDA "
        "unified memory, outside the caching allocator: shown on a line of its own, not in allocated or reserved",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="gradient_accumulation_steps: N forward and backward passes of --batch-size sequences before the "
        "optimizer step, the adapters' gradients accumulating (default 1)",
    )
    p.add_argument(
        "--autocast",
        choices=["bfloat16", "float16"],
        help="the Trainer's bf16=True (bfloat16) or fp16=True (float16, with a GradScaler): forward and loss under "
        "torch.autocast (default: none)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="transformers' gradient checkpointing as peft's recipes turn it on (reentrant, enable_input_require_grads)",
    )


def _quant_options(p: argparse.ArgumentParser) -> None:
    """The flags of a quantized base (QLoRA): what bitsandbytes and peft are given."""
    p.add_argument(
        "--quant",
        default="none",
        choices=["none", "4bit", "8bit"],
        help="4bit: QLoRA, the base's linear layers (all but the output head) as bitsandbytes Linear4bit; "
        "8bit: as Linear8bitLt (LLM.int8, load_in_8bit=True: int8 weights, float32 row scales, threshold 6.0)",
    )
    p.add_argument("--quant-type", default="nf4", choices=["nf4", "fp4"], help="with --quant 4bit: the 4-bit data type (default nf4)")
    p.add_argument(
        "--double-quant",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="with --quant 4bit: quantize the absmax too (bnb_4bit_use_double_quant; default on, as QLoRA)",
    )
    p.add_argument(
        "--compute-dtype",
        choices=["bfloat16", "float16", "float32"],
        help="with --quant 4bit: the dtype the weights are dequantized to for each matmul (default: --base-dtype)",
    )
    p.add_argument(
        "--kbit-prep",
        action="store_true",
        help="with --quant 4bit or 8bit: the base through peft's prepare_model_for_kbit_training, as TRL's SFTTrainer and "
        "QLoRA's scripts do (its non-quantized parameters, embeddings, norms and output head, in float32)",
    )
    p.add_argument(
        "--int8-outliers",
        type=int,
        default=0,
        metavar="N",
        help="with --quant 8bit: outlier columns (|x| >= 6.0, computed in 16 bits) assumed in each int8 matmul's input; "
        "data-dependent, so assumed (default 0; the config's intermediate_size, the widest input, gives the upper bound)",
    )


@contextlib.contextmanager
def _without_bitsandbytes() -> Iterator[None]:
    """peft imports bitsandbytes when installed, which imports torch's inductor: 8 CPU s of the
    30 this command has for a 7-8B model. A LoRA on an unquantized base needs none of it, so it
    is hidden while peft is imported (peft then leaves out its bitsandbytes layers), and put
    back after so anything later may import it. This process is the command's own."""
    hide = "peft" not in sys.modules and "bitsandbytes" not in sys.modules
    if hide:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # find_spec and import both say: not installed
    try:
        yield
    finally:
        if hide and sys.modules.get("bitsandbytes", 0) is None:
            del sys.modules["bitsandbytes"]


@contextlib.contextmanager
def _compile_on_first_call() -> Iterator[None]:
    """bitsandbytes wraps some of its CPU kernels in ``torch.compile`` when it is imported,
    which imports torch's dynamo: 7.5 of the CPU seconds a 7-8B QLoRA answer takes, for
    kernels a fake-tensor step never runs. While it is imported, ``torch.compile`` returns a
    function that compiles on its first call, which is when torch compiles anyway (and
    bitsandbytes' own fallback to the eager function still catches a failure there). This
    process is the command's own, and the real ``torch.compile`` is back once imported."""
    import torch

    if "bitsandbytes" in sys.modules:
        yield
        return
    original = torch.compile

    def lazy(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: lazy(fn, **kwargs)
        compiled: list[Any] = []

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(original(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    torch.compile = lazy  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original


def _spec(ns: argparse.Namespace) -> Any:
    from memfit.integrations.finetune import LoraSpec

    targets = tuple(t.strip() for t in ns.lora_targets.split(","))
    spec = LoraSpec(
        ns.lora_rank,
        ns.lora_alpha,
        targets,
        ns.lora_dropout,
        ns.base_dtype,
        ns.quant,
        quant_type=ns.quant_type,
        double_quant=ns.double_quant,
        compute_dtype=ns.compute_dtype,
        kbit_prep=ns.kbit_prep,
        int8_outliers=ns.int8_outliers,
        attn=ns.attn,
        autocast_adapter_dtype=ns.autocast_adapter_dtype,
    )
    spec.check()
    return spec


def _checked(ns: argparse.Namespace) -> tuple[Any, int, str]:
    """Every flag checked before any model is built: the LoRA spec, the budget, the sizes."""
    spec = _spec(ns)
    if ns.batch_size < 1 or ns.seq_len < 1:
        raise TargetError(f"--batch-size and --seq-len are positive, got {ns.batch_size} and {ns.seq_len}")
    if ns.grad_accum < 1:
        raise TargetError(f"--grad-accum takes a positive integer, got {ns.grad_accum}")
    if ns.multiple_of < 1:
        raise TargetError(f"--multiple-of takes a positive integer, got {ns.multiple_of}")
    if not Path(ns.config).exists() and ("/" in ns.config or ns.config.endswith(".json")):
        raise TargetError(
            f"{ns.config}: no such file (memfit downloads nothing): give a local config.json (or its folder), or a model "
            "type such as llama"
        )
    if ns.gpu is None and ns.capacity is None:
        ns.gpu = DEFAULT_GPU  # fake CUDA's own default: the question is always "on which GPU?"
    budget, label = read_budget(ns)
    return spec, budget, label


def run(ns: argparse.Namespace, console: Console) -> int:
    from memfit.report.console import status

    spec, budget, label = _checked(ns)
    try:
        from memfit.integrations.finetune import lora_session, lora_workload
    except ImportError as exc:
        raise TargetError(
            f"memfit finetune needs transformers and peft ({exc.name} is missing): pip install 'memfit[hf,peft]'"
        ) from exc
    # peft is imported while the model is built
    hidden = _without_bitsandbytes() if spec.quant == "none" else _compile_on_first_call()
    sizes = zoo.parse_sizes(ns.size)

    def build(layers: int | None = None) -> memfit.Workload:
        return lora_workload(
            ns.config,
            spec,
            batch_size=ns.batch_size,
            seq_len=ns.seq_len,
            sizes=sizes if layers is None else {**sizes, "num_hidden_layers": layers},
            checkpointing=ns.gradient_checkpointing,
            optim=ns.optim,
            accumulate=ns.grad_accum,
            autocast=ns.autocast,
        )

    with status(console, f"building {ns.config} on the meta device with peft's LoRA"), hidden:
        work = build()
    require_device(DEVICE)
    # Each fake session checks its light warm-up by collecting garbage and scanning every object
    # for its fake tensors (measure.profile.live_fake_storages): with torch, transformers, peft
    # and the model loaded, about 0.4 CPU s a scan, two a session. What exists now holds no
    # fake tensor, so it is moved out of the collector's sight (this process is the command's own).
    gc.collect()
    gc.freeze()
    try:
        # every question answered from fake steps of a few layers, the whole step's ledger
        # extrapolated and checked (else one fake copy of the whole step; read_budget set the GPU)
        with lora_session(work, rebuild=build) as session:
            return _answer(ns, work, session, budget, label, console)
    finally:
        gc.unfreeze()


def _answer(ns: argparse.Namespace, work: memfit.Workload, session: Any, budget: int, label: str, console: Console) -> int:
    from memfit.report.console import progress_bar, render_profile

    _, capacity = _gpu(ns)
    with progress_bar(console, f"profiling {work.name}") as progress:
        prof = session.profile(progress, capacity=capacity)
    render_profile(prof, console, title=work.name, top=4)
    out: dict[str, Any] = {"workload": work.name, "budget": label, "budget_bytes": budget, "profile": prof.to_dict(ledger=False)}
    paged = work.meta.get("paged_optimizer_state_bytes", 0)
    if ns.optim.startswith("paged_"):
        out["paged_optimizer_state_bytes"] = paged
        console.print(
            f"paged optimizer state ({ns.optim}): {memfit.format_bytes(paged)} in CUDA unified memory (cudaMallocManaged), "
            "outside the caching allocator, so not in the allocated or reserved peak above; the driver pages it to host "
            f"memory when the GPU runs short (state of parameters under {optim_min():,} elements is ordinary device memory, "
            "counted above)",
            highlight=False,
        )
    if "int8_outliers" in work.meta:
        out["int8_outliers_assumed"] = work.meta["int8_outliers"]
        console.print(
            f"assumed: {work.meta['int8_outliers']} outlier columns in each int8 matmul's input (LLM.int8 threshold 6.0; "
            "the count depends on the data; each one keeps a 16-bit column of the input for backward and adds a "
            "second output while its product is added: --int8-outliers N)",
            highlight=False,
        )
    fits = prof.budget_peak_bytes <= budget
    if ns.max:
        # the profile's own peak is the search's first size
        known = {ns.batch_size if ns.max == "batch" else ns.seq_len: prof.budget_peak_bytes}
        out["max"] = _largest(ns, work, session, budget, console, known)
    if not fits and not ns.no_levers:
        out["recipe"] = _levers(ns, work, session, budget, label, console)
    if hasattr(session, "words"):  # a LayeredSession: how the answers were made
        out["extrapolated"] = session.to_dict()
        console.print(session.words, highlight=False)
    if ns.json:
        Path(ns.json).write_text(json.dumps(out))
        console.print(f"wrote {ns.json}")
    return 0


def optim_min() -> int:
    from memfit.integrations.finetune import PAGED_MIN_NUMEL

    return PAGED_MIN_NUMEL


def _gpu(ns: argparse.Namespace) -> tuple[Any, int | None]:
    from memfit.cli.options import gpu_args

    return gpu_args(ns)


def _largest(
    ns: argparse.Namespace, work: memfit.Workload, session: Any, budget: int, console: Console, known: dict[int, int]
) -> dict[str, Any]:
    """``--max batch|seq``: the largest size whose step, as it is, fits; from exact fake-CUDA reserved peaks."""
    from memfit.integrations.finetune import largest_batch, largest_seq_len
    from memfit.report.console import progress_bar

    what = "batch" if ns.max == "batch" else "sequence length"
    with progress_bar(console, f"largest {what}") as progress:
        if ns.max == "batch":
            found = largest_batch(session, work, budget, multiple_of=ns.multiple_of, known=known)
        else:
            limit = getattr(work.model.config, "max_position_embeddings", None)
            found = largest_seq_len(session, work, budget, multiple_of=ns.multiple_of, progress=progress, limit=limit, known=known)
    at = f"at {ns.seq_len} tokens" if ns.max == "batch" else f"at batch {ns.batch_size}"
    if found.max_batch == 0:
        console.print(f"largest {what} {at} that fits {memfit.format_bytes(budget)}: [bold]none[/] (not even {ns.multiple_of})")
    else:
        console.print(
            f"largest {what} {at} that fits {memfit.format_bytes(budget)}: [bold]{found.max_batch}[/] (reserved peak "
            f"{memfit.format_bytes(found.peak_bytes)}; about {memfit.format_bytes(found.bytes_per_sample)} more per "
            f"{'sequence' if ns.max == 'batch' else 'token'}; {found.measurements} fake-CUDA steps)"
        )
    return {"what": ns.max, **found.to_dict()}


def _levers(
    ns: argparse.Namespace, work: memfit.Workload, session: Any, budget: int, label: str, console: Console
) -> dict[str, Any]:
    """The step does not fit: the cheapest levers that do, on fake CUDA (micro-batches, then a recompute plan)."""
    from memfit.integrations.finetune import levers_that_fit
    from memfit.report.console import progress_bar

    with progress_bar(console, "the levers that fit") as progress:
        found = levers_that_fit(session, work, budget, progress=progress)
    fmt = memfit.format_bytes
    for row in found["tried"]:
        console.print(f"  micro-batches x{row['micro_batches']}: reserved peak {fmt(row['peak_bytes'])}", highlight=False)
    if not found["fits"]:
        console.print(f"[bold red]no lever tried makes it fit {label}[/]: {found['why']}", highlight=False)
        return found
    k, batch = found["micro_batches"], ns.batch_size
    accumulate = f"micro-batches x{k} (per_device_train_batch_size={batch // k}, gradient_accumulation_steps={k})"
    plan = found.get("plan")
    if plan is None:
        console.print(f"[bold]fits with {accumulate}[/]: reserved peak {fmt(found['peak_bytes'])}", highlight=False)
        return found
    extra = plan.get("extra_compute_s")
    mods = sorted(plan["checkpointed"])
    console.print(
        f"[bold]fits with {accumulate if k > 1 else 'no micro-batches'} and a recompute plan of {len(mods)} modules[/]: "
        f"predicted reserved peak {fmt(found['peak_bytes'])}"
        + (f", extra compute about {extra * 1e3:.0f} ms a step (cost model)" if extra else ""),
        highlight=False,
    )
    for name in mods[:8]:
        console.print(f"  {name}  {plan['checkpointed'][name]['mode']}", highlight=False)
    if len(mods) > 8:
        console.print(f"  ... and {len(mods) - 8} more (--json has them all)", highlight=False)
    return found
