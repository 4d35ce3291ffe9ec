"""The private corners of torch that memfit leans on, in one place.

Each function here wraps one private API. ``tests/test_torch_compat.py`` exercises every
one of them, so a torch release that moves or changes them fails that test first,
instead of failing deep inside a profile.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import flop_counter

from memfit.compat.fake_key import fast_key_applies, fast_prep_args_for_hash

__all__ = [
    "new_fake_mode",
    "quiet_fake_kernel_log",
    "is_fake",
    "op_flops",
    "CORRECTED_FLOPS",
    "pin_optimizer_impl",
    "pin_cuda_optimizer_impl",
    "uses_foreach",
    "updates_running_stats",
    "uses_batch_statistics",
    "written_arguments",
    "composite_kernel",
    "python_decomposition",
    "AllocationTrace",
    "current_autograd_node",
    "selective_checkpoint_saves",
    "when_all_grads",
]


def _grouped_mm_layout(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Any, out_dtype: Any) -> tuple[list, list, Any]:
    """Size, strides and dtype of ``aten._grouped_mm``'s output, as ATen's kernels make it
    (``create_grouped_gemm_output_tensor``, GroupedMMUtils.h, on the CPU as on CUDA): the
    last dimension's stride padded to 16 bytes for TMA. Measured on this box's CPU kernel:
    (10, 8) @ 3 x (8, 5) fp32 -> size (10, 5), strides (8, 1), 308 bytes of storage."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    align = max(1, 16 // dtype.itemsize)
    padded = (size[-1] + align - 1) // align * align
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return size, stride, dtype


_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def _grouped_mm_rule(mode: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """A fake ``aten._grouped_mm`` for the dtypes ATen's real kernels take but torch's meta
    kernel refuses: torch 2.8-2.13's meta checks the CUDA fast path's bf16-only rule, while
    the CPU kernel and CUDA's fallback run fp32 and fp16 (transformers' MoE experts in fp32
    on the CPU). bf16 keeps torch's rule. None: not this op, or torch's rule applies."""
    if _GROUPED_MM is None or not args:
        return None
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    call = {**dict(zip(names, args)), **kwargs}
    a, b = call["mat_a"], call["mat_b"]
    if a.dtype == torch.bfloat16 or a.dtype != b.dtype or not a.is_floating_point() or call.get("bias") is not None:
        return None
    if a.dim() not in (2, 3) or b.dim() not in (2, 3) or ((a.dim() == 2 or b.dim() == 2) and call.get("offs") is None):
        return None  # torch's own rule says what is wrong
    size, stride, dtype = _grouped_mm_layout(a, b, call.get("offs"), call.get("out_dtype"))
    empty = torch.ops.aten.empty_strided.default
    return mode.dispatch_base(empty, types, (size, stride), {"dtype": dtype, "device": a.device})


def _fake_mode_class() -> type:
    from torch._ops import HigherOrderOperator
    from torch._subclasses.fake_tensor import FakeTensorMode

    class MemfitFakeMode(FakeTensorMode):
        """FakeTensorMode with memfit's rules for ops whose torch fake kernel refuses calls
        the real kernel runs (:func:`_grouped_mm_rule`); every other op as torch fakes it."""

        def dispatch_base(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
            return FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs)

        # higher-order operators find their rules by the mode's exact class: this one's are
        # FakeTensorMode's (a compiled graph's run_and_save_rng_state, say), in __torch_dispatch__
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            if isinstance(func, HigherOrderOperator):
                return _fake_hop(self, func, types, args, kwargs or {})
            if func is _GROUPED_MM and _GROUPED_MM is not None:
                out = _grouped_mm_rule(self, types, args, kwargs or {})
                if out is not None:
                    return out
            return FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs)

    if fast_key_applies():
        # the same dispatch-cache keys, a third of the fake dispatch's time less (compat/fake_key.py)
        MemfitFakeMode._prep_args_for_hash = fast_prep_args_for_hash(FakeTensorMode._prep_args_for_hash)  # type: ignore[attr-defined]
    return MemfitFakeMode


