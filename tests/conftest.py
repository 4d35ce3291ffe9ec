"""Shared fixtures: small models that make a step in milliseconds on a CPU, and helpers
that train a model with and without a plan and compare the results bitwise."""

from __future__ import annotations

import copy
import gc
import json
import os
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

import memfit
from memfit import Choice, Plan

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two xdist workers on a 2-core machine: one intra-op thread each (and in
    # the processes they start, through the environment), else OpenMP's threads of one worker
    # wait on a core the other holds and every step runs several times slower.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


_SLOW = Path(__file__).with_name("slow.txt")
"""The tests that take over 2 CPU seconds, one node id a line (`make test-fast` leaves them out;
`make slow-list` measures the suite and writes it again)."""


def _slow_tests() -> dict[str, float]:
    """slow.txt's tests and their CPU seconds: a node id a line, then a tab and the seconds
    (tools/slow_list.py writes them); a line without its seconds counts as the 2 s that made it slow."""
    out: dict[str, float] = {}
    for line in _SLOW.read_text().splitlines() if _SLOW.exists() else ():
        node, _, seconds = line.partition("\t")
        out[node] = float(seconds or 2.0)
    return out


def pytest_collection_modifyitems(config, items):
    """Marks the tests listed in slow.txt `slow`, and orders the test files by the CPU seconds of
    their slow tests, the most first.

    Under xdist, a module- or session-scoped fixture a test module defines (a real profile, a
    brute-force search) would be built once per worker that runs one of its tests: `make test`
    runs ``--dist loadfile``, each file on one worker, so it is built once, as without xdist.
    (Not ``--dist loadgroup`` with ``xdist_group`` marks: xdist 3.8 groups by a suffix it writes
    to ``item._nodeid``, which pytest 9.2 no longer reads, so every group was split over both
    workers and its fixture built twice.) The files are handed out in the order they are
    collected (``--no-loadscope-reorder``): the costly ones first, so that a long file does
    not start last and leave the other worker idle while it runs (by seconds, not by how many
    slow tests a file has: one 70 s test outweighs five of 3 s)."""
    slow = _slow_tests()
    groups: dict[str, list] = {}
    weight: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        weight[path] = weight.get(path, 0.0) + slow.get(item.nodeid, 0.0)
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
        info = getattr(item, "_fixtureinfo", None)
        for name in item.fixturenames if info else ():
            defs = info.name2fixturedefs.get(name) or ()
            if any(d.scope in ("module", "session") and d.baseid == path for d in defs):
                groups.setdefault(f"{path}::{name}", []).append(item)
                break
    for members in groups.values():
        # the fixture is built by whichever test runs first: if one of them is slow, all are
        if any(item.nodeid in slow for item in members):
            for item in members:
                item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])  # stable: each file's own order kept


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m timing`` (`make test`'s second run) only the files that name the mark are
    collected: a file that never writes ``mark.timing`` holds no such test, and importing the
    other fifty files again cost that run about as many CPU seconds as its tests' own."""
    if config.getoption("markexpr", "") != "timing" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.timing" not in collection_path.read_text(encoding="utf-8") or None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before each test (and its fixtures), garbage is collected and what survives is moved out
    of the collector's sight (``gc.freeze``), as ``memfit finetune`` does before its fake sessions.

    Why: each light fake session collects garbage and scans every object the collector tracks
    for its fake tensors (``measure.profile.live_fake_storages``, twice a session), and with
    torch, transformers and peft loaded that is ~500,000 objects and ~0.5 CPU s a scan, more
    than the whole step of a test's tiny model. Frozen, only what was made since is scanned.
    What a test measures is the same: a fake tensor is made by its own test (or a module
    fixture's session, whose frozen tensors both scans of the check leave out alike), the
    recorder disables the collector while it records, and a frozen object still alive is as
    alive as before; only a reference cycle that dies after its freeze is never collected."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Back in the collector's sight before the interpreter ends: frozen objects are never
    collected at shutdown, and Triton's nanobind extension (imported by torch's flop counter
    where Triton is installed, as ``make test`` installs it) then prints ~40 lines of "leaked
    instances" per process."""
    gc.unfreeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With MEMFIT_TEST_CPU=FILE, each test's CPU seconds (its process and the children it waited
    for) and wall seconds are appended to FILE: on a shared 2-core host wall times say more about
    the neighbours than about the test, CPU times do not (how the tiers were sized). Then the
    xdist worker that ran it and when it started (Unix time): which file ran where, and how
    long a worker sat idle at the end (``tools/test_timeline.py FILE``)."""
    out = os.environ.get("MEMFIT_TEST_CPU")
    if not out:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        shared = _CHILD_CPU["reported"] - _CHILD_CPU["reaped"]  # the fake-CUDA child's, not reaped yet
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + shared

    cpu0, wall0, start = cpu(), time.perf_counter(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(out, "a") as f:
        f.write(f"{cpu() - cpu0:.2f}\t{time.perf_counter() - wall0:.2f}\t{item.nodeid}\t{worker}\t{start:.2f}\n")


class LazyModule:
    """A module imported at its first attribute, for a test file's frameworks (peft, accelerate,
    bitsandbytes): every xdist worker and the `timing` run collect every file, and importing
    them at collection cost each of those processes seconds (peft alone about 3.5 CPU s) for files
    that run on one worker. ``needs`` skips the file at collection as ``importorskip`` did; an
    import that fails later, once a test touches the module, skips that test the same way."""

    def __init__(self, name: str, then: Callable[[Any], None] | None = None) -> None:
        self._name, self._then, self._module = name, then, None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_") and attr not in ("__file__", "__version__"):
            raise AttributeError(attr)  # what collection asks of every module global (__test__, ...)
        if self._module is None:
            self._module = pytest.importorskip(self._name)
            if self._then is not None:
                self._then(self._module)
        return getattr(self._module, attr)


def needs_fake_collectives() -> pytest.MarkDecorator:
    """Skip a test of a distributed step on the fake process group where torch has no fake
    kernels for c10d's collectives (torch 2.6; memfit refuses such a step in one line)."""
    from memfit.compat import torch_compat

    missing = torch_compat.fake_collectives_missing()
    return pytest.mark.skipif(missing is not None, reason=missing or "")


