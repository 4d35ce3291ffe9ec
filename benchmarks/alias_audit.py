"""Audit: which op outputs share an input's storage on real tensors and not on memfit's fake
copies, or the other way around (issue 23 item 2).

    python benchmarks/alias_audit.py [--models gpt,bert-eager,...] [--modes train,no_grad,inference] [--all]
    MEMFIT_FAKE_CUDA=1 python benchmarks/alias_audit.py --fake-cuda      # fake side on fake cuda:0

Each model's step runs on real CPU tensors (memfit's real sandbox) and on fake copies (its fake
sandbox, as ``memfit.profile(fake=...)`` makes them), each under a dispatch mode that notes, for
every op call, whether each output's storage is a new one or an input's (which input). The two
op sequences are aligned by op name and compared call by call. Modes: ``train`` (forward,
backward, optimizer step), ``no_grad`` and ``inference`` (the model in eval mode, forward and loss
under ``torch.no_grad()`` / ``torch.inference_mode()``, as memfit's eval step).

With ``--recorder`` both sides are read as memfit's recorder books them (an output whose storage
the recorder files under an input's block counts as aliasing that input): what the ledgers see,
the columns that say whether memfit's fake ledger follows the real one.

The table printed: op, mode, real aliases?, fake aliases?, calls, models. Without ``--all`` only
the rows where real and fake disagree (and ops one side ran that the other did not).
"""

from __future__ import annotations

import os

if os.environ.get("MEMFIT_FAKE_CUDA") == "1":
    import memfit  # noqa: F401  (the fake CUDA shim must load before torch)

import argparse
import difflib
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit import zoo
from memfit.measure.sandbox import step_sandbox
from memfit.measure.step import eval_mode
from memfit.workload import Workload, call_loss, split_inputs

MODES = ("train", "no_grad", "inference")

# Small configurations of the zoo's models and of the test suite's models: what matters is
# which ops they dispatch, not their size.
_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128)
_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
ZOO: dict[str, Callable[[], Workload]] = {
    "gpt": lambda: zoo.build("gpt", 2, n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128),
    "mlp-deep": lambda: zoo.build("mlp-deep", 4, depth=3, width=32),
    "heavy": lambda: zoo.build("heavy", 2, n_ops=600, ops_per_block=300),
    "resnet": lambda: zoo.build("resnet", 2, image_size=32, base=8, depths=(1, 1, 1, 1)),
    "convnext": lambda: zoo.build("convnext", 2, pixels=32, dims=(8, 16), depths=(1, 1)),
    "resnext": lambda: zoo.build("resnext", 2, pixels=32, dims=(64, 128), depths=(1, 1)),
    "mobilenet": lambda: zoo.build("mobilenet", 2, pixels=32),
    "convmixer": lambda: zoo.build("convmixer", 2, pixels=32, dim=16, depth=2, kernel=3),
    "bert-eager": lambda: zoo.build("bert-base", 2, seq_len=16, attn_implementation="eager", **_BERT),
    "bert-sdpa": lambda: zoo.build("bert-base", 2, seq_len=16, attn_implementation="sdpa", **_BERT),
    "gpt2-eager": lambda: zoo.build("gpt2", 2, seq_len=16, attn_implementation="eager", **_GPT2),
    "gpt2-sdpa": lambda: zoo.build("gpt2", 2, seq_len=16, attn_implementation="sdpa", **_GPT2),
    "llama": lambda: zoo.build(
        "llama",
        2,
        seq_len=16,
        parallel="none",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
    ),
    "vit": lambda: zoo.build(
        "vit", 2, image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    ),
    "resnet152": lambda: zoo.build("resnet152", 2, image_size=32, depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 96, 128]),
}


