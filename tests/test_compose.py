"""memfit composes with torch.compile, DDP and FSDP2: same numbers as without a plan, and
``memfit.apply``/``memfit.remove`` accept the wrapped model as well as the one inside."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import make_plan, train_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import memfit
from memfit import Choice
from memfit.plan.result import fingerprint


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    """Residual Linear-GELU-Linear blocks and a head: no BatchNorm, no Dropout, so compiled
    and eager runs draw no random numbers and differ only by floating-point rounding."""

    def __init__(self, width: int = 16, n_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n_blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


_plan = make_plan  # conftest's hand-made plan


# blocks.0 wholly recomputed, blocks.1 keeping its matmuls: both mechanisms.
MIXED = _plan(blocks__0=Choice("full"), blocks__1=Choice("selective", ("addmm",)))


def _instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, mod in model.named_modules() if "forward" in mod.__dict__]


def _checkpoint_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint)


# --------------------------------------------------------------------------- torch.compile


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_after_apply_matches_eager_without_a_plan(fresh_dynamo):
    torch.manual_seed(0)
    model, x = Net(width=32, n_blocks=2), torch.randn(256, 32)
    reference = copy.deepcopy(model)
    plan = memfit.plan(model, x, 0.0, loss_fn=_loss)
    assert plan.checkpointed, "a zero budget should recompute something in this model"
    # The real plan, with one block switched to selective recompute so both modes compile.
    plan = dataclasses.replace(plan, checkpointed={**plan.checkpointed, "blocks.1": Choice("selective", ("addmm",))})
    memfit.apply(model, plan)

    graphs: list[torch.fx.GraphModule] = []

    def inductor(gm, example_inputs):  # torch.compile's default backend, keeping dynamo's graph to inspect
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    compiled = torch.compile(model, backend=inductor)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(2):
        loss = _loss(compiled(x))
        loss.backward()
        expected = _loss(reference(x))
        expected.backward()
        # Inductor fuses the GELU and the bias adds into its own kernels and orders the float32
        # reductions its own way, so results differ by a few ulps (observed: 3e-8 on a loss
        # of 0.5, 1e-7 on gradients). rtol 1e-5 allows ~100 ulps; a recompute that lost or
        # doubled a contribution would be off by percent.
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7, msg=f"loss of step {step}")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}, step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert len(graphs) == 1, "no graph breaks, no recompiles"
    assert _checkpoint_nodes(graphs[0]) == len(plan.checkpointed), (
        "every chosen module is a checkpoint region in the compiled graph"
    )


def test_remove_and_apply_around_compile(fresh_dynamo):
    """On the module or on torch.compile's wrapper; dynamo recompiles to follow."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    reference = _loss(copy.deepcopy(model)(x))
    ran: list[int] = []  # which compiled graph each call ran

    def backend(gm, example_inputs):  # runs dynamo's graph as is: cheap, and bitwise eager
        index = len(graphs)
        graphs.append(gm)

        def run(*args):
            ran.append(index)
            return gm.forward(*args)

        return run

    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(model, backend=backend)

    def step() -> int:
        loss = _loss(compiled(x))
        loss.backward()
        assert torch.equal(loss, reference)
        return _checkpoint_nodes(graphs[ran[-1]])

    memfit.apply(model, MIXED)
    assert step() == 2
    memfit.remove(model)  # the module inside, after it was compiled
    assert _instance_forwards(model) == []
    assert step() == 0, "after remove the compiled model runs without checkpoints"

    assert memfit.apply(compiled, MIXED) is compiled  # the wrapper: goes on model
    assert sorted(_instance_forwards(model)) == ["blocks.0", "blocks.1"]
    assert step() == 2
    with pytest.raises(memfit.PlanError, match="already applied"):
        memfit.apply(model, MIXED)
    assert memfit.remove(compiled) is compiled
    assert _instance_forwards(model) == []
    assert step() == 0
    with pytest.raises(memfit.PlanError, match="nothing to remove"):
        memfit.remove(compiled)


