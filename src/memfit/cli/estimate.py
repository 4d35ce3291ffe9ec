"""``memfit estimate``: accelerate estimate-memory's numbers for a transformers config, beside
memfit's step peak with activations (on fake tensors)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from memfit import zoo
from memfit.cli.common import FAKE, require_device
from memfit.cli.options import batch_size_arg, device_arg, json_arg, size_arg
from memfit.errors import TargetError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "estimate",
        help="accelerate estimate-memory's numbers for a transformers config, beside memfit's step peak with activations",
    )
    p.add_argument(
        "config",
        help="a transformers model type (llama, gpt2, t5, ...: its config's default sizes) or a local config.json (or its "
        "folder); nothing is downloaded and no weights are made",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "float16", "int8", "int4"],
        choices=["float32", "float16", "bfloat16", "int8", "int4"],
        help="as accelerate estimate-memory's (default: float32 float16 int8 int4); memfit trains float16 / bfloat16 as "
        "mixed precision, and not int8 / int4",
    )
    batch_size_arg(p, "sequences in the step (default 1)", default=1)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    size_arg(p, "config override, e.g. num_hidden_layers=16")
    device_arg(
        p,
        "fake: fake CPU tensors; fake-cuda: fake tensors on a simulated CUDA GPU (CUDA's autocast and kernels)",
        choices=["fake", "fake-cuda"],
        default="fake",
    )
    json_arg(p, "also write the rows as JSON")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace, console: Console) -> int:
    from memfit.report.console import status
    from memfit.report.estimate import render_estimate

    require_device(ns.device)
    try:
        from memfit.integrations.accelerate import estimate_memory
    except ImportError as exc:
        raise TargetError(
            f"memfit estimate needs transformers and accelerate ({exc.name} is missing): pip install 'memfit[hf]'"
        ) from exc
    with status(console, f"building {ns.config} from its config and profiling on fake tensors"):
        est = estimate_memory(
            ns.config,
            dtypes=ns.dtypes,
            batch_size=ns.batch_size,
            seq_len=ns.seq_len,
            sizes=zoo.parse_sizes(ns.size),
            fake=FAKE[ns.device],
        )
    render_estimate(est, console)
    if ns.json:
        Path(ns.json).write_text(json.dumps(est.to_dict()))
        console.print(f"wrote {ns.json}")
    return 0