def _test_models() -> dict[str, Callable[[], Workload]]:
    """The test suite's own models (tests/ on sys.path: they are defined in its modules)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import conftest
    import test_equivalence as eq
    import test_fit as fit
    import test_workspace as ws

    def square(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    def ident(out: torch.Tensor) -> torch.Tensor:
        return out

    def w(model: torch.nn.Module, inputs: Any, loss: Any = square, name: str = "") -> Callable[[], Workload]:
        return lambda: Workload(model, inputs, loss_fn=loss, name=name)

    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 16))
    return {
        "t:TinyNet": w(conftest.TinyNet(16), torch.randn(4, 16)),
        "t:TiedLM": w(eq.TiedLM(), (idx, torch.roll(idx, -1, dims=1)), ident),
        "t:NoGradNet": w(eq.NoGradNet(), torch.randn(4, 32)),
        "t:InPlaceNet": w(eq.InPlaceNet(), torch.randn(4, 32)),
        "t:ScalerNet": w(eq.ScalerNet(), torch.randn(4, 64)),
        "t:ActNet": w(fit.ActNet(2), (torch.randn(4, 64), torch.randn(4, 8)), ident),
        "t:ConvBN": w(fit.ConvBN(), torch.randn(4, 16, 8), ident),
        "t:ChannelsNorm": w(ws.ChannelsNorm(4), torch.randn(2, 4, 8, 8), ident),
    }


def _skip(func: Any) -> bool:
    """Tensors' questions about themselves (fake tensors dispatch them, real ones do not)."""
    return func.namespace == "prim" or func.overloadpacket.__name__.startswith("sym_")


def _tensors(values: Any) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _key(t: torch.Tensor) -> int | None:
    try:
        return id(t.untyped_storage()) if t.layout is torch.strided else None
    except (RuntimeError, NotImplementedError):
        return None


class AliasLog(TorchDispatchMode):
    """Notes each op call: (op, per output: ``"in<i>"``, the input whose storage it shares, or
    ``"new"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _skip(func):
            return out
        ins = [_key(t) for t in _tensors((*args, *kwargs.values()))]
        outs = _tensors(out if isinstance(out, (list, tuple)) else (out,))
        self.calls.append((str(func), tuple(_where(_key(t), ins) for t in outs)))
        return out


def _where(key: int | None, ins: list[int | None]) -> str:
    if key is None:
        return "-"
    return f"in{ins.index(key)}" if key in ins else "new"


class RecorderLog(AliasLog):
    """A side as memfit's recorder books it: an output whose storage the recorder counts as
    an input's block (``Recorder._block_of``) aliases that input."""

    def __init__(self, fake: bool) -> None:
        super().__init__()
        self.fake = fake

    def attach(self, box: Any) -> None:
        """Record ``box``'s step, what is alive at its start registered as memfit.profile does."""
        from memfit.measure.ledger import Category
        from memfit.measure.recorder import Recorder
        from memfit.measure.scope import Scope

        self.recorder = Recorder(Scope(box.model), count_flops=False, fake=self.fake)
        start = [*box.model.parameters(), *box.model.buffers(), *_tensors((*box.args, *box.kwargs.values()))]
        self.recorder.register_start(start, Category.OTHER)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = self.recorder
        in_tensors = _tensors((*args, *kwargs.values()))
        ins = [r._block_of(t) for t in in_tensors]  # the inputs' blocks before the op
        out = r.__torch_dispatch__(func, types, args, kwargs)
        if _skip(func):
            return out
        outs = _tensors(out if isinstance(out, (list, tuple)) else (out,))
        sigs = []
        for t, k in zip(outs, (_key(t) for t in outs)):
            b = None if k is None else r._block_of(t)
            sigs.append("-" if k is None else (f"in{ins.index(b)}" if b is not None and b in ins else "new"))
        self.calls.append((str(func), tuple(sigs)))
        return out