def test_batchnorm_inside_a_compiled_checkpoint_updates_its_statistics_once(fresh_dynamo):
    """Under compile memfit leaves buffer handling to AOTAutograd, which functionalises the
    update, so the recompute does not repeat it (the eager path needs its buffer guard)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 1))
    x, reference = torch.randn(32, 16), copy.deepcopy(model)
    memfit.apply(model, _plan(**{"0": Choice("full"), "1": Choice("full"), "3": Choice("selective", ("addmm",))}))
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd without inductor's codegen: quick
    for _ in range(2):
        _loss(compiled(x)).backward()
        _loss(reference(x)).backward()
    assert int(model[1].num_batches_tracked) == 2
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var, rtol=1e-6, atol=1e-7)


def test_a_real_plan_applies_through_the_compile_wrapper(fresh_dynamo):
    """The plan's fingerprint is checked against the module inside, not the wrapper."""
    torch.manual_seed(0)
    model, x = Net(width=32), torch.randn(256, 32)
    plan = memfit.plan(model, x, 0.0, loss_fn=_loss)
    assert plan.fingerprint and plan.checkpointed
    compiled = torch.compile(model)
    memfit.apply(compiled, plan)
    assert sorted(_instance_forwards(model)) == sorted(plan.checkpointed)
    memfit.remove(compiled)
    assert _instance_forwards(model) == []
    # Planning the compiled wrapper plans the module inside (eagerly): the same plan.
    again = memfit.plan(compiled, x, 0.0, loss_fn=_loss)
    assert again.fingerprint == plan.fingerprint and again.checkpointed.keys() == plan.checkpointed.keys()


# --------------------------------------------------------------------------- DDP and FSDP2 on 2 CPU processes

WORLD = 2
TIMEOUT_S = 600  # a hung rank, not a slow host: at load 10 on 2 cores a DDP run took 122 s (its CPU: a few s)


def _spawn(worker, tmp_path: Path) -> list[dict]:
    """Run ``worker(rank, tmp_path)`` in WORLD processes; return what each wrote to rank<i>.json.

    Forked, not spawned: a spawned rank imports torch and this module again (about 5 CPU s
    each, most of these tests' cost) for a step of milliseconds; a forked one has them. Each
    rank still makes its own process group and leaves by ``os._exit`` (below)."""
    context = mp.start_processes(_run_then_exit, args=(worker, str(tmp_path)), nprocs=WORLD, join=False, start_method="fork")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"{worker.__name__} did not finish in {TIMEOUT_S} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _run_then_exit(rank: int, worker, tmp: str) -> None:
    worker(rank, tmp)
    # Leave without running C++ static destructors: at interpreter exit after a gloo process
    # group, torch 2.13 sometimes aborts ("terminate called without an active exception", no
    # Python frame left), ~1 run in 10 on 2 cores, after the worker wrote its results.
    # An exception from the worker still propagates (and fails the test) before this line.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)  # 2 processes on 2 cores
    # A file store rather than MASTER_ADDR/MASTER_PORT: no free port to race other tests for.
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)


def _finish() -> None:
    # Both ranks meet before either tears gloo down: a rank that destroys its process group
    # while its peer still holds the connection makes gloo abort ("terminate called without an
    # active exception"), which failed ~1 run in 10 on 2 cores.
    dist.barrier()
    dist.destroy_process_group()


def _train(model: nn.Module, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict, dict]:
    """An AdamW step per batch; returns the losses, the first step's gradients, the final parameters."""
    return train_ranks(model, xs, lambda m, x: _loss(m(x)))


