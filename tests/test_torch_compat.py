"""Canaries for the torch internals memfit relies on: a torch release that changes one
fails here, with the name of what changed, before it breaks a profile."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.measure import _torch_compat


def test_storage_objects_are_preserved_and_die_with_the_last_view():
    # The recorder keys blocks by the Python storage object and learns of frees from a
    # weakref finalizer on it: both need torch to keep one object per live storage.
    t = torch.randn(1000)
    s = t.untyped_storage()
    assert s is t[10:].untyped_storage() is t.view(10, 100).untyped_storage()
    freed = []
    weakref.finalize(s, freed.append, True)
    del s
    view = t[5:]
    del t
    gc.collect()
    assert not freed, "storage freed while a view is alive"
    del view
    assert freed == [True], "storage death not reported"


def test_fake_mode():
    mode = _torch_compat.new_fake_mode()
    real = torch.randn(4, 4)
    fake = mode.from_tensor(real)
    assert _torch_compat.is_fake(fake) and not _torch_compat.is_fake(real)
    with mode:
        out = fake @ real  # a real tensor is accepted and faked where used
        made = torch.zeros(3)
    assert _torch_compat.is_fake(out) and _torch_compat.is_fake(made)
    assert out.untyped_storage().nbytes() == 64


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.flops[func.overloadpacket.__name__] = _torch_compat.op_flops(func, args, kwargs or {}, out)
        return out


def test_flop_registry():
    with _Ops() as ops:
        torch.mm(torch.randn(8, 16), torch.randn(16, 4))
    assert ops.flops["mm"] == 2 * 8 * 16 * 4


def test_cpu_attention_is_counted():
    q = torch.randn(2, 4, 32, 16, requires_grad=True)
    with _Ops() as ops:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    fwd = [n for n in ops.flops if n.startswith("_scaled_dot_product") and not n.endswith("backward")]
    bwd = [n for n in ops.flops if n.startswith("_scaled_dot_product") and n.endswith("backward")]
    assert fwd and bwd, f"SDPA on CPU ran no fused kernel: {sorted(ops.flops)}"
    assert ops.flops[fwd[0]] == 2 * (2 * 2 * 4 * 32 * 32 * 16)
    assert ops.flops[bwd[0]] > ops.flops[fwd[0]]


def test_optimizer_implementation_choice():
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p])
    fake_opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
    _torch_compat.pin_optimizer_impl(fake_opt, opt)
    assert isinstance(fake_opt.param_groups[0]["foreach"], bool)
    # the copy takes the implementation the user's optimizer takes, whichever torch picks here
    assert fake_opt.param_groups[0]["foreach"] is _torch_compat.uses_foreach(opt)
    # a flag the user set is theirs: left as it is
    flagged = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], foreach=True)
    _torch_compat.pin_optimizer_impl(flagged, torch.optim.AdamW([p], foreach=False))
    assert flagged.param_groups[0]["foreach"] is True


def test_foreach_choice_is_read():
    p = torch.nn.Parameter(torch.randn(3))
    assert _torch_compat.uses_foreach(torch.optim.AdamW([p], foreach=True)) is True
    assert _torch_compat.uses_foreach(torch.optim.AdamW([p], foreach=False)) is False
    assert _torch_compat.uses_foreach(torch.optim.AdamW([p])) is (p.device.type == "cuda")  # torch's default on CPU: for-loop
    assert _torch_compat.uses_foreach(torch.optim.AdamW([p], fused=True)) is None


def test_batch_statistics_detection():
    assert _torch_compat.uses_batch_statistics(torch.nn.BatchNorm1d(3))
    assert _torch_compat.uses_batch_statistics(torch.nn.SyncBatchNorm(3))
    assert _torch_compat.uses_batch_statistics(torch.nn.LazyBatchNorm2d())
    assert _torch_compat.uses_batch_statistics(torch.nn.BatchNorm2d(3, track_running_stats=False).eval())
    assert not _torch_compat.uses_batch_statistics(torch.nn.BatchNorm2d(3).eval())
    assert not _torch_compat.uses_batch_statistics(torch.nn.InstanceNorm1d(3))
    assert not _torch_compat.uses_batch_statistics(torch.nn.LayerNorm(3))


def test_running_stats_detection():
    assert _torch_compat.updates_running_stats(torch.nn.BatchNorm2d(3))
    assert _torch_compat.updates_running_stats(torch.nn.InstanceNorm1d(3, track_running_stats=True))
    assert not _torch_compat.updates_running_stats(torch.nn.BatchNorm2d(3).eval())
    assert not _torch_compat.updates_running_stats(torch.nn.LayerNorm(3))


def test_written_arguments():
    x, y = torch.randn(3), torch.randn(3)
    assert _torch_compat.written_arguments(torch.ops.aten.add_.Tensor, (x, y), {}) == [x]
    assert _torch_compat.written_arguments(torch.ops.aten.add.Tensor, (x, y), {}) == []
    out = torch.empty(3)
    assert _torch_compat.written_arguments(torch.ops.aten.add.out, (x, y), {"out": out})[0] is out


def test_allocation_trace_sees_inside_a_kernel():
    # memfit.measure.workspace reads the allocations a kernel makes for itself from torch's
    # profiler (its event tree, private): LayerNorm over a transposed input copies it to a
    # contiguous one inside the kernel, a copy no op returns.
    x = torch.randn(256, 512).t()
    with _torch_compat.AllocationTrace() as trace:
        with torch.profiler.record_function("memfit.test#0"):
            y = F.layer_norm(x, (256,))  # held past the region: its output is kept, as an op's is
    peak, net = trace.peaks("memfit.test#", "cpu")["memfit.test#0"]
    out = y.numel() * 4
    assert net >= out and peak - net >= out, (peak, net)


def test_current_autograd_node_is_named_while_its_backward_runs():
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(_torch_compat.current_autograd_node())
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, requires_grad=True)
    loss = torch.gather(x, -1, torch.zeros(4, 1, dtype=torch.long)).sum()
    assert _torch_compat.current_autograd_node() is None
    with Watch():
        loss.backward()
    names = [n[1] for n in seen if n is not None]
    assert "GatherBackward0" in names
    ids = {n[0] for n in seen if n is not None and n[1] == "GatherBackward0"}
    assert len(ids) == 1  # one identity for all of the node's ops