def _fake_hop(mode: Any, hop: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """A higher-order operator under memfit's fake mode: FakeTensorMode's rule for it (the
    dispatcher has already taken the mode off the stack, as for FakeTensorMode's own). A rule
    given by ``register_fake`` is FakeTensorMode's own dispatch of the operator."""
    from torch._higher_order_ops.utils import registered_hop_fake_fns
    from torch._subclasses.fake_tensor import FakeTensorMode

    if hop in registered_hop_fake_fns:
        return FakeTensorMode.__torch_dispatch__(mode, hop, types, args, kwargs)
    rule = hop.python_key_table.get(FakeTensorMode)
    if rule is None:
        raise NotImplementedError(f"no fake tensor rule for the higher-order operator {hop.name()}")
    return rule(mode, *args, **kwargs)


_FAKE_MODE_CLASS: Any = None


def new_fake_mode() -> Any:
    """A FakeTensorMode that also accepts real tensors a model keeps outside its parameters
    and buffers (constant masks, say): they are turned into fake ones where used. It fakes
    ``aten._grouped_mm`` (MoE experts) in every dtype its real kernels run."""
    global _FAKE_MODE_CLASS
    if _FAKE_MODE_CLASS is None:
        _FAKE_MODE_CLASS = _fake_mode_class()
    return _FAKE_MODE_CLASS(allow_non_fake_inputs=True)


class _DropFakeKernelFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta for")


@contextmanager
def quiet_fake_kernel_log() -> Iterator[None]:
    """Inside, torch's ``torch._subclasses.fake_tensor`` logger drops its "failed while
    attempting to run meta for <op>" records (an ERROR with the kernel's whole traceback,
    ~22 lines): the exception itself still propagates, and memfit names it in one line.
    Only these records, only while memfit's fake step runs."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    drop = _DropFakeKernelFailures()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def composable_state_keys() -> frozenset[str]:
    """The attributes torch's composable APIs (FSDP2's ``fully_shard``) keep their state in on
    a module (``__composable_api_state_key_<uuid>``). Their hooks around the forward, run by
    ``Module.__call__``, change that state; a recompute runs the forward alone, so it never
    changes it again. Empty until torch's composable contract is imported (no such state)."""
    contract = sys.modules.get("torch.distributed._composable.contract")
    keys = (getattr(contract, "STATE_KEY", None), getattr(contract, "REGISTRY_KEY", None)) if contract is not None else ()
    return frozenset(k for k in keys if isinstance(k, str))


def reset_fsdp(model: torch.nn.Module) -> None:
    """FSDP2's modules of ``model`` as a finished step leaves them, after a forward or backward
    that raised part way: torch's own recovery (``reset_iter_state`` on the root: in-flight
    reduce-scatter buffers and per-iteration trackers dropped), the gradients that backward
    had left on unsharded parameters dropped (their post-backward, which would have reduced
    and freed them, never ran; torch's recovery keeps them), every module resharded. Nothing
    on a model without FSDP2."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if fsdp and hasattr(fsdp[0], "reset_iter_state"):
        try:
            fsdp[0].reset_iter_state()  # the outermost: the root, once a forward has run
        except RuntimeError:
            pass  # no root yet (the first forward failed before FSDP's lazy init): nothing in flight
    for module in fsdp:
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", ()):
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
        module.reshard()


_COLLECTIVES = ("allreduce_", "_allgather_base_", "_reduce_scatter_base_", "broadcast_", "allgather_")
_FAKE_COLLECTIVES: list[str | None] = []


def fake_collectives_missing() -> str | None:
    """One line when this torch has no fake (Meta) kernels for c10d's collectives, which a
    step on the fake process group runs (DDP's all-reduce, FSDP2's all-gather): torch 2.6
    has none, 2.11 and 2.13 have them. None where they are all there."""
    if not _FAKE_COLLECTIVES:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        c10d = getattr(torch.ops, "c10d", None)
        missing = [n for n in _COLLECTIVES if c10d is None or not has(getattr(c10d, n).default.name(), "Meta")]
        _FAKE_COLLECTIVES.append(
            f"torch {torch.__version__} has no fake kernels for c10d's collectives ({', '.join(missing)}): a distributed "
            "step on the fake process group needs a newer torch (2.11 and 2.13 run it)"
            if missing
            else None
        )
    return _FAKE_COLLECTIVES[0]


def collective_refused(exc: BaseException) -> str | None:
    """:func:`fake_collectives_missing`'s line when ``exc`` (or what caused it) is a fake
    tensor refusing a c10d collective on such a torch; else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ == "UnsupportedOperatorException" and str(seen).startswith("c10d."):
            return fake_collectives_missing()
        seen = seen.__cause__ or seen.__context__
    return None


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _sdpa_counts_gqa() -> bool:
    """Whether torch's SDPA formulas take fewer key/value heads than query heads (grouped-query
    attention, a Llama's): torch 2.13's do, 2.11's and 2.6's raise AssertionError."""
    try:
        flop_counter.sdpa_flop_count((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8))
    except AssertionError:
        return False
    return True


