"""The ``memfit`` command: a thin layer over the public API.

    memfit profile gpt                       # where the memory of a step goes
    memfit profile gpt --batch-size 64 --device fake   # a step too big for this machine
    memfit profile gpt --device fake-cuda    # the same step as a CUDA GPU runs it, on a CPU build of torch
    memfit profile path/to/train.py:workload --json profile.json
    memfit plan gpt --budget 50%             # what to recompute to fit a budget
    memfit plan gpt --budget 400MiB --json plan.json
    memfit fit gpt --budget 400MiB --allow amp,bf16   # the fastest memory levers that fit
    memfit fit llama --size preset=8b --world-size 8 --device fake --budget 40GiB   # per rank: recompute, reshard_after_forward
    memfit bench gpt --budgets 0.25,0.5,0.75 --plot bench.png --html bench.html --json bench.json
    memfit estimate llama --size num_hidden_layers=16 --batch-size 4 --seq-len 2048   # accelerate estimate-memory, activations included
    memfit finetune config.json --seq-len 2048 --lora-rank 16 --gpu A100-80GB --max batch   # a LoRA fine-tune on that GPU
    memfit snapshot memory_snapshot.pickle   # a GPU's recorded trace: peaks, and what other allocator settings would reserve
    memfit zoo                               # the built-in models
    memfit demo                              # end to end on the default model

Each command is a module of this package (``cli/profile.py``, ``cli/plan.py``, ...) with its
``add_parser`` and its ``run``; the flags several commands take are defined once in
``cli/options.py``, what their runs share is in ``cli/common.py``. Only :func:`main` reads the
process's command line, and only :func:`main` turns memfit's errors into their one line.

Errors memfit raises for bad input print as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

import memfit
from memfit.cli import bench, demo, estimate, finetune, fit, plan, profile, snapshot, zoo
from memfit.errors import MemfitError

__all__ = ["main", "build_parser"]

EXIT_ERROR = 2

COMMANDS = (profile, plan, fit, bench, snapshot, estimate, finetune, zoo, demo)
"""The commands' modules, in the order ``memfit --help`` and docs/cli.md list them."""

TRACEBACK_HELP = "on an error, print the whole traceback (your own setup code's included) instead of one line"


def build_parser() -> argparse.ArgumentParser:
    """The ``memfit`` command's parser: each command's from its module (tools/gen_cli_docs.py
    writes docs/cli.md from it)."""
    parser = argparse.ArgumentParser(prog="memfit", description="Fit a PyTorch training step in a memory budget.")
    parser.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    parser.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    # --traceback after the command too (where one adds it to a command that failed);
    # SUPPRESS keeps the command from resetting it when it was given before
    for p in sub.choices.values():
        p.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP)
    return parser


def _end_size_lists(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` with each KEY=VALUE after ``--size`` passed as ``--size=KEY=VALUE``, and the values
    without '=' that ended a --size list. argparse's ``nargs='+'`` would swallow the target after
    the sizes (``--size n_layer=2 gpt``); one value per ``--size=`` (``action='append'``) leaves
    it a positional."""
    out: list[str] = []
    ended: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--":  # the rest is positional
            return out + argv[i:], ended
        j = i + 1
        if argv[i] == "--size":
            while j < len(argv) and "=" in argv[j] and not argv[j].startswith("-"):
                j += 1
        if j == i + 1:  # not --size, or no KEY=VALUE after it: argparse's own reading (and error)
            out.append(argv[i])
            i = j
            continue
        out += [f"--size={item}" for item in argv[i + 1 : j]]
        if j < len(argv) and not argv[j].startswith("-"):
            ended.append(argv[j])
        i = j
    return out, ended


def main(argv: list[str] | None = None) -> int:
    from memfit.cuda import fake as fake_cuda

    if argv is None:  # this process's own command line: `--device fake-cuda` loads the shim before torch
        fake_cuda.relaunch_for_command(sys.orig_argv)
    parser = build_parser()
    args, ended = _end_size_lists(sys.argv[1:] if argv is None else list(argv))
    ns, extra = parser.parse_known_args(args)
    console = Console()
    err = Console(stderr=True)
    if extra:
        # a value without '=' after --size that was not needed as the target: a size typo
        bad = next((item for item in extra if item in ended), None)
        if bad is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        err.print(
            f"memfit: error: --size takes KEY=VALUE (e.g. n_layer=24), got {bad!r} (the target is given already)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_ERROR
    simulated = fake_cuda.gpu()  # --gpu sets it for this command, not for what the process does next
    try:
        return ns.func(ns, console)
    except MemfitError as exc:
        if ns.traceback:
            import traceback

            # the chain too: a TargetError's cause is the user's own code failing
            err.print("".join(traceback.format_exception(exc)), markup=False, highlight=False, soft_wrap=True, end="")
        err.print(f"memfit: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_ERROR
    finally:
        fake_cuda.set_gpu(simulated)