def run(work: Workload, mode: str, where: str | None, log: AliasLog) -> list[tuple[str, tuple[str, ...]]]:
    """The op calls of one step of ``work`` in ``mode``, on real tensors (``where`` None) or fake
    ones (``"same"``, ``"cuda"``)."""
    args, kwargs = split_inputs(work.inputs)
    opt = work.make_optimizer()
    with step_sandbox(where, work.model, args, kwargs, opt, targets=work.targets) as box, box.active():
        if isinstance(log, RecorderLog):
            log.attach(box)
        with log:
            if mode == "train":
                box.step(work.loss_fn)
            else:
                grad = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
                with eval_mode(box.model), grad:
                    call_loss(work.loss_fn, box.model(*box.args, **box.kwargs), box.targets)
    return log.calls


def _aliases(sigs: set[tuple[str, ...]]) -> str:
    """How a set of output patterns reads in the table: yes / no / sometimes."""
    flags = {any(s.startswith("in") for s in sig) for sig in sigs}
    return "yes" if flags == {True} else "no" if flags == {False} else "sometimes"


def compare(real: list, fake: list, rows: dict, model: str, mode: str) -> None:
    """Align the two call sequences by op name and tally each op's output patterns."""
    a, b = [c[0] for c in real], [c[0] for c in fake]
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            for (op, rs), (_, fs) in zip(real[i1:i2], fake[j1:j2]):
                row = rows[(op, mode)]
                row["real"].add(rs)
                row["fake"].add(fs)
                row["calls"] += 1
                row["models"].add(model)
                if rs != fs:
                    row["differ"] += 1
            continue
        for op, rs in real[i1:i2]:
            row = rows[(op, mode)]
            row["real"].add(rs)
            row["only_real"] += 1
            row["models"].add(model)
        for op, fs in fake[j1:j2]:
            row = rows[(op, mode)]
            row["fake"].add(fs)
            row["only_fake"] += 1
            row["models"].add(model)


def _new_row() -> dict:
    return {"real": set(), "fake": set(), "calls": 0, "differ": 0, "only_real": 0, "only_fake": 0, "models": set()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="", help="comma-separated (default: all of the zoo's and the tests')")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--fake-cuda", action="store_true", help="the fake side on fake cuda:0 (needs MEMFIT_FAKE_CUDA=1)")
    parser.add_argument("--recorder", action="store_true", help="the fake side as memfit's recorder books it")
    parser.add_argument("--all", action="store_true", help="every op, not only those where real and fake differ")
    ns = parser.parse_args()
    builders = {**ZOO, **_test_models()}
    names = [n for n in ns.models.split(",") if n] or list(builders)
    where = "cuda" if ns.fake_cuda else "same"
    rows: dict = defaultdict(_new_row)
    for name in names:
        for mode in ns.modes.split(","):
            try:
                real = run(builders[name](), mode, None, RecorderLog(False) if ns.recorder else AliasLog())
                fake = run(builders[name](), mode, where, RecorderLog(True) if ns.recorder else AliasLog())
            except Exception as exc:  # a model a mode cannot run: say so, go on
                print(f"# {name} {mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            compare(real, fake, rows, name, mode)
    side = f"fake{' cuda' if ns.fake_cuda else ''}"
    how = " (as the recorder books it)" if ns.recorder else ""
    print(f"| op | mode | real{how} aliases? | {side}{how} aliases? | calls | differ | only real/fake | models |")
    print("|---|---|---|---|---|---|---|---|")
    for (op, mode), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if not ns.all and not (row["differ"] or row["only_real"] or row["only_fake"]):
            continue
        real_a = _aliases(row["real"]) if row["real"] else "(not run)"
        fake_a = _aliases(row["fake"]) if row["fake"] else "(not run)"
        models = ",".join(sorted(row["models"]))
        print(
            f"| {op} | {mode} | {real_a} | {fake_a} | {row['calls']} | {row['differ']} | "
            f"{row['only_real']}/{row['only_fake']} | {models[:80]} |"
        )


if __name__ == "__main__":
    main()
