"""Run training steps for measurement without leaving a trace on the user's objects.

Real tensors: the steps run on the user's own model and optimizer (so memory is what
training would use, with no second copy on the device), after a snapshot to host memory
of everything a step changes: parameters, gradients, buffers (BatchNorm statistics),
optimizer state and the RNG. The snapshot is written back in place afterwards, whether
the steps succeeded or raised.

Fake tensors: a copy of the model whose parameters and buffers are fake tensors (no
memory), built with ``copy.deepcopy`` seeded with the fake replacements, plus an
optimizer of the same class and settings over them. The user's objects are never touched.

:class:`~memfit.measure.step.StepOptions` that change what the step runs on are applied
here: parameters in another dtype (real tensors: a cast copy, built the way the fake one
is, so the user's model keeps its dtype), the optimizer's ``foreach`` flag, the 8-bit
optimizer that stands in for the user's, gradients alive at the start (a loop with ``zero_grad(set_to_none=False)``), the GradScaler,
and the loop's name for the model's output (``holds_output``: a :class:`~memfit.measure.step.HeldOutput`
that keeps each step's output into the next, dropped when the sandbox closes).
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.compat import bnb4bit, bnb8bit, hf_fake, optim8bit, torch_compat, triton_fake
from memfit.cuda import fake as fake_cuda
from memfit.errors import WorkloadError
from memfit.measure.inputs import map_shared
from memfit.measure.ledger import Phase
from memfit.measure.scope import compiles
from memfit.measure.step import FakeGradScaler, HeldOutput, StepOptions, train_step
from memfit.workload import Where

__all__ = ["Sandbox", "real_sandbox", "fake_sandbox", "fake_device", "step_sandbox", "copy_model"]


@dataclass
class Sandbox:
    """What the measured steps run on."""

    model: nn.Module
    args: tuple
    kwargs: dict
    optimizer: torch.optim.Optimizer
    fake_mode: Any = None
    options: StepOptions = StepOptions()
    scaler: Any = None
    targets: Any = None
    # fake sandboxes: how real inputs and targets become this sandbox's tensors, so
    # :meth:`use_inputs` can run the same warm copy at another batch
    copy_inputs: Callable[[tuple, dict, Any], tuple[tuple, dict, Any]] | None = None
    held: HeldOutput | None = None
    """``StepOptions.holds_output``: the previous step's model output, alive into the next step."""

    def use_inputs(self, args: tuple, kwargs: dict, targets: Any = None) -> None:
        """Run the next steps on other (real) inputs, copied as the first ones were: a fake
        copy of the step warmed once can then be recorded at many batch sizes. An output held
        from the last step (of the other inputs) is dropped: a loop at these inputs holds one
        of their own, which the next recorded step makes first (:func:`~memfit.measure.profile.record_step`)."""
        if self.copy_inputs is None:
            raise TypeError("use_inputs is for fake sandboxes (a real one steps on the inputs it is given)")
        self.args, self.kwargs, self.targets = self.copy_inputs(args, kwargs, targets)
        if self.held is not None:
            self.held.clear()

    def step(self, loss_fn: Any, on_phase: Callable[[Phase], None] = lambda phase: None) -> float:
        """One training step on the sandbox's objects, as its options say (call it inside
        :meth:`active`)."""
        o = self.options
        return train_step(
            self.model,
            self.args,
            self.kwargs,
            loss_fn,
            self.optimizer,
            on_phase,
            micro_batches=o.micro_batches,
            accumulate=o.accumulate,
            loss_scale=o.loss_scale,
            autocast=o.autocast_dtype,
            scaler=self.scaler,
            set_to_none=o.set_to_none,
            inference=o.inference,
            offload=o.offload,
            targets=self.targets,
            held=self.held,
            drops_output=o.drops_output,
        )

    @contextmanager
    def active(self) -> Iterator[None]:
        """Enter the fake mode (if any) so factory calls inside the step make fake tensors, and
        let transformers find positions it made itself unpacked, as a real step does (it
        cannot read fake ones: :mod:`memfit.compat.hf_fake`). torch's log of a fake kernel
        that fails is dropped here: the error itself propagates, and memfit names it.
        bitsandbytes' int8 ops run as on CUDA (:func:`memfit.compat.bnb8bit.as_cuda_allocates`)."""
        if self.fake_mode is None:
            yield
        else:
            with (
                self.fake_mode,
                hf_fake.unpacked_positions(self.kwargs),
                torch_compat.quiet_fake_kernel_log(),
                bnb8bit.as_cuda_allocates(self.model),
                self._compiles(),
            ):
                yield

    @contextmanager
    def _compiles(self) -> Iterator[None]:
        """Modules the model compiled itself (torchtitan's blocks) compile on these fake
        tensors, their kernels not run (:func:`memfit.compat.triton_fake.compiles_on_fake`)."""
        if not compiles(self.model):
            yield
            return
        cuda = any(p.device.type == "cuda" for p in self.model.parameters())
        with triton_fake.compiles_on_fake(cuda):
            yield