def skip_without_fake_collectives() -> None:
    """:func:`needs_fake_collectives` inside a test, for the parameters that need them."""
    from memfit.compat import torch_compat

    missing = torch_compat.fake_collectives_missing()
    if missing is not None:
        pytest.skip(missing)


def skip_without_torchtitans_torch() -> None:
    """torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.13
    has and 2.11 (and older) lacks: its targets cannot build there."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        pytest.skip(f"torchtitan 0.3.0 needs torch.distributed.fsdp.DataParallelMeshDims, which torch {torch.__version__} lacks", allow_module_level=True)


def needs(*names: str) -> pytest.MarkDecorator:
    """Skip a test file whose frameworks are not installed, without importing them (a
    dotted name is looked up from its top-level package's folder, not imported either)."""
    import importlib.util

    def found(name: str) -> bool:
        top, _, rest = name.partition(".")
        spec = importlib.util.find_spec(top)
        if spec is None or not rest:
            return spec is not None
        base = Path(next(iter(spec.submodule_search_locations or ()), ""))
        path = base.joinpath(*rest.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    missing = [n for n in names if not found(n)]
    return pytest.mark.skipif(bool(missing), reason=f"could not import {', '.join(missing)}")


class TinyNet(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear: buffers, RNG and saved tensors."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


@pytest.fixture
def tiny() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyNet(), torch.randn(32, 64)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Everything a training step could change, cloned, for bitwise comparison."""
    state = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "grad_ids": {n: id(p.grad) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
        "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
    }
    if optimizer is not None:
        state["opt"] = {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for i, st in enumerate(optimizer.state.values())
        }
        state["opt_keys"] = len(optimizer.state)
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if key in ("params", "buffers", "grads"):
            for n in x:
                if x[n] is None or y[n] is None:
                    assert x[n] is None and y[n] is None, n
                else:
                    assert torch.equal(x[n], y[n]), f"{key} {n} changed"
        elif key == "rng":
            assert torch.equal(x, y), "RNG state changed"
        elif key == "opt":
            assert x.keys() == y.keys()
            for i in x:
                assert x[i].keys() == y[i].keys()
                for k in x[i]:
                    if isinstance(x[i][k], torch.Tensor):
                        assert torch.equal(x[i][k], y[i][k]), f"optimizer state {k} changed"
                    else:
                        assert x[i][k] == y[i][k]
        else:
            assert x == y, key


# CLI arguments for a zoo gpt small enough that a command runs in seconds.
SMALL = [
    "--size",
    "n_layer=2",
    "--size",
    "n_embd=64",
    "--size",
    "n_head=4",
    "--size",
    "block_size=32",
    "--size",
    "vocab_size=512",
]


# -- training with and without a plan --------------------------------------------------------


def make_plan(**checkpointed: Choice) -> Plan:
    """A hand-made plan; ``a__b=Choice(...)`` names module ``a.b`` (``**{"": ...}`` the root)."""
    return Plan(
        budget_bytes=0,
        predicted_peak_bytes=0,
        start_bytes=0,
        none_peak_bytes=0,
        min_peak_bytes=0,
        checkpointed={k.replace("__", "."): v for k, v in checkpointed.items()},
        extra_compute_s=None,
        extra_flops=0,
        step_time_s=None,
    )


def train(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    steps: int,
    seed: int = 0,
    *,
    micro_batches: Sequence[Any] | None = None,
) -> tuple[dict, dict]:
    """``steps`` AdamW steps; returns the first step's gradients and the final state.

    With ``micro_batches`` (a list of inputs) each step accumulates the gradients of one
    forward and backward per micro-batch before the optimizer steps (``inputs`` unused)."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = [memfit.workload.split_inputs(b) for b in (micro_batches if micro_batches is not None else [inputs])]
    grads = None
    for i in range(steps):
        for args, kwargs in batches:
            loss_fn(model(*args, **kwargs)).backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "opt": [{k: v.clone() for k, v in st.items()} for st in opt.state.values()],
    }
    return grads, state


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank: a DTensor's shards gathered (FSDP2, tensor parallel), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_ranks(model: nn.Module, batches: Sequence[Any], loss_of: Callable[[nn.Module, Any], torch.Tensor]) -> tuple:
    """An AdamW step per batch on a rank of a distributed run; the losses, the first step's
    gradients and the final parameters, whole (see :func:`whole`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for i, batch in enumerate(batches):
        loss = loss_of(model, batch)
        loss.backward()
        losses.append(loss.detach())
        if i == 0:
            grads = {n: whole(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: whole(p.detach()).clone() for n, p in model.named_parameters()}


def rank_differences(got: tuple, ref: tuple) -> dict:
    """What differs between two :func:`train_ranks` runs, as JSON a rank writes for the test to read."""
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(got[0], ref[0])),
        "grads_differ": [n for n in ref[1] if not torch.equal(ref[1][n], got[1][n])],
        "params_differ": [n for n in ref[2] if not torch.equal(ref[2][n], got[2][n])],
    }


def assert_bitwise(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (ga, sa), (gb, sb) = a, b
    assert ga.keys() == gb.keys(), "different parameters got gradients"
    for n in ga:
        assert torch.equal(ga[n], gb[n]), f"gradient of {n} differs"
    for key in ("params", "buffers"):
        assert sa[key].keys() == sb[key].keys()
        for n in sa[key]:
            assert torch.equal(sa[key][n], sb[key][n]), f"{key} {n} differs"
    assert len(sa["opt"]) == len(sb["opt"]), "optimizer state of different parameters"
    for x, y in zip(sa["opt"], sb["opt"]):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), f"optimizer state {k} differs"


def assert_equivalent(
    model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor], plan: Plan, steps: int = 3, **train_kwargs: Any
) -> nn.Module:
    """Training a copy of ``model`` with ``plan`` applied ends bitwise where training
    ``model`` without it does: gradients, parameters, buffers and optimizer state.
    Returns the trained copy (``model`` itself is the reference, trained in place)."""
    planned = copy.deepcopy(model)
    reference = train(model, inputs, loss_fn, steps, **train_kwargs)
    memfit.apply(planned, plan)
    assert_bitwise(reference, train(planned, inputs, loss_fn, steps, **train_kwargs))
    return planned


@pytest.fixture(scope="session")
def shim_cache(tmp_path_factory) -> Path:
    """A cache holding the built fake-CUDA shim (built once per session, and under xdist once
    for all the workers: the first builds it while the others wait on a lock, then find it
    built); the tests that use it skip, saying why, where it cannot be built."""
    from memfit.cuda import fake as _fake_cuda

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's temporary root, which every worker's basetemp is under
    cache = root / "memfit-cache"
    cache.mkdir(exist_ok=True)
    with open(root / "memfit-cache.lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # not POSIX: each worker builds its own (build() replaces the file atomically)
            pass
        try:
            _fake_cuda.build(cache=cache)
        except _fake_cuda.FakeCudaError as exc:
            pytest.skip(f"fake CUDA unavailable here: {exc}")
    return cache


_FAKE_CUDA_CHILD = r"""
import contextlib, gc, io, json, os, resource, sys, traceback
reply = os.fdopen(os.dup(1), "w")  # the pipe to the test
os.dup2(2, 1)  # what writes to fd 1 itself (a process a command starts) goes to the log, not into the replies
import memfit  # MEMFIT_FAKE_CUDA=1: the shim loads here, before torch
from memfit.cli import main
os.environ.pop("MEMFIT_FAKE_CUDA")  # as the relaunched command does: what a command starts does not inherit it
for line in sys.stdin:
    request = json.loads(line)
    gc.collect()  # what is alive now is out of the collector's sight: see pytest_runtest_setup
    gc.freeze()
    saved = dict(os.environ)
    os.environ.update(request["env"])
    for key in request["unset"]:
        os.environ.pop(key, None)
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if "argv" in request:
                code = main(request["argv"])
            else:
                exec(compile(request["code"], "<script>", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:  # argparse's errors, and sys.exit in a script
            code = exc.code if isinstance(exc.code, int) or exc.code is None else (print(exc.code, file=sys.stderr) or 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    os.environ.clear()
    os.environ.update(saved)
    cpu = sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    reply.write(json.dumps({"returncode": code or 0, "stdout": out.getvalue(), "stderr": err.getvalue(), "cpu": cpu}) + "\n")
    reply.flush()
gc.unfreeze()  # see pytest_unconfigure
"""


_CHILD_CPU = {"reported": 0.0, "reaped": 0.0}
"""The CPU seconds the session's :class:`FakeCudaChild` reported after each request, and those
counted once it was reaped: MEMFIT_TEST_CPU gives each test the child's CPU for its requests,
not the whole child's to the test that happens to end the session."""


class FakeCudaChild:
    """One interpreter with the fake-CUDA shim loaded (``MEMFIT_FAKE_CUDA=1`` before torch), kept
    for the session: memfit commands (``memfit.cli.main(argv)``) and scripts run in it one
    after another, each with its own stdout, stderr, exit code and environment changes.

    Why: a fresh interpreter per fake-CUDA command costs two imports of torch and memfit
    (``python -m memfit ... --device fake-cuda`` imports them, then runs itself again with
    the shim) for a step of a few milliseconds. The tests of what a fresh process does (the
    relaunch, a shim that cannot be built, what ``import memfit`` reads) still start their own."""

    def __init__(self, cache: Path) -> None:
        import subprocess
        import sys

        src = str(Path(memfit.__file__).resolve().parents[1])
        env = {**os.environ, "MEMFIT_CACHE_DIR": str(cache), "PYTHONPATH": src, "MEMFIT_FAKE_CUDA": "1"}
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)  # memfit reads either name
        self._log = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _FAKE_CUDA_CHILD],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._cpu = 0.0

    def _ask(self, request: dict, timeout: float) -> Any:
        import select
        import subprocess

        request = {"env": {}, "unset": ["PYTORCH_CUDA_ALLOC_CONF"], **request}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self._proc.kill()
            self._log.seek(0)
            pytest.fail(f"the fake-CUDA child died or took over {timeout} s: {self._log.read()[-3000:]}")
        got = json.loads(line)
        _CHILD_CPU["reported"] += got["cpu"] - self._cpu
        self._cpu = got["cpu"]
        return subprocess.CompletedProcess(request.get("argv", "<script>"), got["returncode"], got["stdout"], got["stderr"])

    def cli(self, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 300) -> Any:
        """``memfit ARGV`` with ``env`` added to the environment (PYTORCH_CUDA_ALLOC_CONF unset
        unless given): a subprocess.CompletedProcess."""
        unset = [] if env and "PYTORCH_CUDA_ALLOC_CONF" in env else ["PYTORCH_CUDA_ALLOC_CONF"]
        return self._ask({"argv": list(argv), "env": env or {}, "unset": unset}, timeout)

    def script(self, code: str, timeout: float = 300) -> Any:
        """``code`` run as a program's ``__main__`` (its own globals): a subprocess.CompletedProcess."""
        return self._ask({"code": code}, timeout)

    def close(self) -> None:
        self._proc.stdin.close()
        _, status, usage = os.wait4(self._proc.pid, 0)  # its exact CPU: what RUSAGE_CHILDREN now counts
        self._proc.returncode = os.waitstatus_to_exitcode(status)
        self._log.close()
        cpu = usage.ru_utime + usage.ru_stime
        _CHILD_CPU["reported"] += cpu - self._cpu
        _CHILD_CPU["reaped"] += cpu


@pytest.fixture(scope="session")
def fake_cuda(shim_cache) -> Any:
    """The session's :class:`FakeCudaChild`."""
    child = FakeCudaChild(shim_cache)
    yield child
    child.close()


# -- real multi-process gloo runs -------------------------------------------------------------


def gloo_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a real gloo process group of
    ``world_size`` processes on this CPU; what each rank returned (JSON data). Forked: the
    functions and models are the tests' own modules', which a spawned child could not import."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.start_processes(_gloo_rank, args=(world_size, port, out, fn, args), nprocs=world_size, join=True, start_method="fork")
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world_size)]


def _gloo_rank(rank: int, world_size: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        Path(f"{out}.{rank}").write_text(json.dumps(fn(rank, world_size, *args)))
    finally:
        dist.barrier()
        dist.destroy_process_group()


T = TypeVar("T")


def settled(
    run: Callable[[], list[T]], peak: Callable[[T], int], predicted: Sequence[int], slack: int = 0, tries: int = 3
) -> list[T]:
    """Each rank's lowest-peak result of up to ``tries`` real gloo runs (``run()``: one result
    per rank), stopping once no rank's peak exceeds its prediction by more than ``slack``.

    Why more than one run: gloo lets go of a finished collective's buffer around the next
    collective call, and now and then it is still alive at the next allocation; a real
    peak can then hold one extra all-gather buffer (seen once in CI: +31,475 B on a Llama
    step; 5 of 20 runs here had one rank 1-4% high, docs/benchmarks/distributed.md). That only ever raises a
    real peak, so the lowest of a few runs is the step's own, and a prediction that is wrong
    stays wrong in every run."""
    best: list[T] = []
    for _ in range(tries):
        results = run()
        best = results if not best else [min(a, b, key=peak) for a, b in zip(best, results)]
        if all(peak(b) - p <= slack for b, p in zip(best, predicted)):
            break
    return best


# A 2-layer Llama config.json of the fine-tune tests (QLoRA, LLM.int8): small enough for real
# bitsandbytes kernels on the CPU, GQA and untied embeddings as the 7-8B configs have them.
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def tiny_llama_inputs(batch: int, seq: int) -> dict:
    """A fine-tune's batch for :data:`TINY_LLAMA_CONFIG`: token ids, and the same as labels."""
    ids = torch.randint(0, TINY_LLAMA_CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def adapter_adamw(model: nn.Module) -> torch.optim.AdamW:
    """AdamW over the parameters that train (a LoRA model's adapters)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def most_alive(ledger: Any, category: Any, under: str = "") -> int:
    """The most bytes of ``category`` made under module ``under`` alive at once over the step
    (pipeline tests: the microbatches' activations a stage holds)."""
    from memfit.measure.ledger import START_TICK

    events = []
    for b in ledger.blocks:
        if b.category is category and (b.module or "").startswith(under):
            events.append((b.born if b.born != START_TICK else -1, b.nbytes))
            if b.died is not None:
                events.append((b.died, -b.nbytes))
    live = most = 0
    for _, n in sorted(events, key=lambda e: (e[0], e[1])):  # frees first at a tick
        live += n
        most = max(most, live)
    return most