def _differences(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


def _ddp_worker(rank: int, tmp: str) -> None:
    _init(rank, tmp)
    try:
        torch.manual_seed(0)
        base = Net()
        torch.manual_seed(100 + rank)  # each rank its own data
        xs = [torch.randn(8, 16) for _ in range(3)]
        reference = DistributedDataParallel(copy.deepcopy(base))
        inner = copy.deepcopy(base)
        memfit.apply(inner, MIXED)  # the natural order: plan the model, then wrap it
        planned = DistributedDataParallel(inner)
        ref_losses, ref_grads, ref_params = _train(reference, xs)
        losses, grads, params = _train(planned, xs)
        out = {
            "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
            "grads_differ": _differences(grads, ref_grads),
            "params_differ": _differences(params, ref_params),
        }
        # remove on the DDP wrapper reaches the module inside; apply after wrapping works too
        memfit.remove(planned)
        out["after_remove"] = _instance_forwards(inner)
        memfit.apply(planned, MIXED)
        out["after_apply_to_wrapper"] = sorted(_instance_forwards(inner))
        torch.manual_seed(200 + rank)
        more = [torch.randn(8, 16)]
        _, grads, params = _train(planned, more)  # both models start equal, with fresh optimizers
        _, ref_grads, ref_params = _train(reference, more)
        out["wrapped_then_applied_differ"] = _differences(grads, ref_grads) + _differences(params, ref_params)
        memfit.remove(inner)
        out["after_remove_inner"] = _instance_forwards(inner)
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        _finish()


@pytest.mark.slow
def test_ddp_gradients_are_bitwise_those_without_a_plan(tmp_path):
    results = _spawn(_ddp_worker, tmp_path)
    for rank, out in enumerate(results):
        assert out["losses_equal"], f"rank {rank}: losses differ"
        assert out["grads_differ"] == [], f"rank {rank}: first-step gradients differ"
        assert out["params_differ"] == [], f"rank {rank}: parameters after 3 steps differ"
        assert out["after_remove"] == [] and out["after_remove_inner"] == [], f"rank {rank}: remove left a forward"
        assert out["after_apply_to_wrapper"] == ["blocks.0", "blocks.1"]
        assert out["wrapped_then_applied_differ"] == [], f"rank {rank}: a plan applied after wrapping changed the step"


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _shard(model: Net) -> Net:
    fully_shard = _fully_shard()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _fsdp_worker(rank: int, tmp: str) -> None:
    _init(rank, tmp)
    try:
        torch.manual_seed(0)
        base = Net()
        torch.manual_seed(100 + rank)
        xs = [torch.randn(8, 16) for _ in range(2)]
        out: dict = {}
        try:  # FSDP2 itself, without memfit: if this fails, the test skips
            reference = _shard(copy.deepcopy(base))
            ref_losses, _, ref_params = _train(reference, xs)
        except Exception as exc:
            out["skip"] = (
                f"FSDP2 fully_shard does not run on CPU with gloo in torch {torch.__version__}: {type(exc).__name__}: {exc}"
            )
        else:
            planned = copy.deepcopy(base)
            # Shard, then apply a plan made on the unsharded model: fully_shard swaps each
            # module's class for a generated FSDP subclass, which the fingerprint sees through.
            _shard(planned)
            memfit.apply(planned, dataclasses.replace(MIXED, fingerprint=fingerprint(base), model_type=type(base).__name__))
            losses, _, params = _train(planned, xs)
            out["losses"] = [float(x) for x in losses]
            out["ref_losses"] = [float(x) for x in ref_losses]
            out["losses_equal"] = all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
            out["params_differ"] = _differences(params, ref_params)
            memfit.remove(planned)
            out["after_remove"] = _instance_forwards(planned)
            torch.manual_seed(200 + rank)
            more = [torch.randn(8, 16)]
            out["after_remove_equal"] = torch.equal(_train(planned, more)[0][0], _train(reference, more)[0][0])
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        _finish()


@pytest.mark.slow
def test_fsdp2_loss_is_that_without_a_plan(tmp_path):
    try:
        _fully_shard()
    except ImportError as exc:
        pytest.skip(f"no FSDP2 fully_shard in torch {torch.__version__}: {exc}")
    results = _spawn(_fsdp_worker, tmp_path)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    for rank, out in enumerate(results):
        assert out["losses_equal"], f"rank {rank}: losses {out['losses']} differ from {out['ref_losses']}"
        assert out["params_differ"] == [], f"rank {rank}: parameters after 2 steps differ"
        assert out["after_remove"] == [], f"rank {rank}: remove left a forward"
        assert out["after_remove_equal"], f"rank {rank}: the sharded model trains differently after remove"