_SCALARS = (int, float, bool, str, type(None))
_CONTAINERS = (list, dict, set)
_INTERNALS = frozenset(vars(nn.Module()))  # nn.Module's own dicts (parameters, hooks, ...)


def copy_model(model: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """``copy.deepcopy(model, memo)``, with the functions the model keeps as attributes bound
    to the copy. ``copy`` treats a function as an atom and hands back the same one, so a
    lambda stored on a module (minGPT's ``Block``: ``self.mlpf = lambda x:
    m.dropout(m.c_proj(m.act(m.c_fc(x))))`` with ``m = self.mlp``) would still call the
    original's submodules: the copy's step would run the user's own weights (real ones
    inside a fake copy, grads landing on the user's model) and never its own. A closure cell
    holding something the copy made a copy of is pointed at that copy; any other cell (a
    global-like object, a config) stays shared, as ``deepcopy`` shares functions."""
    memo = {} if memo is None else memo
    new = copy.deepcopy(model, memo)
    for module in new.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value.__closure__:
                vars(module)[name] = _rebound(value, memo)
    return new


def _rebound(fn: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
    cells = []
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name not yet assigned when the closure was made)
            cells.append(cell)
            continue
        cells.append(types.CellType(memo[id(contents)]) if id(contents) in memo else cell)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    new.__kwdefaults__, new.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    return new


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _prepare(box: Sandbox) -> Sandbox:
    """Apply the options that act on the objects: foreach flag, 8-bit optimizer,
    gradients alive at the start, the GradScaler. Called inside the sandbox, whose exit
    undoes them (the 8-bit optimizer is the box's own: the user's is not touched)."""
    o = box.options
    if o.optimizer_8bit:
        box.optimizer = optim8bit.eight_bit(box.optimizer)
        if box.fake_mode is not None:
            optim8bit.make_maps_fake(box.optimizer, box.fake_mode)
    elif box.fake_mode is not None and optim8bit.is_bitsandbytes(box.optimizer):
        # the user's own bitsandbytes optimizer (a paged one for QLoRA), copied over fake parameters
        optim8bit.make_maps_fake(box.optimizer, box.fake_mode)
        optim8bit.fake_paged_state(box.optimizer)
    if o.foreach is not None:
        for group in box.optimizer.param_groups:
            group["foreach"] = o.foreach
    with box.active():
        if not o.set_to_none:
            # zero_grad(set_to_none=False) keeps every gradient allocated between steps
            for p in box.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        if o.grad_scaler:
            device = _device(box.model)
            # A scale of 1: a step whose float16 gradients overflowed would skip the optimizer
            # (as the first steps of a real run do) and measure a step without it.
            scale = 1.0
            box.scaler = FakeGradScaler(device, scale) if box.fake_mode is not None else torch.amp.GradScaler(device.type, scale)
    if o.holds_output:
        box.held = HeldOutput()
    return box


@contextmanager
def _holding(box: Sandbox) -> Iterator[Sandbox]:
    """``box``, whose held output (if any) is dropped when the block ends: before the
    sandbox puts back what the steps changed, and whether they succeeded or raised."""
    try:
        yield box
    finally:
        if box.held is not None:
            box.held.clear()


@contextmanager
def real_sandbox(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    optimizer: torch.optim.Optimizer,
    *,
    step: StepOptions | None = None,
    targets: Any = None,
) -> Iterator[Sandbox]:
    """Steps on the user's own objects, restored afterwards; with ``step.param_dtype``, on
    a cast copy instead (the user's model is not touched)."""
    options = step or StepOptions()
    if options.param_dtype is not None:
        with _cast_sandbox(model, args, kwargs, optimizer, options, targets) as box:
            yield box
        return
    params = list(model.parameters())
    buffers = list(model.buffers())
    saved_params = [_to_host(p) for p in params]
    saved_grads = [p.grad for p in params]
    saved_buffers = [_to_host(b) for b in buffers]
    saved_state = {
        p: {k: (v, _to_host(v)) if isinstance(v, torch.Tensor) else (v, copy.deepcopy(v)) for k, v in st.items()}
        for p, st in optimizer.state.items()
    }
    saved_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    # Plain Python attributes a forward may bump (call counters, step flags).
    saved_attrs = [(m, {k: v for k, v in vars(m).items() if type(v) in _SCALARS}) for m in model.modules()]
    # And the contents of plain containers one may fill (a cache list, a memo dict): the
    # steps would otherwise leave their entries, and the tensors in them, behind.
    saved_items = [
        (v, copy.copy(v)) for m in model.modules() for k, v in vars(m).items() if type(v) in _CONTAINERS and k not in _INTERNALS
    ]
    for p in params:
        p.grad = None  # a steady-state step starts after zero_grad(set_to_none=True)
    try:
        with _holding(_prepare(Sandbox(model, args, kwargs, optimizer, options=options, targets=targets))) as box:
            yield box
    finally:
        with torch.no_grad():
            for p, v, g in zip(params, saved_params, saved_grads):
                p.copy_(v)
                p.grad = g
            for b, v in zip(buffers, saved_buffers):
                b.copy_(v)
        for p in list(optimizer.state):
            if p not in saved_state:
                del optimizer.state[p]
        for p, st in saved_state.items():
            current = optimizer.state[p]
            current.clear()
            for k, (obj, value) in st.items():
                if isinstance(obj, torch.Tensor):
                    with torch.no_grad():
                        obj.copy_(value)
                    current[k] = obj
                else:
                    current[k] = value
        for g, saved in zip(optimizer.param_groups, saved_groups):
            g.update(saved)
        for m, attrs in saved_attrs:
            m.__dict__.update(attrs)
        for obj, items in saved_items:
            obj.clear()
            if isinstance(obj, list):
                obj.extend(items)
            else:
                obj.update(items)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _copy_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tensor: Callable[[torch.Tensor], torch.Tensor],
    scalar: Callable[[torch.Tensor], torch.Tensor],
    uncast: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A copy of the model and optimizer (state included) whose tensors are ``tensor(t)``
    (0-dim optimizer state: ``scalar(t)``); tied parameters stay tied. (Inputs and targets
    are copied by the caller: the bf16 lever casts inputs, not what the loss compares with.)
    A 4-bit weight's quantization state and an 8-bit one's row scales are copied with
    ``uncast`` (default ``tensor``)."""
    memo: dict[int, Any] = {}
    copies: dict[nn.Parameter, nn.Parameter] = {}
    for p in model.parameters():
        cp = nn.Parameter(tensor(p.detach()), requires_grad=p.requires_grad)
        memo[id(p)] = copies[p] = cp
        bnb4bit.copy_param(p, cp, uncast or tensor, memo)  # a 4-bit weight's quantization state, never cast
    bnb8bit.copy_states(model, copies, uncast or tensor, memo)  # an 8-bit weight's row scales, never cast
    for b in model.buffers():
        memo[id(b)] = tensor(b)
    try:
        new_model = copy_model(model, memo)
    except Exception as exc:
        raise WorkloadError(f"cannot copy the model ({type(exc).__name__}: {exc})") from exc
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [copies[p] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    # ``defaults`` can hold entries the constructor does not take (AdamW's
    # decoupled_weight_decay); every group carries its full settings anyway.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        new_opt = type(optimizer)(groups, **defaults)
    except Exception as exc:
        raise WorkloadError(
            f"cannot rebuild {type(optimizer).__name__} over copied parameters from its defaults ({exc}); "
            "profile with real tensors instead"
        ) from exc
    for p, st in optimizer.state.items():
        new_opt.state[copies[p]] = {
            k: (scalar(v) if v.dim() == 0 else tensor(v)) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in st.items()
        }
    torch_compat.pin_optimizer_impl(new_opt, optimizer)
    return new_model, new_opt


def _caster(dtype: torch.dtype | None, base: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``base`` then, for floating-point tensors, a cast to ``dtype`` (as ``model.to(dtype)``
    and ``x.to(dtype)`` of the inputs would)."""
    if dtype is None:
        return base
    return lambda t: base(t).to(dtype) if t.is_floating_point() else base(t)


@contextmanager
def _cast_sandbox(
    model: nn.Module, args: tuple, kwargs: dict, optimizer: torch.optim.Optimizer, options: StepOptions, targets: Any
) -> Iterator[Sandbox]:
    """Real tensors, cast to ``options.param_dtype``, on a copy: the cast is lossy, so the
    user's own parameters could not be put back bitwise by casting again."""
    tensor = _caster(options.cast_dtype, lambda t: t.detach().clone())
    new_model, new_opt = _copy_step(model, optimizer, tensor, lambda t: t.detach().clone(), lambda t: t.detach().clone())
    new_args, new_kwargs = map_shared(tensor, (args, kwargs))  # inputs that share storage stay shared
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        with _holding(_prepare(Sandbox(new_model, new_args, new_kwargs, new_opt, options=options, targets=targets))) as box:
            yield box
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _fake_state(mode: Any, value: Any) -> Any:
    if value.numel() == 1 and value.dim() == 0:
        # Scalars such as Adam's `step` are read with .item(); a fake tensor made from a
        # Python number inside the mode keeps its value, one converted from a tensor does not.
        number = value.item()  # outside the mode, where the tensor is still real
        with mode:
            return torch.tensor(number, dtype=value.dtype, device=value.device)
    return mode.from_tensor(value)


def fake_device(fake: Any) -> Where:
    """What ``fake=`` asks for (:meth:`memfit.Where.of`), with fake CUDA
    (:mod:`memfit.cuda.fake`) switched on here or refused in one line."""
    where = Where.of(fake)
    if where is Where.FAKE_CUDA:
        fake_cuda.require()
    return where


def step_sandbox(
    where: Where,
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    optimizer: torch.optim.Optimizer,
    *,
    step: StepOptions | None = None,
    targets: Any = None,
) -> Any:
    """The sandbox for ``where``: the user's real tensors, fake ones on the model's device or
    on fake CUDA."""
    if where is Where.REAL:
        return real_sandbox(model, args, kwargs, optimizer, step=step, targets=targets)
    device = "cuda" if where is Where.FAKE_CUDA else None
    return fake_sandbox(model, args, kwargs, optimizer, step=step, targets=targets, device=device)


@contextmanager
def fake_sandbox(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    optimizer: torch.optim.Optimizer,
    *,
    step: StepOptions | None = None,
    targets: Any = None,
    device: str | None = None,
) -> Iterator[Sandbox]:
    """Fake copies of the step; with ``device="cuda"``, on fake ``cuda:0`` (the model on the
    CPU; fake CUDA on): optimizer scalars such as Adam's ``step`` stay on the host, as
    a CUDA step keeps them."""
    options = step or StepOptions()
    mode = torch_compat.new_fake_mode()
    dtype = options.cast_dtype
    to = torch.device("cuda", 0) if device == "cuda" else None

    def fake_target(t: torch.Tensor) -> torch.Tensor:
        ft = mode.from_tensor(t)
        if to is None:
            return ft
        with mode:
            return ft.to(to)

    def fake(t: torch.Tensor) -> torch.Tensor:
        ft = fake_target(t)
        if dtype is None or not t.is_floating_point():
            return ft
        with mode:
            return ft.to(dtype)

    def copy_inputs(a: tuple, k: dict, t: Any) -> tuple[tuple, dict, Any]:
        # Together, so that inputs and targets sharing storage (``labels=ids``) stay one
        # block, as in the real step: copied one by one to fake CUDA they would be two.
        a, k, t = map_shared(fake_target, (a, k, t))
        if dtype is not None:
            with mode:
                a, k = tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, (a, k))
        return a, k, t

    new_model, new_opt = _copy_step(model, optimizer, fake, lambda t: _fake_state(mode, t), fake_target)
    if to is not None:
        torch_compat.pin_cuda_optimizer_impl(new_opt, optimizer)
    new_args, new_kwargs, new_targets = copy_inputs(args, kwargs, targets)
    cpu_rng = torch.get_rng_state()
    try:
        box = Sandbox(new_model, new_args, new_kwargs, new_opt, mode, options=options, targets=new_targets)
        box.copy_inputs = copy_inputs
        with _holding(_prepare(box)):
            yield box
    finally:
        torch.set_rng_state(cpu_rng)  # fake dropout does not draw, but be sure
