"""A workload is what one training step needs: model, example inputs, loss, optimizer.

The base the rest builds on (the zoo's models are workloads): it imports nothing of memfit
but its errors. Naming one by a TARGET (a zoo name or a file's function) is
:mod:`memfit.target`.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.errors import LossError, MemfitError, WorkloadError

__all__ = [
    "Workload",
    "LayerStack",
    "Where",
    "Parallel",
    "split_inputs",
    "join_inputs",
    "batch_size_of",
    "split_micro_batches",
    "split_batch",
    "resize_batch",
    "resize_targets",
    "default_loss",
    "call_loss",
    "check_loss",
    "default_optimizer",
    "check_arguments",
    "check_optimizer",
    "check_loss_targets",
    "check_not_meta",
    "model_device",
    "Ranks",
    "asked_ranks",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

Ranks = Sequence[int] | str
"""The ranks to answer for: integers (``(0, 3)``) or ``"all"``."""


def asked_ranks(ranks: Ranks | None, n: int | None, *, name: str = "ranks", from_last: bool = False) -> list[int]:
    """The ranks asked for, in the order given, each once: the one reading of ``ranks`` (the
    Python API's ``ranks=``, the CLI's ``--ranks``, ``--min-world-size``'s). None: rank 0.
    ``from_last``: negative ranks count from the last (``-1``, the last rank at every world
    size a search tries), and ranks past a world of ``n`` are left out, not refused. With ``n``
    None only the spelling is checked (a search, before it knows its world sizes)."""
    if ranks is None:
        return [0]
    if ranks == "all":
        return list(range(n or 1))
    listed = list(dict.fromkeys(ranks)) if not isinstance(ranks, str) else []
    typed = [r for r in listed if isinstance(r, bool) or not isinstance(r, int)]
    if typed or not listed:
        how = "integers (0, -1: the first and the last)" if from_last else "integers"
        raise WorkloadError(f"{name} must be {how} or 'all', got {typed[0] if typed else ranks!r}")
    if n is None:
        return listed
    if from_last:
        return list(dict.fromkeys(r % n for r in listed if -n <= r < n)) or [0]
    bad = [r for r in listed if not 0 <= r < n]
    if bad:
        raise WorkloadError(f"{name}: {bad[0]} is not a rank of a world of {n}; give 0 to {n - 1} or 'all'")
    return listed


class Where(enum.Enum):
    """Which tensors a step runs on: the user's own (``REAL``), fake ones on the model's device
    (``FAKE``: FakeTensorMode, shapes and bytes but no data or memory), or fake ones on a
    simulated GPU (``FAKE_CUDA``: :mod:`memfit.cuda.fake`, the model staying on the CPU).

    Read once where a step comes in (:meth:`of`, from the ``fake=`` people pass: ``False``,
    ``True``/``"cpu"`` or ``"cuda"``); everything below takes a ``Where``."""

    REAL = "real"
    FAKE = "fake"
    FAKE_CUDA = "fake-cuda"

    @property
    def fake(self) -> bool:
        return self is not Where.REAL

    @property
    def cuda(self) -> bool:
        """Fake CUDA (a real CUDA step is :attr:`REAL` on a CUDA model)."""
        return self is Where.FAKE_CUDA

    @classmethod
    def of(cls, fake: object) -> Where:
        """``fake=`` as the public functions take it, or a ``Where`` (returned as it is)."""
        if isinstance(fake, Where):
            return fake
        if fake is False or fake is None:
            return Where.REAL
        if fake is True:
            return Where.FAKE
        if isinstance(fake, str) and fake in _SPELLINGS:  # its value ("fake-cuda", as --device says it) too
            return _SPELLINGS[fake]
        raise WorkloadError(
            f"fake takes False (real tensors), True or 'cpu' (fake tensors on the model's device), 'cuda' (fake CUDA) "
            f"or a memfit.Where, got {fake!r}"
        )


_SPELLINGS = {"cpu": Where.FAKE, "cuda": Where.FAKE_CUDA, **{w.value: w for w in Where}}


@dataclass(frozen=True)
class Parallel:
    """How a training step is parallelized over ranks, in torchtitan's style: the workload's
    model (built on the meta device, so that no full-size tensor is ever made) is given to
    ``parallelize(model, mesh)`` on each rank, which applies ``fully_shard``, DDP, ... and
    returns the module to train (or None: the model, changed in place). Whatever is still
    on meta afterwards is materialised on the rank's device with ``to_empty`` (DDP, which
    needs real parameters for its buckets, materialises first: see
    :func:`memfit.measure.distributed.ddp`). The workload's inputs are one rank's batch."""

    parallelize: Callable[[nn.Module, Any], nn.Module | None]
    world_size: int | None = None
    """Ranks; None: given when measuring (``--world-size``)."""
    mesh_shape: tuple[int, ...] | None = None
    """The device mesh's shape (its product is the world size); None: one dimension of all ranks.
    One dimension may be -1: whatever the world size leaves for it (``(-1, 2)``: data parallel
    over the ranks that 2-way tensor parallelism leaves, as torchtitan's ``dp_shard=-1``)."""
    mesh_dim_names: tuple[str, ...] | None = None
    name: str = "parallel"
    """How reports name the scheme (``fsdp2``, ``ddp``)."""

    def __post_init__(self) -> None:
        if not callable(self.parallelize):
            raise WorkloadError(
                f"Parallel.parallelize must be a function (model, mesh) -> model, got {type(self.parallelize).__name__}"
            )
        if self.world_size is not None:
            self.mesh(self.world_size)

    def mesh(self, world_size: int | None = None) -> tuple[int, ...]:
        """The mesh shape for ``world_size`` ranks (default this spec's), checked."""
        n = self.world_size if world_size is None else world_size
        if n is None:
            raise WorkloadError(f"{self.name}: no world size: give one (--world-size N, world_size=N)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WorkloadError(f"the world size must be a positive integer, got {n!r}")
        shape = self.mesh_shape or (n,)
        product = 1
        for d in shape:
            product *= d if d != -1 else 1
        if -1 in shape:
            if shape.count(-1) > 1 or product < 1 or n % product:
                raise WorkloadError(
                    f"the device mesh {'x'.join(map(str, shape))} needs one -1 dimension (it takes the ranks the others "
                    f"leave) and a world size that is a multiple of {product}, got {n}"
                )
            shape = tuple(n // product if d == -1 else d for d in shape)
            product = n
        if product != n:
            raise WorkloadError(
                f"the device mesh {'x'.join(map(str, shape))} holds {product} ranks but the world size is {n}; "
                f"give a mesh whose dimensions multiply to {n}"
            )
        if self.mesh_dim_names is not None and len(self.mesh_dim_names) != len(shape):
            raise WorkloadError(
                f"mesh_dim_names {self.mesh_dim_names} name {len(self.mesh_dim_names)} dimensions, the mesh has {len(shape)}"
            )
        return tuple(shape)


@dataclass(frozen=True)
class LayerStack:
    """A model's repeated identical layers, by which a step of the whole model can be measured
    from steps of the same model built with fewer of them (:mod:`memfit.measure.rank_layers`:
    extrapolated, and checked, or not used)."""

    prefix: str
    """The layer list's qualified name and a dot (``model.layers.``)."""
    count: int
    """How many layers the model has."""
    rebuild: Callable[[int], nn.Module]
    """The same model with ``n`` layers (on meta or on the CPU: only its structure is used)."""


@dataclass
class Workload:
    """Model + example inputs + loss function + optimizer factory."""

    model: nn.Module
    inputs: Any
    """What the model is called with: a tensor, a tuple of positional arguments, or a dict
    of keyword arguments."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """``loss_fn(output)`` -> scalar, or with ``targets``, ``loss_fn(output, targets)``;
    ``None`` uses :func:`default_loss`."""
    optimizer: OptimizerFactory | None = None
    """``optimizer(params)`` -> optimizer; ``None`` uses :func:`default_optimizer`."""
    name: str = "workload"
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form description (sizes, batch) shown by reports."""
    targets: Any = None
    """What the loss compares the output with (a tensor, or a tuple or dict of them), never
    given to the model; cut into micro-batches with the inputs (see :func:`split_batch`)."""
    parallel: Parallel | None = None
    """How the step is parallelized over ranks (:class:`Parallel`), measured per rank by
    :func:`memfit.measure.distributed.profile_ranks`; None: one process."""
    plan_root: str = ""
    """The submodule of :attr:`model` that the training script holds as its model, where a
    target wraps it to run its loss in ``forward`` (torchtitan's job: ``"model"``). Plans are
    made and verified on the whole; the ones handed to the user name modules relative to this
    one and carry its fingerprint (:meth:`memfit.Plan.under`). ``""``: the model itself."""

    layers: LayerStack | None = None
    """The model's identical layers and how to build it with fewer (:class:`LayerStack`):
    where given, per-rank steps may be measured from 2, 3 and 4 layers, extrapolated and
    checked (:mod:`memfit.measure.rank_layers`). A copy with another model must drop it."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise WorkloadError(f"Workload.model must be a torch.nn.Module, got {type(self.model).__name__}")
        split_inputs(self.inputs)
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise WorkloadError(f"Workload.loss_fn must be callable, got {type(self.loss_fn).__name__}")
        check_loss_targets(self.loss_fn, self.targets)
        if self.optimizer is not None and not callable(self.optimizer):
            raise WorkloadError(f"Workload.optimizer must be a factory params -> optimizer, got {type(self.optimizer).__name__}")
        if not isinstance(self.plan_root, str):
            raise WorkloadError(f"Workload.plan_root must be a module name (str), got {type(self.plan_root).__name__}")
        if self.plan_root:
            try:
                self.model.get_submodule(self.plan_root)
            except AttributeError:
                raise WorkloadError(f"Workload.plan_root {self.plan_root!r} names no submodule of the model") from None
        if self.parallel is not None and not isinstance(self.parallel, Parallel):
            raise WorkloadError(f"Workload.parallel must be a memfit.Parallel, got {type(self.parallel).__name__}")

    def make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = (self.optimizer or default_optimizer)(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise WorkloadError(f"Workload.optimizer returned {type(opt).__name__}; expected a torch.optim.Optimizer")
        return opt


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with torch's defaults: the optimizer most training runs use."""
    return torch.optim.AdamW(params, lr=1e-4)


def check_arguments(model: Any, optimizer: Any, loss_fn: Any, targets: Any = None) -> None:
    """Refuse arguments of the wrong kind before anything runs (profile, plan, fit)."""
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise WorkloadError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise WorkloadError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    check_loss_targets(loss_fn, targets)
    if optimizer is not None:
        check_optimizer(model, optimizer)


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must step the model's parameters and nothing else: memfit restores
    (and copies to fake tensors) the model's parameters only. Stepping part of the model
    (a head being fine-tuned) is fine."""
    own = {id(p) for p in model.parameters()}
    held = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    name = type(optimizer).__name__
    if held and not own & held.keys():
        raise WorkloadError(
            f"the optimizer ({name}) holds none of the model's parameters: it was built over another model's (or a "
            "copy's); build it over this model's, e.g. torch.optim.AdamW(model.parameters())"
        )
    foreign = [p for i, p in held.items() if i not in own]
    if foreign:
        n = len(foreign)
        raise WorkloadError(
            f"the optimizer ({name}) holds {n} tensor{'s' if n != 1 else ''} that {'are' if n != 1 else 'is'} not "
            f"{'parameters' if n != 1 else 'a parameter'} of the model (shape {tuple(foreign[0].shape)}): memfit restores "
            "and copies the model's parameters only; register it on a module of the model (a learnable loss "
            "temperature, say) or leave it out of the optimizer"
        )


def model_device(model: nn.Module) -> torch.device:
    """The one device of the model's parameters and buffers (cpu if it has none). Refuses
    a model on several devices (memfit measures and bounds one device's memory, and a part
    left on meta has no data) and a model on meta."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    device = tensors[0][1].device if tensors else torch.device("cpu")
    for name, t in tensors:
        if t.device != device:
            raise WorkloadError(
                f"the model is on more than one device: {tensors[0][0]!r} is on {device} but {name!r} is on {t.device}; "
                "move the whole model to one device"
            )
    if device.type == "meta":
        raise WorkloadError(
            "the model is on the meta device, which holds no data: memfit runs the step on the model's device, and "
            "fake tensors are copies of real ones; build the model on a real device, or materialize it with "
            "model.to_empty(device='cpu') and initialise its weights, then pass fake=True (--device fake) to measure "
            "a step that would not fit in memory"
        )
    return device


def check_not_meta(model: nn.Module, inputs: Any, targets: Any = None) -> torch.device:
    """Refuse a model (see :func:`model_device`), inputs or targets on the meta device
    before anything is moved or run (moving a meta tensor fails inside torch). Returns
    the model's device."""
    from torch.utils._pytree import tree_flatten

    device = model_device(model)
    for what, tree in (("an input is", inputs), ("the targets are", targets)):
        leaves, _ = tree_flatten(tree)
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves):
            raise WorkloadError(
                f"{what} on meta but the model is on {device}; meta tensors hold no data: make them on {device} "
                "(fake=True, --device fake, measures without using memory)"
            )
    return device


def _describe(fn: Any) -> str:
    """A callable as a user would name it: ``my_loss``, ``<lambda>``, ``CrossEntropyLoss``."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_describe(fn.func)})"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def _accepts(fn: Any, n: int) -> bool | None:
    """Whether ``fn`` can be called with ``n`` positional arguments; None when its
    signature cannot be read (a builtin such as ``torch.sum``)."""
    target = fn.forward if isinstance(fn, nn.Module) else fn  # a Module's own signature is (*args, **kwargs)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*range(n))
    except TypeError:
        return False
    return True


def check_loss_targets(loss_fn: Any, targets: Any) -> None:
    """With targets, the loss is called ``loss_fn(output, targets)``; without,
    ``loss_fn(output)``. Refuse a loss whose signature says the other form."""
    if targets is None:
        if loss_fn is not None and _accepts(loss_fn, 1) is False and _accepts(loss_fn, 2):
            raise WorkloadError(
                "loss_fn takes (output, targets) but no targets were given: pass targets= (what the loss compares the "
                "output with; memfit cuts them into micro-batches with the inputs), or make it loss_fn(output)"
            )
        return
    if loss_fn is None:
        raise WorkloadError("targets were given but no loss_fn to compare the output with them: pass loss_fn(output, targets)")
    if _accepts(loss_fn, 2) is False:
        raise WorkloadError(
            f"loss_fn takes one argument (output) but targets were given: make it loss_fn(output, targets), "
            f"or leave targets out (got {_describe(loss_fn)})"
        )


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """Inputs as ``(args, kwargs)``: a tensor is one argument, a tuple or list the
    positional arguments, a dict the keyword arguments."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise WorkloadError(f"keyword inputs must have string keys, got {bad[0]!r}")
        return (), dict(inputs)
    raise WorkloadError(
        f"inputs must be a tensor, a tuple of positional arguments or a dict of keyword arguments, got {type(inputs).__name__}"
    )


def join_inputs(args: tuple, kwargs: dict) -> Any:
    """The inverse of :func:`split_inputs` for what it returns: a tuple of positional
    arguments, or a dict of keyword arguments."""
    if kwargs and args:
        raise WorkloadError("inputs are either positional arguments or keyword arguments, not both")
    return dict(kwargs) if kwargs else tuple(args)


def batch_size_of(args: tuple, kwargs: dict) -> int | None:
    """The batch size: dim 0 of the first tensor input with at least one dimension
    (positional before keyword, in order), or None if there is none."""
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten((args, kwargs))
    return next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 1), None)


