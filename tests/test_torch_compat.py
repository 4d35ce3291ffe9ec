"""Canaries for the torch internals memfit relies on: a torch release that changes one
fails here, with the name of what changed, before it breaks a profile."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.compat import torch_compat as _torch_compat


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


def test_composite_kernel_is_the_cpp_one():
    # memfit.measure.aliasing runs an op's C++ CompositeImplicitAutograd kernel (OpOverload's
    # private _op_dk) to learn whether the real kernel returns an input: eval dropout does,
    # where FakeTensorMode's Python decomposition (OpOverload.decompose) clones.
    dropout = _torch_compat.composite_kernel(torch.ops.aten.dropout.default)
    assert dropout is not None
    assert _torch_compat.composite_kernel(torch.ops.aten.add.Tensor) is None  # a kernel of its own
    x = torch.randn(3)
    with torch.inference_mode():
        assert dropout(x, 0.5, False) is x
        assert torch.ops.aten.dropout.default.decompose(x, 0.5, False) is not x
    # and only asks it where the fake mode may take a Python decomposition of torch's
    assert _torch_compat.python_decomposition(torch.ops.aten.dropout.default)
    assert not _torch_compat.python_decomposition(torch.ops.aten.linear.default)


_GROUPED_CASES = [
    # (mat_a, mat_b, offs): transformers' experts (2-D tokens by 3-D weights, transposed as
    # it passes them), their weight gradients (2-D by 2-D), batched (3-D by 3-D), 3-D by 2-D
    ((10, 8), (3, 5, 8), [3, 7, 10]),
    ((8, 12), (5, 12), [4, 8, 12]),
    ((3, 4, 8), (3, 5, 8), None),
    ((3, 4, 8), (5, 8), [2, 3, 4]),
]


def _grouped_args(a_shape, b_shape, offs):
    a = torch.randn(*a_shape)
    b = torch.randn(*b_shape).transpose(-2, -1)  # (.., K, N) with K contiguous, as the kernel wants
    if len(a_shape) == 2 and len(b_shape) == 2:
        a = torch.randn(a_shape[1], a_shape[0]).t()  # 2-D by 2-D groups split K: a is (M, K) K-major
    return a, b, None if offs is None else torch.tensor(offs, dtype=torch.int32)


def test_grouped_mm_is_faked_in_fp32_as_the_cpu_kernel_lays_it_out():
    # torch's meta kernel of aten._grouped_mm takes bf16 only (the CUDA fast path's rule);
    # the CPU kernel runs fp32 (transformers' MoE experts). memfit's fake mode fakes it with
    # the real kernel's size, 16-byte-padded strides and storage, and counts its FLOPs.
    if not hasattr(torch, "_grouped_mm"):
        return  # torch before 2.8 has no grouped GEMM: nothing to fake
    for a_shape, b_shape, offs in _GROUPED_CASES:
        a, b, o = _grouped_args(a_shape, b_shape, offs)
        real = torch._grouped_mm(a, b, offs=o)
        mode = _torch_compat.new_fake_mode()
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        fo = None if o is None else mode.from_tensor(o)
        with mode:
            fake = torch._grouped_mm(fa, fb, offs=fo)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype), (a_shape, b_shape)
        assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()
        with _Ops() as ops:
            torch._grouped_mm(a, b, offs=o)
        k = a.shape[-1]
        m_n = real.numel() if a.dim() == 3 or b.dim() == 3 else a.shape[0] * b.shape[1]
        assert ops.flops["_grouped_mm"] == 2 * m_n * k


def test_fake_kernel_failures_are_logged_only_outside_memfit_fake_steps(caplog):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fail() -> None:
        mode = FakeTensorMode()  # torch's own: its _grouped_mm rule refuses fp32
        a = mode.from_tensor(torch.randn(4, 8))
        b = mode.from_tensor(torch.randn(2, 8, 8))
        try:
            with mode:
                torch._grouped_mm(a, b, offs=mode.from_tensor(torch.tensor([2, 4], dtype=torch.int32)))
        except RuntimeError:
            return
        raise AssertionError("torch's fake kernel of _grouped_mm now takes fp32: memfit's rule may go")

    if not hasattr(torch, "_grouped_mm"):
        return
    with caplog.at_level("ERROR", logger="torch._subclasses.fake_tensor"):
        fail()
        assert any("failed while attempting to run meta" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with _torch_compat.quiet_fake_kernel_log():
            fail()
        assert not caplog.records


@pytest.mark.parametrize("kept", [None, False], ids=["this-torch", "stable-key"])
def test_current_autograd_node_is_named_while_its_backward_runs(monkeypatch, kept):
    # "stable-key": the identity torch before 2.13 gets (its node objects are not kept), here too
    if kept is not None:
        monkeypatch.setattr(_torch_compat, "_NODE_OBJECT_KEPT", kept)
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(_torch_compat.current_autograd_node())
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    loss = torch.gather(x @ w, -1, torch.zeros(4, 1, dtype=torch.long)).sum()
    assert _torch_compat.current_autograd_node() is None
    with Watch():
        loss.backward()
    names = [n[1] for n in seen if n is not None]
    assert "GatherBackward0" in names
    for name in ("GatherBackward0", "MmBackward0"):
        ids = {n[0] for n in seen if n is not None and n[1] == name}
        assert len(ids) == 1, name  # one identity for all of the node's ops
    # two leaves, two AccumulateGrad nodes: two identities (torch 2.6 reused one freed object's id)
    assert len({n[0] for n in seen if n is not None and n[1].endswith("AccumulateGrad")}) == 2


def test_torch_version_reads_local_builds(monkeypatch):
    for text, want in (("2.6.0+cu124", (2, 6)), ("2.11.0", (2, 11)), ("2.13.0+cpu", (2, 13)), ("2.14.0.dev20261101", (2, 14))):
        monkeypatch.setattr(torch, "__version__", text)
        assert _torch_compat.torch_version() == want


def test_selective_checkpoint_saves_reports_what_the_policy_keeps():
    # a per-op policy keeps mm outputs (torchtitan's SAC keeps every other one); the kept
    # tensors reach the callback, what it recomputes does not, and the class is restored
    from torch.utils import checkpoint as ckpt

    def policy(ctx, func, *args, **kwargs):
        return ckpt.CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.mm.default else ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    seen = []
    base = ckpt._VersionWrapper
    with _torch_compat.selective_checkpoint_saves(lambda t: seen.append((tuple(t.shape), t.untyped_storage().data_ptr()))):
        out = ckpt.checkpoint(
            lambda a: torch.relu(a @ w).sum(),
            x,
            use_reentrant=False,
            context_fn=lambda: ckpt.create_selective_checkpoint_contexts(policy),
        )
    assert ckpt._VersionWrapper is base
    assert [s for s, _ in seen] == [(4, 8)]  # the mm's output only: relu and sum recompute
    out.backward()
    assert w.grad is not None


def test_when_all_grads_fires_once_after_the_last_and_keeps_no_gradient():
    """As torch's register_multi_grad_hook (mode "all"): once per backward, after the last
    gradient that backward makes (a tensor it does not reach is not waited for); unlike
    it, the first gradient is not kept until then."""
    x = torch.randn(8, 8, requires_grad=True)
    b = x.exp()
    a, unused = b * 2, x + 1  # a's gradient comes first, then b's (through a's node)
    first: list = []
    calls: list = []
    alive: list = []
    a.register_hook(lambda g: first.append(weakref.ref(g)))
    b.register_hook(lambda g: alive.append(first[0]() is not None))
    handle = _torch_compat.when_all_grads([a, b, unused], lambda: calls.append(len(first)))
    a.sum().backward(retain_graph=True)
    assert calls == [1]
    assert alive == [False]  # torch's own hook would hold it here
    handle.remove()
    a.sum().backward()
    assert calls == [1]


def test_grouped_query_attention_flops_where_torch_counts_equal_heads_only(monkeypatch):
    # torch 2.6 and 2.11's SDPA formulas refuse fewer key/value heads than query heads; memfit
    # broadcasts the heads there, which must count what this torch's own GQA formulas count.
    q, k, g = torch.empty(2, 8, 16, 32), torch.empty(2, 2, 16, 32), torch.empty(2, 8, 16, 32)
    native = (_torch_compat._cpu_sdpa_forward(q, k, k), _torch_compat._cpu_sdpa_backward(g, q, k, k))
    monkeypatch.setattr(_torch_compat, "_SDPA_GQA", False)
    assert (_torch_compat._cpu_sdpa_forward(q, k, k), _torch_compat._cpu_sdpa_backward(g, q, k, k)) == native
    assert native[0] == 2 * (2 * 2 * 8 * 16 * 32 * 16)  # two bmms over the query's 8 heads


def test_the_fast_cache_key_is_left_out_where_torch_prepares_its_key_otherwise(monkeypatch):
    # torch 2.6's _prep_args_for_hash takes no id_hashed_objects (and writes no list's length)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.compat import fake_key

    assert fake_key.fast_key_applies() == ("id_hashed_objects" in FakeTensorMode._prep_args_for_hash.__code__.co_varnames)
    monkeypatch.setattr(FakeTensorMode, "_prep_args_for_hash", lambda self, result, args, state: None)
    assert not fake_key.fast_key_applies()


def test_a_torch_without_fake_collectives_is_named_in_one_line(monkeypatch):
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    monkeypatch.setattr(_torch_compat, "_FAKE_COLLECTIVES", [])
    native = _torch_compat.fake_collectives_missing()
    if _torch_compat.torch_version() >= (2, 11):
        assert native is None  # 2.11 and 2.13 have them
    else:
        assert native is not None and "allreduce_" in native  # 2.6 has none
    monkeypatch.setattr(_torch_compat, "_FAKE_COLLECTIVES", [])
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda name, key: "allreduce" not in name)
    line = _torch_compat.fake_collectives_missing()
    assert line.startswith(f"torch {torch.__version__} has no fake kernels for c10d's collectives (allreduce_)")
    assert "\n" not in line
    try:
        try:
            raise UnsupportedOperatorException(torch.ops.c10d.allreduce_.default)
        except UnsupportedOperatorException as exc:
            raise RuntimeError("forward failed") from exc
    except RuntimeError as outer:
        assert _torch_compat.collective_refused(outer) == line
    assert _torch_compat.collective_refused(RuntimeError("c10d.allreduce_")) is None
