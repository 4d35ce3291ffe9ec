"""What the recorder remembers per op (to cost less per call) answers as the uncached code did.

The recorder asks the same questions of every op call of a step: its name, whether its schema
writes an argument, whether a table lists it, its workspace signature. Those answers are now
remembered per ``OpOverload`` (or computed a cheaper way); each is checked here against the
expression it replaced, for overloads of one op that differ, so a cache keyed too coarsely
(by the op's name, say) fails.
"""

from __future__ import annotations

import torch

from memfit.compat import torch_compat
from memfit.measure import aliasing, determinism, observer, recorder, workspace

aten = torch.ops.aten


def test_op_facts_are_per_overload_and_as_computed_at_each_call():
    ops = [aten.add.Tensor, aten.add.out, aten.add_.Tensor, aten.mm.default, aten.select.int, aten.detach.default]
    ops += [aten.index_put.default, aten.scatter_add.default, torch.ops.c10d.allreduce_.default]
    for func in ops:
        facts = recorder._facts(func)
        assert recorder._facts(func) is facts  # remembered
        name, qualified = str(func.overloadpacket.__name__), func.overloadpacket._qualified_op_name
        assert (facts.name, facts.qualified) == (name, qualified)
        assert facts.writes == bool(func._schema.is_mutable)
        assert facts.cublas == (name in recorder.CUBLAS_OPS)
        assert facts.nondeterministic == (name in determinism.WATCHED_OPS)
        assert facts.twin == (name in observer.TWIN_OPS)
        # the eager recorder gives no workspace block to these (kernel_scratch with inside=True)
        kind = recorder._scratch_kind(func)
        assert recorder._scratch_kind(func) == kind and recorder._SCRATCH_KIND[func] == kind  # remembered
        assert (kind in (recorder._NO_KERNEL, recorder._RUN_INSIDE)) == (
            func.is_view or name in recorder.BOOKKEEPING_OPS or qualified in recorder._RECORD_INSIDE_ON_CPU
            or func.namespace == "c10d"
        )
        assert (kind == recorder._RUN_AS_CUDA) == (
            qualified in recorder._AS_CUDA_ALLOCATES and kind not in (recorder._NO_KERNEL, recorder._RUN_INSIDE)
        )
    # two overloads of one op: the same name, not the same schema
    assert recorder._facts(aten.add.Tensor).name == recorder._facts(aten.add.out).name == "add"
    assert not recorder._facts(aten.add.Tensor).writes and recorder._facts(aten.add.out).writes
    no_kernel = recorder._NO_KERNEL
    assert recorder._scratch_kind(aten.select.int) == no_kernel and recorder._scratch_kind(aten.mm.default) == recorder._KERNEL
    assert recorder._facts(aten.mm.default).cublas and recorder._scratch_kind(torch.ops.c10d.allreduce_.default) == no_kernel
    # what the recorder skips when the fact says no: nothing to find there
    x = torch.zeros(4)
    assert torch_compat.written_arguments(aten.add.Tensor, (x, x), {}) == []
    assert determinism.check("add", "cpu", (x, x), {}) is None and determinism.forward_site("add", (x, x)) is None
    assert {"index_put", "index", "take", "scatter_add"} <= determinism.WATCHED_OPS


def test_metadata_only_is_remembered_per_overload():
    for func in (torch.ops.prim.device.default, aten.sym_size.int, aten.sym_stride.int, aten.add.Tensor, aten.size.int):
        expected = func.namespace == "prim" or func.overloadpacket.__name__.startswith("sym_")
        assert recorder._metadata_only(func) is expected
        assert recorder._metadata_only(func) is expected  # the remembered answer


def _old_describe(value):
    """workspace._describe as it was before it was made faster."""
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        strides = tuple(st if n != 1 else 0 for n, st in zip(shape, value.stride())) if value.layout is torch.strided else ()
        return ("T", shape, strides, value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_old_describe(v) for v in value)
    if isinstance(value, float):
        return float
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    return type(value).__name__


def test_workspace_signature_is_the_one_it_was():
    class Flag(int):  # a subclass of int takes the long way, to the same answer
        pass

    x = torch.randn(4, 1, 3)
    args = (x, x.mT, x[:, :, :1], torch.randn(3, 3).to_sparse(), [1, 2], (0.5, None), True, Flag(3), "mean")
    args += (torch.float16, torch.device("cpu"), torch.strided, torch.channels_last, iter([]), [x, None])
    kwargs = {"b": 2.0, "a": x, "out": None}
    for func in (aten.add.Tensor, aten.add.out):
        old = (str(func), _old_describe(args), tuple(sorted((k, _old_describe(v)) for k, v in kwargs.items())))
        assert workspace.signature(func, args, kwargs) == old
        assert repr(workspace.signature(func, args, kwargs)) == repr(old)  # the text a saved profile keys by
        assert workspace.signature(func, args, {}) == (str(func), _old_describe(args), ())
    assert workspace.signature(aten.add.Tensor, (x,), {}) != workspace.signature(aten.add.out, (x,), {})


def test_may_return_inputs_is_false_only_where_returned_inputs_is_always_empty():
    # returned_inputs answers empty, whatever the call, for an op with no composite kernel
    # that is neither a view nor an alias of its first argument: those are the False ones
    for func in (aten.mul.Tensor, aten.mm.default, aten.view.default, aten.alias.default, aten.dropout.default):
        always_empty = torch_compat.composite_kernel(func) is None and not (func.is_view or aliasing._aliases_self(func))
        assert aliasing.may_return_inputs(func) is (not always_empty)
        assert aliasing.may_return_inputs(func) is (not always_empty)  # the remembered answer
    assert not aliasing.may_return_inputs(aten.mul.Tensor)
    assert aliasing.may_return_inputs(aten.view.default) and aliasing.may_return_inputs(aten.dropout.default)


def test_node_kind_is_remembered_as_computed():
    for name, kind in (("GatherBackward0", "GatherBackward"), ("torch::autograd::AccumulateGrad", "AccumulateGrad")):
        assert observer._node_kind(name) == kind == observer._node_kind(name)


def test_allocation_trace_reads_regions_as_the_whole_profiler_does():
    # Recording only record_function regions (not every aten op) leaves each allocation in
    # its region: a LayerNorm over a permuted tensor copies it inside its kernel first.
    from torch.autograd.profiler import profile

    x, ln = torch.randn(8, 64, 4, 4), torch.nn.LayerNorm(64)

    def run():
        with torch.profiler.record_function("memfit.test#a"):
            a = ln(x.permute(0, 2, 3, 1))
        with torch.profiler.record_function("memfit.test#b"):
            b = torch.cat([x, x]).sum()
        return a, b

    with torch_compat.AllocationTrace() as ours:
        run()
    whole = torch_compat.AllocationTrace()
    whole._quiet = torch_compat._quiet_native_stderr()
    whole._quiet.__enter__()
    whole._prof = profile(use_kineto=False, profile_memory=True, record_shapes=False)
    whole._prof.__enter__()
    run()
    whole.__exit__(None, None, None)
    got = ours.peaks("memfit.test#", "cpu")
    assert got == whole.peaks("memfit.test#", "cpu")
    assert got["memfit.test#a"][0] > got["memfit.test#a"][1] > 0  # the copy is there