_SDPA_GQA = _sdpa_counts_gqa()


def _kv_shapes(query: Any, key: Any, value: Any) -> tuple[Any, Any]:
    """key's and value's shapes, their heads broadcast to the query's where torch's formula
    does not (the kernel makes the same products as with the heads repeated)."""
    if _SDPA_GQA or key.dim() != 4 or query.dim() != 4 or key.shape[1] == query.shape[1]:
        return key.shape, value.shape
    heads = query.shape[1]
    return (*key.shape[:1], heads, *key.shape[2:]), (*value.shape[:1], heads, *value.shape[2:])


def _cpu_sdpa_forward(query, key, value, *args, out_val=None, **kwargs) -> int:
    if not _SDPA_GQA:
        return flop_counter.sdpa_flop_count(query.shape, *_kv_shapes(query, key, value))
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    if not _SDPA_GQA:
        return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, *_kv_shapes(query, key, value))
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _grouped_mm_flops(mat_a, mat_b, offs=None, *args, out_val=None, **kwargs) -> int:
    """2 x M x N x K over the groups: each output element is a K-long dot product, except
    a 2-D by 2-D call, whose groups split K itself (the experts' weight gradients)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.size(0) * mat_a.size(1) * mat_b.size(1)
    size, _, _ = _grouped_mm_layout(mat_a, mat_b, offs, None)
    n = 1
    for d in size:
        n *= d
    return 2 * n * mat_a.size(-1)


# FlopCounterMode counts 0 for the CPU flash-attention kernels and for grouped GEMMs (MoE
# experts); memfit counts them with torch's own SDPA formulas (same maths as the CUDA kernels
# it does count) and a GEMM's 2MNK.
_EXTRA_FLOPS: dict[Any, Any] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_forward),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward),
    ("_grouped_mm", _grouped_mm_flops),
):
    _packet = getattr(torch.ops.aten, _name, None)
    if _packet is not None:
        _EXTRA_FLOPS[_packet] = _fn


def _conv_backward_flops(
    grad_out_shape,
    x_shape,
    w_shape,
    _bias,
    _stride,
    _padding,
    _dilation,
    transposed,
    _output_padding,
    _groups,
    output_mask,
    out_shape=None,
    **kwargs,
) -> int:
    """FLOPs of a convolution's backward, groups counted. torch's formula counts grad_weight
    as one convolution over every input channel, ignoring groups: ``groups`` times too high,
    so a depthwise convolution's backward read ~97x its forward (ConvNeXt-T: 11.7 GFLOP
    against 120 MFLOP). grad_weight makes the same products as the forward (each weight
    times each input it met), and grad_input as a convolution of grad_out with the weight
    (torch's count of that is right: the weight's shape carries the groups)."""
    flops = 0
    if output_mask[0]:  # grad_input: conv_transpose(grad_out, weight), or conv for a transposed forward
        flops += flop_counter.conv_flop_count(grad_out_shape, w_shape, x_shape, not transposed)
    if output_mask[1]:  # grad_weight: the forward's products, (Cin / groups) per output channel
        flops += flop_counter.conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return flops


CORRECTED_FLOPS: dict[Any, Any] = {torch.ops.aten.convolution_backward: _conv_backward_flops}
"""FlopCounterMode formulas (on shapes) that memfit uses instead of torch's: pass as
``FlopCounterMode(custom_mapping=CORRECTED_FLOPS)``; :func:`op_flops` uses them too."""
_CORRECTED = {k: flop_counter.shape_wrapper(v) for k, v in CORRECTED_FLOPS.items()}


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one aten op call, by FlopCounterMode's formulas (0 for ops it has none for),
    with :data:`CORRECTED_FLOPS` in place of torch's."""
    packet = func._overloadpacket
    formula = _CORRECTED.get(packet) or flop_counter.flop_registry.get(packet)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    formula = _EXTRA_FLOPS.get(packet)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    return 0


