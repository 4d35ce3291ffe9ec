"""One rule for a kernel's own scratch (measure.recorder.kernel_scratch), taken by the eager
recorder and by a compiled fake step (measure.compiled._Scratch), with their differences as
arguments: each argument changes the answer where it says, and only there."""

from __future__ import annotations

import pytest
import torch

from memfit.measure import recorder, workspace
from memfit.measure.compiled import _Scratch
from memfit.measure.recorder import kernel_scratch

aten = torch.ops.aten

EAGER = dict(inside=True, as_cuda=True, tensorless=False)
"""The eager fake recorder's arguments (besides table, attention, probe)."""
COMPILED = dict(inside=False, as_cuda=False, tensorless=True)


def _ask(func, args, *, table=None, attention=False, probe=False, **how):
    return kernel_scratch(func, args, {}, table=table, attention=attention, probe=probe, **(how or EAGER))


def test_no_kernel_ops_get_nothing_whatever_is_asked():
    x = torch.zeros(8, 8)
    table = workspace.WorkspaceTable()
    for func, args in ((aten.view.default, (x, [64])), (aten.detach.default, (x,)), (aten.select.int, (x, 0, 1))):
        table.record(workspace.signature(func, args, {}), 1 << 20)  # a figure there would be found if asked
        for how in (EAGER, COMPILED):
            assert _ask(func, args, table=table, attention=True, probe=True, **how) == (0, False)


def test_table_first_then_probe_then_none():
    x = torch.zeros(64, 64).t()  # a permuted input: LayerNorm copies it to a contiguous one first
    args = (x, [64], torch.zeros(64), torch.zeros(64), 1e-5)
    func = aten.native_layer_norm.default
    table = workspace.WorkspaceTable()
    assert _ask(func, args, table=table) == (None, False)  # no figure, no probe: unmeasured
    assert _ask(func, args, table=None, probe=True) == (None, False)  # no table: no probe either
    measured, estimated = _ask(func, args, table=table, probe=True)
    assert measured is not None and measured >= workspace.FLOOR_BYTES and not estimated
    assert table.get(workspace.signature(func, args, {})) == measured  # the probe taught the table
    table.record(workspace.signature(func, args, {}), measured + 4096)
    assert _ask(func, args, table=table, probe=True) == (measured + 4096, False)  # the table, not a new probe


def test_attention_backward_is_estimated_only_when_asked_and_the_table_has_no_figure():
    q = torch.zeros(2, 4, 128, 64)
    func = aten._scaled_dot_product_efficient_attention_backward.default
    args = (q, q, q, q, q, torch.zeros(2, 4, 128))  # grad_out, query, key, value, out, logsumexp: what the estimate reads
    nbytes, estimated = _ask(func, args, attention=True)
    assert estimated and nbytes == recorder._attention_backward_estimate(func.overloadpacket.__name__, args) > 0
    assert _ask(func, args, attention=False) == (None, False)
    table = workspace.WorkspaceTable()
    table.record(workspace.signature(func, args, {}), 12345)
    assert _ask(func, args, table=table, attention=True) == (12345, False)
    assert _ask(aten.mm.default, (q[0, 0], q[0, 0].t()), attention=True) == (None, False)  # only SDPA's backward


def test_a_factory_gets_nothing_only_where_tensorless_says_so():
    func, args = aten.empty.memory_format, ([16, 16],)
    assert _ask(func, args, **COMPILED) == (0, False)
    assert _ask(func, args, **EAGER) == (None, False)  # the eager recorder: as before, unmeasured without a figure


@torch.library.custom_op("memfit_scratch_test::inside", mutates_args=())
def _inside(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("memfit_scratch_test::as_cuda", mutates_args=())
def _as_cuda(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_ops_the_recorder_runs_itself_get_nothing_only_under_the_recorder(monkeypatch):
    # stand-ins for bitsandbytes' ops (importing it costs seconds): the rule reads the op's name only
    monkeypatch.setattr(recorder, "_RECORD_INSIDE_ON_CPU", recorder._RECORD_INSIDE_ON_CPU | {"memfit_scratch_test::inside"})
    monkeypatch.setattr(recorder, "_AS_CUDA_ALLOCATES", {**recorder._AS_CUDA_ALLOCATES, "memfit_scratch_test::as_cuda": _as_cuda})
    inside, as_cuda = torch.ops.memfit_scratch_test.inside.default, torch.ops.memfit_scratch_test.as_cuda.default
    monkeypatch.setattr(recorder, "_SCRATCH_KIND", {})
    x = torch.zeros(4, 4)
    assert recorder._scratch_kind(inside) == recorder._RUN_INSIDE
    assert recorder._scratch_kind(as_cuda) == recorder._RUN_AS_CUDA
    for func in (inside, as_cuda):
        assert _ask(func, (x,), **EAGER) == (0, False)
        assert _ask(func, (x,), **COMPILED) == (None, False)  # the compiled step's mode is off inside: the rule
    # the real eager recorder (as_cuda=False: the op runs as itself) measures an as-CUDA op
    assert _ask(as_cuda, (x,), inside=True, as_cuda=False, tensorless=False) == (None, False)
    assert _ask(inside, (x,), inside=True, as_cuda=False, tensorless=False) == (0, False)


@pytest.mark.parametrize("fake_cuda", [False, True])
def test_compiled_scratch_counts_what_the_rule_leaves_without_a_figure(fake_cuda):
    scratch = _Scratch(fake_cuda)
    x = torch.zeros(4, 4)
    assert scratch(aten.view.default, (x, [16]), {}) == 0 and scratch.unmeasured == 0
    assert scratch(aten.empty_strided.default, ([4], [1]), {}) == 0 and scratch.unmeasured == 0
    sig_args = (x, x)
    workspace.TABLE.record(workspace.signature(aten.mm.default, sig_args, {}), 8192)
    try:
        got = scratch(aten.mm.default, sig_args, {})
    finally:
        workspace.TABLE._bytes.pop(workspace.signature(aten.mm.default, sig_args, {}))
    # fake CUDA: the host's table is not asked, the op is unmeasured; fake CPU: the table's figure
    assert (got, scratch.unmeasured) == ((0, 1) if fake_cuda else (8192, 0))
