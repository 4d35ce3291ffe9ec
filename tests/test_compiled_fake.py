"""A compiled step run on fake tensors (issue 27 item 4): inductor compiles the step as it would
for real, its generated kernels are not run, and what its wrapper allocates is recorded
(memfit.compat.inductor_fake). The allocations must be the real compiled step's, and nothing of
the fake run may reach a compile of the user's."""

from __future__ import annotations

import json

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


def test_fake_compiled_step_counts_the_scratch_of_extern_kernels(monkeypatch):
    """oneDNN's convolution backward allocates scratch inside the kernel, which no op returns:
    the real compiled step's allocator shows it at the step's peak. The fake step counts it as
    memfit's eager fake profile does (the figure of its op kind, measured on zeros once), and
    equals the real step; without it, the fake step is under by the scratch (zoo resnet's was
    4 MiB, 1.3%, under before)."""
    from memfit.measure import compiled

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(2, 3, 32, 32)
    real = profile_compiled_step(checked_step(model, x))
    fake = profile_compiled_step(checked_step(model, x, fake=True))
    assert real.fallback is None and fake.fallback is None, fake.fallback
    assert abs(fake.step_peak_bytes - real.step_peak_bytes) <= 64, (fake.step_peak_bytes, real.step_peak_bytes)
    assert fake.phase_peaks.keys() == real.phase_peaks.keys()
    assert all(abs(fake.phase_peaks[k] - v) <= 64 for k, v in real.phase_peaks.items()), (fake.phase_peaks, real.phase_peaks)
    assert fake.saved_bytes == real.saved_bytes and fake.unmeasured_ops == 0
    monkeypatch.setattr(compiled._Scratch, "__call__", lambda self, func, args, kwargs: 0)
    bare = profile_compiled_step(checked_step(model, x, fake=True))
    assert real.step_peak_bytes - bare.step_peak_bytes > 4096, (bare.step_peak_bytes, real.step_peak_bytes)


ATTENTION_SCRIPT = """
import json, memfit, torch
import torch.nn.functional as F
from torch import nn
from memfit.measure.checked import checked_step
from memfit.measure.compiled import profile_compiled_step


class Attention(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.d = head_dim
        self.qkv = nn.Linear(16, 6 * head_dim)
        self.proj = nn.Linear(2 * head_dim, 16)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 2, self.d).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


out = {}
for case, head_dim, dtype, fake in [("efficient", 8, "float32", "cuda"), ("flash", 8, "bfloat16", "cuda"),
                                    ("math", 6, "float32", "cuda"), ("cpu", 8, "float32", True)]:
    torch.manual_seed(0)
    model = Attention(head_dim).to(getattr(torch, dtype))
    x = torch.randn(2, 256, 16, dtype=getattr(torch, dtype))
    p = profile_compiled_step(checked_step(model, x, loss_fn=lambda y: y.float().square().mean(), fake=fake))
    out[case] = {"fallback": p.fallback, "graphs": p.graphs, "saved": p.saved_bytes, "itemsize": x.element_size()}
print(json.dumps(out))
"""


def test_fake_cuda_compiled_attention_is_the_kernel_cuda_picks(fake_cuda):
    """On fake CUDA the step is compiled on host tensors; its attention is the kernel a CUDA
    build picks (memfit.cuda.fake.sdpa_kernel), so the partitioner saves what that kernel
    needs. Attention with dropout over 2 x 2 heads x 256 x 256: flash (bf16) and
    memory-efficient (fp32, head dim a multiple of 4) save the output, logsumexp and RNG
    state, never the T x T weights; math (fp32, head dim 6, which both fused kernels refuse)
    saves them, and so does a fake CPU step in the same process (the CPU's own choice with
    dropout: math)."""
    done = fake_cuda.script(ATTENTION_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for case, got in out.items():
        assert got["fallback"] is None and got["graphs"] == 1, (case, got)
        weights = 2 * 2 * 256 * 256 * got["itemsize"]  # one T x T tensor over batch and heads
        if case in ("flash", "efficient"):
            assert got["saved"] < weights / 2, (case, got)
        else:
            assert got["saved"] >= weights, (case, got)


FIRST_HOST_COMPILE = """
import json
import memfit
import torch
from torch._inductor.codecache import CacheBase
from memfit.measure.checked import checked_step
from memfit.measure.compiled import profile_compiled_step

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
x = torch.randn(8, 16)
out = {}
for fake in (True, False):
    CacheBase.get_system.cache_clear()  # as in a process whose first compile is this one
    p = profile_compiled_step(checked_step(model, x, fake=fake))
    out[str(fake)] = [p.fallback, p.graphs, p.step_peak_bytes]
print(json.dumps(out))
"""


def test_a_host_compile_works_with_fake_cuda_loaded(fake_cuda):
    """With fake CUDA loaded in the process (MEMFIT_FAKE_CUDA=1), a fake CPU or real CPU step
    compiles as it does without it. It failed in inductor's cache key, which reads the GPU's
    properties (``gcnArchName``, which the fake device lacks), unless a fake-CUDA compile had
    run first in the process."""
    done = fake_cuda.script(FIRST_HOST_COMPILE)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for fake, (fallback, graphs, peak) in out.items():
        assert fallback is None and graphs == 1 and peak > 0, (fake, out)