def split_micro_batches(args: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    """``k`` micro-batches of the inputs: every tensor whose dim 0 is the batch size is
    cut into ``k`` equal slices along it (views: no copy); anything else is passed whole
    to every micro-batch (a mask of another shape, a flag)."""
    return [(a, kw) for a, kw, _ in split_batch(args, kwargs, None, k)]


def split_batch(args: tuple, kwargs: dict, targets: Any, k: int) -> list[tuple[tuple, dict, Any]]:
    """:func:`split_micro_batches` with the targets: every tensor in them whose dim 0 is
    the inputs' batch size is cut alike, so micro-batch ``i`` gets the targets of its samples."""
    from torch.utils._pytree import tree_map

    if k == 1:
        return [(args, kwargs, targets)]
    batch = batch_size_of(args, kwargs)
    if batch is None:
        raise WorkloadError("no input tensor has a batch dimension to split into micro-batches")
    if k < 1 or batch % k:
        raise WorkloadError(f"a batch of {batch} does not split into {k} equal micro-batches")
    size = batch // k

    def part(i: int) -> Callable[[Any], Any]:
        return lambda t: (
            t[i * size : (i + 1) * size] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == batch else t
        )

    return [(*tree_map(part(i), (args, kwargs)), tree_map(part(i), targets)) for i in range(k)]


def call_loss(loss_fn: Callable[..., Any] | None, output: Any, targets: Any = None) -> Any:
    """The step's loss: ``loss_fn(output, targets)`` with targets, ``loss_fn(output)``
    without, :func:`default_loss` without a loss_fn. An exception the loss function
    raises becomes a LossError naming it (not the model's forward, which is done)."""
    if loss_fn is None:
        return default_loss(output)
    try:
        return loss_fn(output) if targets is None else loss_fn(output, targets)
    except (MemfitError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise LossError(f"the loss function {_describe(loss_fn)} raised {type(exc).__name__}: {first}") from exc


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` (or ``output["loss"]``) when there is one, else the sum of the
    output's floating-point tensor. An output of several (``(logits, loss)``) is refused:
    which of them is the loss is the user's to say."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.sum()
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(output if not hasattr(output, "__dataclass_fields__") else vars(output))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise LossError(f"the model's output ({type(output).__name__}) holds no floating-point tensor to sum; pass loss_fn")
    if len(tensors) > 1:
        raise LossError(
            f"the model's output is a {type(output).__name__} of {len(tensors)} floating-point tensors and has no loss "
            "(no .loss or ['loss']): memfit will not guess which to train on (their sum is nobody's loss); pass loss_fn, "
            "e.g. loss_fn=lambda out: out[1]"
        )
    return tensors[0].sum()


def check_loss(loss: Any) -> torch.Tensor:
    """The loss must be a one-element tensor that requires grad (so backward can run)."""
    if not isinstance(loss, torch.Tensor):
        raise LossError(f"loss must be a tensor, got {type(loss).__name__}; make loss_fn return a scalar tensor")
    if loss.numel() != 1:
        raise LossError(f"loss must be a scalar, got a tensor of shape {tuple(loss.shape)}; reduce it (e.g. .mean())")
    if not loss.requires_grad:
        raise LossError("loss does not require grad: nothing in it depends on a trainable parameter (torch.no_grad()? detached?)")
    return loss


def resize_batch(inputs: Any, batch: int) -> Any:
    """``inputs`` with a batch of ``batch``: every tensor whose dim 0 is the batch size is
    cut or tiled along it (its samples repeated in order), anything else passed as is.
    Same kind as ``inputs`` (a tensor, a tuple, a dict)."""
    from torch.utils._pytree import tree_map

    now = _resizable(inputs, batch)
    if isinstance(inputs, torch.Tensor):
        return _resize(now, batch)(inputs)
    args, kwargs = tree_map(_resize(now, batch), split_inputs(inputs))
    return join_inputs(args, kwargs)


def resize_targets(targets: Any, inputs: Any, batch: int) -> Any:
    """``targets`` for the inputs that :func:`resize_batch` makes of ``inputs``: each tensor
    whose dim 0 is the inputs' batch size cut or tiled alike, so every sample keeps its targets."""
    from torch.utils._pytree import tree_map

    return tree_map(_resize(_resizable(inputs, batch), batch), targets)


def _resizable(inputs: Any, batch: int) -> int:
    """The inputs' batch size, checking that ``batch`` is a batch size to resize to."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise WorkloadError(f"a batch size must be a positive integer, got {batch!r}")
    now = batch_size_of(*split_inputs(inputs))
    if now is None:
        raise WorkloadError("no input tensor has a batch dimension to resize")
    return now


def _resize(now: int, batch: int) -> Callable[[Any], Any]:
    def resize(t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == now):
            return t
        return t[torch.arange(batch, device=t.device) % now]

    return resize
