"""A compiled step run on fake tensors (issue 27 item 4): inductor compiles the step as it would
for real, its generated kernels are not run, and what its wrapper allocates is recorded
(memfit.compat.inductor_fake). The allocations must be the real compiled step's, and nothing of
the fake run may reach a compile of the user's."""

from __future__ import annotations

import torch
from torch import nn

from memfit import zoo
from memfit.compat import inductor_fake
from memfit.measure.checked import checked_step
from memfit.measure.compiled import profile_compiled_step


def test_the_private_corners_hold_on_this_torch():
    # fails when torch moves what the fake run needs: then memfit says so and runs the step for real
    assert inductor_fake.unavailable() is None
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache

    guards = torch._C._dynamo.guards
    before = [AsyncCompile.__dict__[n] for n in ("cpp_pybinding", "cpp")] + [guards._empty_strided_cpu, guards._reinterpret_tensor]
    with inductor_fake.stubbed_kernels():
        assert guards._empty_strided_cpu((2, 3), (3, 1), torch.float32).shape == (2, 3)
        assert not PyCodeCache.modules_no_attr
    after = [AsyncCompile.__dict__[n] for n in ("cpp_pybinding", "cpp")] + [guards._empty_strided_cpu, guards._reinterpret_tensor]
    assert all(a is b for a, b in zip(before, after)) and not PyCodeCache.modules_no_attr


def test_fake_compiled_step_allocates_what_the_real_one_does():
    """The same allocations, peak and saved set as the step compiled and run for real (torch's
    profiler reading the CPU allocator). The real step also allocates a few scalars of 4-8 bytes
    inside C++ that no op dispatches: up to 64 B apart (12 B on zoo mlp-deep). gpt, llama and
    resnet: ``python benchmarks/compile_fake.py`` (a compile each is too long for the suite)."""
    work = zoo.build("mlp-deep", depth=4)
    opt = work.make_optimizer()
    real = profile_compiled_step(checked_step(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt))
    fake = profile_compiled_step(checked_step(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt, fake=True))
    assert real.fallback is None and fake.fallback is None, fake.fallback
    assert (fake.graphs, fake.graph_breaks, fake.start_bytes) == (real.graphs, real.graph_breaks, real.start_bytes)
    assert abs(fake.step_peak_bytes - real.step_peak_bytes) <= 64, (fake.step_peak_bytes, real.step_peak_bytes)
    assert abs(fake.saved_bytes - real.saved_bytes) <= 64, (fake.saved_bytes, real.saved_bytes)
    assert fake.phase_peaks.keys() == real.phase_peaks.keys()
    assert all(abs(fake.phase_peaks[k] - v) <= 64 for k, v in real.phase_peaks.items()), (fake.phase_peaks, real.phase_peaks)
    assert fake.step_peak_bytes > 1 << 20  # a step of substance, not a rounding


def test_a_users_compile_after_the_fake_run_runs_its_real_kernels():
    """The user's compiled model from before keeps working, and a fresh compile of the same graph
    after memfit's fake one (the same generated source: the same module path) gets the real
    kernels: its output equals the one compiled before, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    x = torch.randn(32, 64)
    users = torch.compile(model)
    want = users(x)
    out = profile_compiled_step(checked_step(model, x, fake=True))
    assert out.fallback is None and out.step_peak_bytes > 0
    assert torch.equal(users(x), want)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(model)(x), want)