def pin_optimizer_impl(fake_opt: torch.optim.Optimizer, real_opt: torch.optim.Optimizer) -> None:
    """Make an optimizer over fake parameters take the same implementation (single-tensor,
    foreach or fused) that the real one picks: torch picks by ``type(p)``, and FakeTensor
    is never on its list, so left alone the fake copy would take the single-tensor path
    and its temporaries would differ from the real step's."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    for fake_group, group in zip(fake_opt.param_groups, real_opt.param_groups):
        if "foreach" not in group or group.get("foreach") is not None or group.get("fused"):
            continue
        params = [p for p in group["params"]]
        _, foreach = _default_to_fused_or_foreach(params, bool(group.get("differentiable", False)), use_fused=False)
        fake_group["foreach"] = foreach


def pin_cuda_optimizer_impl(fake_opt: torch.optim.Optimizer, real_opt: torch.optim.Optimizer) -> None:
    """As :func:`pin_optimizer_impl`, for fake copies on (fake) CUDA of a real optimizer on
    another device: the implementation torch picks for plain tensors on CUDA (foreach,
    where the flag is left to torch)."""
    from torch.optim.optimizer import _foreach_supported_types, _get_foreach_kernels_supported_devices

    devices = _get_foreach_kernels_supported_devices()
    for fake_group, group in zip(fake_opt.param_groups, real_opt.param_groups):
        if "foreach" not in group or group.get("foreach") is not None or group.get("fused"):
            continue
        real = [p for p in group["params"] if p is not None]
        fakes = [p for p in fake_group["params"] if p is not None]
        foreach = not bool(group.get("differentiable", False)) and all(
            type(p) in _foreach_supported_types and f.device.type in devices for p, f in zip(real, fakes)
        )
        fake_group["foreach"] = foreach


def uses_foreach(optimizer: torch.optim.Optimizer) -> bool | None:
    """Whether the optimizer's step takes the foreach implementation (its flag, or torch's
    default for these parameters when the flag is None); None when it has no such choice
    (no ``foreach`` setting, fused, or groups that differ)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    seen = set()
    for group in optimizer.param_groups:
        if "foreach" not in group or group.get("fused"):
            return None
        flag = group["foreach"]
        if flag is None:
            _, flag = _default_to_fused_or_foreach(
                list(group["params"]), bool(group.get("differentiable", False)), use_fused=False
            )
        seen.add(bool(flag))
    return seen.pop() if len(seen) == 1 else None


