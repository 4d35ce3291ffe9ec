"""A compiled step on fake CUDA compiled to inductor's CUDA (Triton) code, its kernels never
compiled or run (memfit.compat.triton_fake; issue 27 item 4): the buffers are the ones a GPU
build's wrapper allocates, not the host's C++ code's. Without Triton installed memfit measures
the host's code, labelled; the test of the Triton path needs Triton (see its skip reason)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memfit
from memfit.compat import triton_fake


def test_the_private_corners_of_torch_hold():
    # fails when torch moves a name cuda_codegen patches: memfit then measures the host's code
    assert triton_fake.torch_lacks() == []


def test_misaligned_inputs_are_copied_as_on_a_gpu():
    """Inductor's CUDA wrapper copies an input whose address is not 16-byte aligned (C++, reading
    the address, which a fake tensor lacks); memfit decides by the offset into the storage, whose
    start a caching allocator aligns, and copies as inductor does (strides kept)."""
    import torch

    base = torch.arange(40.0).view(4, 10)
    aligned, misaligned = base[:, 4:], base[:, 1:]  # 16 and 4 bytes into the storage
    assert triton_fake._copy_if_misaligned(aligned) is aligned
    copy = triton_fake._copy_if_misaligned(misaligned)
    assert copy.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert copy.stride() == misaligned.stride() and torch.equal(copy, misaligned)


TRITON_SCRIPT = """
import json
import memfit
import torch
from torch import nn
from memfit.compat import triton_fake
from memfit.measure.compiled import profile_compiled



class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 1030), nn.Linear(1030, 8)

    def forward(self, x):  # a constant, which inductor's constant folding runs on its device
        return self.b(nn.functional.gelu(self.a(x)) * torch.full((1030,), 0.5, device=x.device))


torch.manual_seed(0)
model = Net()
x = torch.randn(64, 64)
out = {"unavailable": triton_fake.unavailable()}
from triton.runtime.driver import driver
from torch._inductor.async_compile import AsyncCompile
before = (driver._active, AsyncCompile.__dict__["triton"])
p = profile_compiled(model, x, fake="cuda")
out["triton"] = [p.code, p.label, p.fallback, p.graphs, p.saved_bytes]
out["restored"] = [
    (driver._active, AsyncCompile.__dict__["triton"]) == before,
    torch.utils._triton.has_triton(),
    hasattr(torch._C, "_cuda_getCurrentRawStream"),
    torch._dynamo.device_interface.CudaInterface.is_available(),
]
triton_fake.unavailable = lambda: "hidden by the test"
p = profile_compiled(model, x, fake="cuda")
out["host"] = [p.code, p.label, p.fallback, p.graphs, p.saved_bytes]
print(json.dumps(out))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install triton): fake CUDA then measures inductor's host code",
)
def test_fake_cuda_compiles_inductors_triton_code(shim_cache):
    """The forward of Linear(64, 1030), GELU times a constant, Linear(1030, 8) at 64 rows leaves
    two 64 x 1030 fp32 tensors for backward (the first linear's output and the product, whose
    constant inductor folds on the host: a CPU build cannot run it on CUDA). Inductor's GPU code pads
    their rows to 128 bytes (``config.comprehensive_padding``, 1,056 floats a row), which it
    turns off for a graph without GPU tensors: so the Triton code saves 2 x (63 x 1,056 + 1,030)
    x 4 B, the host's C++ code 2 x 64 x 1,030 x 4 B (each with the 64 x 8 output and the loss).
    Everything the adapter patched is put back afterwards."""
    src = str(Path(memfit.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "MEMFIT_FAKE_CUDA": "1", "MEMFIT_CACHE_DIR": str(shim_cache), "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["unavailable"] is None
    rest = 64 * 8 * 4 + 4  # the output and the loss
    code, label, fallback, graphs, saved = out["triton"]
    assert (code, fallback, graphs) == ("triton", None, 1) and "Triton code" in label, out
    assert saved == 2 * (63 * 1056 + 1030) * 4 + rest, out
    assert out["restored"] == [True, False, False, False], out
    code, label, fallback, graphs, saved = out["host"]
    assert (code, fallback, graphs) == ("c++", None, 1) and "C++ code" in label, out
    assert saved == 2 * 64 * 1030 * 4 + rest, out


def test_fake_cuda_answers_the_device_guard_of_inductors_cuda_wrapper(fake_cuda):
    """Inductor's CUDA wrapper runs its call under ``torch.cuda._DeviceGuard(0)``, which a CPU
    build refuses ("compiled without CUDA support"); fake CUDA answers for its one device."""
    done = fake_cuda.script(
        "import torch\n"
        "with torch.cuda._DeviceGuard(0), torch.cuda.device(0):\n"
        "    print(torch.cuda._exchange_device(0), torch.cuda._maybe_exchange_device(-1))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "-1"], done.stdout