def uses_batch_statistics(module: torch.nn.Module) -> bool:
    """Whether a forward of ``module`` normalises with statistics of the batch it is given
    (BatchNorm, SyncBatchNorm and their lazy variants in training, or without running
    statistics): then a micro-batch is normalised differently from the whole batch."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(module, _BatchNorm) and (module.training or not module.track_running_stats)


def updates_running_stats(module: torch.nn.Module) -> bool:
    """Whether a forward of ``module`` updates running statistics (BatchNorm, InstanceNorm
    with ``track_running_stats``): their common base class is private."""
    from torch.nn.modules.batchnorm import _NormBase

    return isinstance(module, _NormBase) and module.training and bool(module.track_running_stats)


def written_arguments(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Arguments an aten op writes in place (``Tensor(a!)`` in its schema)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i])
    return out


_COMPOSITE: dict[Any, Any] = {}


def composite_kernel(func: Any) -> Any:
    """The C++ ``CompositeImplicitAutograd`` kernel of an aten op (what a real tensor runs
    where no backend kernel exists: ``dropout``, ``to``, ``linear``), callable on the op's
    arguments; None for an op without one. FakeTensorMode runs such an op through a Python
    decomposition of torch's instead when it has one (``OpOverload.decompose``), which may
    copy where the C++ kernel returns its input. Remembered per op."""
    kernel = _COMPOSITE.get(func)
    if kernel is None and func not in _COMPOSITE:
        key = torch._C.DispatchKey.CompositeImplicitAutograd
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key):
            op_dk = func._op_dk

            def kernel(*args: Any, **kwargs: Any) -> Any:
                return op_dk(key, *args, **kwargs)

        _COMPOSITE[func] = kernel
    return kernel


_PYTHON_DECOMPOSED: dict[Any, bool] = {}


def python_decomposition(func: Any) -> bool:
    """Whether FakeTensorMode may run the op through one of torch's Python decompositions
    (``OpOverload.py_kernels``, ``torch._decomp.decomposition_table``) rather than the C++
    kernel a real tensor runs: the only ops whose fake outputs can alias otherwise than the
    real ones. Remembered per op."""
    known = _PYTHON_DECOMPOSED.get(func)
    if known is None:
        from torch._decomp import decomposition_table

        known = torch._C.DispatchKey.CompositeImplicitAutograd in func.py_kernels or func in decomposition_table
        _PYTHON_DECOMPOSED[func] = known
    return known


@contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null, Python's ``sys.stderr`` kept where it was. Under a
    profiler, torch's C++ code writes lines no user asked for straight to fd 2 (kineto's
    "profiler_start"/"profiler_stop", the CPU allocator's "Memory block of unknown size was
    allocated before the profiling started" for each tensor from before the step that the
    step frees); Python's warnings and the user's own prints still reach the terminal."""
    try:
        sys.stderr.flush()
        python_on_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        python_on_fd2 = False
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    swapped = sys.stderr
    if python_on_fd2:
        sys.stderr = open(os.dup(saved), "w", buffering=1, encoding=swapped.encoding, errors=swapped.errors)  # noqa: SIM115
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        if python_on_fd2:
            sys.stderr.close()
            sys.stderr = swapped
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def no_dispatch_modes() -> Iterator[None]:
    """Inside, no dispatch mode is active (the recorder's, a FakeTensorMode): ops run on
    real tensors as if called from outside the step (``torch.utils._python_dispatch``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _enter_regions_only(prof: Any) -> None:
    """``prof.__enter__()`` (``torch.autograd.profiler.profile``'s: prepare, then start) with the
    profiler recording only the regions ``record_function`` opens (``RecordScope.USER_SCOPE``),
    not every aten op as well. Allocations are recorded whatever the scopes, each inside the
    region it happened in (with no aten op's node between them now), so the regions read the
    same; the aten ops' own events were most of what the profiler cost a step (about 30 us an
    op on this CPU), and nothing reads them. A torch whose profiler lacks one of these pieces
    gets the whole profiler, as before."""
    import inspect

    from torch.autograd import profiler

    enable = getattr(torch._C._autograd, "_enable_profiler", None)
    scope = getattr(getattr(torch._C, "_profiler", None), "RecordScope", None)
    start = getattr(profiler, "_run_on_profiler_start", None)
    prepare = getattr(prof, "_prepare_trace", None)
    if None in (enable, scope, start, prepare) or "create_trace_id" not in inspect.signature(prof.config).parameters:
        prof.__enter__()
        return
    prepare()
    start()
    enable(prof.config(create_trace_id=False), prof.kineto_activities, {scope.USER_SCOPE})
    prof.profiling_start_time_ns = time.perf_counter_ns()


class AllocationTrace:
    """Every allocation and free the device allocators make while it is active, including
    those inside kernels (oneDNN reorders and scratch, a kernel's own ``at::empty``), which
    no dispatch mode sees: torch's profiler with ``profile_memory``. Regions tagged with
    ``torch.profiler.record_function(name)`` are read back by :meth:`peaks`."""

    def __init__(self) -> None:
        self._prof: Any = None
        self._quiet: Any = None

    def __enter__(self) -> AllocationTrace:
        from torch.autograd.profiler import profile

        # The legacy entry point: a kineto session costs ~25 ms to open, this one ~1 ms.
        prof = profile(use_kineto=False, profile_memory=True, record_shapes=False)
        self._quiet = _quiet_native_stderr()
        self._quiet.__enter__()
        try:
            _enter_regions_only(prof)
        except BaseException:
            self._quiet.__exit__(None, None, None)
            raise
        self._prof = prof
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._prof.__exit__(*exc)
        finally:
            self._quiet.__exit__(None, None, None)

    def _regions(self, prefix: str, device_type: str) -> dict[str, list[int]]:
        """For each region whose name starts with ``prefix``: the sizes of its allocations
        (frees negative) on ``device_type``, in time order."""
        from torch._C._profiler import _EventType

        out: dict[str, list[int]] = {}
        stack = list(self._prof.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.TorchOp and node.name.startswith(prefix):
                events: list[tuple[int, int]] = []
                inner = list(node.children)
                while inner:
                    n = inner.pop()
                    if n.tag == _EventType.Allocation and n.extra_fields.device.type == device_type:
                        events.append((n.start_time_ns, int(n.extra_fields.alloc_size)))
                    inner.extend(n.children)
                out[node.name] = [size for _, size in sorted(events)]
            else:
                stack.extend(node.children)
        return out

    def peaks(self, prefix: str, device_type: str) -> dict[str, tuple[int, int]]:
        """For each region whose name starts with ``prefix``: ``(peak, net)`` bytes of the
        allocations on ``device_type`` inside it, in time order (peak of the running sum
        from its start; net at its end: what the region allocated and kept, its outputs)."""
        out: dict[str, tuple[int, int]] = {}
        for name, sizes in self._regions(prefix, device_type).items():
            live = peak = 0
            for size in sizes:
                live += size
                peak = max(peak, live)
            out[name] = (peak, live)
        return out

    def allocated(self, prefix: str, device_type: str) -> dict[str, int]:
        """For each region whose name starts with ``prefix``: the bytes it allocated on
        ``device_type`` (frees not subtracted)."""
        return {name: sum(s for s in sizes if s > 0) for name, sizes in self._regions(prefix, device_type).items()}


def torch_version() -> tuple[int, int]:
    """torch's (major, minor): ``2.6.0+cu124`` is (2, 6)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# torch 2.13 keeps a C++ node's Python object while the node runs, so its id is the node's
# identity; torch 2.6 and 2.11 make a new one for each call, and a freed one's address is
# reused by the next node's (two AccumulateGrads took one id on 2.6).
_NODE_OBJECT_KEPT = torch_version() >= (2, 13)


def current_autograd_node() -> tuple[Any, str] | None:
    """The autograd node whose backward is running on this thread, as (identity, name:
    ``GatherBackward0``), or None outside one (the forward, the engine's own first op).
    The identity is the node's Python object, which torch keeps for the node while it runs;
    no reference to it is kept here (that would keep its saved tensors alive). Before torch
    2.13 it is :func:`_stable_node_key`."""
    node = torch._C._current_autograd_node()
    if not _NODE_OBJECT_KEPT and node is not None:
        return _stable_node_key(node), node.name()
    return None if node is None else (id(node), node.name())


def _stable_node_key(node: Any) -> tuple[Any, ...]:
    """A node's identity where its Python object is not kept: its sequence number (one per
    node made on a thread), and for an AccumulateGrad (all share the largest number) the
    leaf it accumulates into. A Python function's node is its ``ctx``, which the node keeps."""
    seq = getattr(node, "_sequence_nr", None)
    if seq is None:
        return ("object", id(node))
    leaf = getattr(node, "variable", None)
    return ("node", seq(), node.name(), None if leaf is None else id(leaf))


@contextmanager
def selective_checkpoint_saves(on_save: Any) -> Iterator[None]:
    """Call ``on_save(tensor)`` for each op output a selective-checkpoint policy keeps for
    backward (``CheckpointPolicy.MUST_SAVE`` or ``PREFER_SAVE``, torchtitan's per-op SAC
    among them). Those outputs are kept by the policy's own cache, not through autograd's
    saved-tensor hooks (``torch.utils.checkpoint`` installs its own above any others), so a
    recorder's hooks never see them. The cache wraps each kept tensor in
    ``torch.utils.checkpoint._VersionWrapper`` (its version check), made once per kept
    output in the original forward only; while this context is open that class is a
    subclass that tells ``on_save`` first."""
    from torch.utils import checkpoint

    base = checkpoint._VersionWrapper

    class Reporting(base):  # type: ignore[misc,valid-type]
        def __init__(self, val: Any) -> None:
            super().__init__(val)
            if isinstance(val, torch.Tensor):
                on_save(val)

    checkpoint._VersionWrapper = Reporting  # type: ignore[attr-defined]
    try:
        yield
    finally:
        checkpoint._VersionWrapper = base  # type: ignore[attr-defined]


class _Handles:
    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def when_all_grads(tensors: list[torch.Tensor], fn: Any, roots: bool = False) -> Any:
    """Call ``fn()`` once every one of ``tensors`` that this backward reaches has its
    gradient, as ``torch.autograd.graph.register_multi_grad_hook(tensors, fn)`` (mode
    "all") does, but without its buffer: that one keeps each gradient until the last
    arrives, so watching a module whose outputs' gradients come at different times (BART's
    logits and its encoder's output, whose gradient arrives after the whole decoder's
    backward) kept a logits-sized gradient alive that the step frees at once. Returns a
    handle with ``remove()``.

    ``roots``: a tensor that is the one root of a backward (``torch.autograd.backward(t, grad)``)
    counts as reached when its gradient comes: the engine answers False for that node (it is
    the graph's root itself; several roots hang off a node of the engine's own and are answered
    as any node), which left ``fn`` uncalled in that backward."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc  # private: where torch's own hook gets it

    grad_fns = [_get_grad_fn_or_grad_acc(t) for t in tensors]
    count: dict[int, int] = {}  # graph task -> gradients seen
    expected: dict[int, int] = {}  # graph task -> gradients it will make

    lock = threading.Lock()  # the engine runs each device's part of a backward on its own thread

    def hook(_grad: torch.Tensor, i: int) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            seen = count.get(task, 0)
            if seen == 0:
                expected[task] = sum(map(torch._C._will_engine_execute_node, grad_fns))
            # A backward's one root (a pipeline stage's output, whose gradient the stage after
            # sends) gets its gradient, yet the engine says it will not execute its node:
            # counted as it arrives, else a module whose output is the root never entered backward.
            if roots and not torch._C._will_engine_execute_node(grad_fns[i]):
                expected[task] += 1
            count[task] = seen + 1
            last = seen + 1 == expected[task]
            if last:
                del count[task], expected[task]
        if last:
            fn()

    return _Handles([t.register_hook(lambda g, i=i: hook(g, i)) for i, t in enumerate(tensors)])


def host_compile_system_info() -> None:
    """Inductor's compile caches key on the machine's GPU (``CacheBase.get_system``, read once
    and cached). With memfit's fake CUDA loaded, a CPU build of torch reports a device whose
    properties lack what a ROCm or CUDA build's have, and every host compile fails on it. The
    answer a CPU-only build gives (no GPU: an empty device record) is put in that cache first,
    while the device's properties raise as they do without a GPU."""
    from torch._inductor.codecache import CacheBase

    real = torch.cuda.get_device_properties

    def none(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no CUDA device for inductor's cache key (memfit: fake CUDA)")

    torch.cuda.get_device_properties = none  # type: ignore[assignment]
    try:
        CacheBase.get_system()
    finally:
        torch.cuda.get_device_properties = real  # type: ignore[assignment]
