"""memfit.cuda.gpu: the GPU table, cuBLAS's workspace size by generation, the fits answer."""

from __future__ import annotations

import pytest

from memfit.cuda import gpu


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((7, 0), 8_519_680), ((8, 0), 8_519_680), ((8, 9), 8_519_680), ((9, 0), 32 * 2**20), ((10, 0), 32 * 2**20)],
)
def test_cublas_workspace_by_generation(capability, expected):
    assert gpu.cublas_workspace_bytes(capability, config="") == expected


def test_cublas_workspace_config_overrides():
    assert gpu.cublas_workspace_bytes((9, 0), config=":4096:8") == 32 * 2**20
    assert gpu.cublas_workspace_bytes((8, 0), config=":16:8") == 16 * 1024 * 8
    assert gpu.cublas_workspace_bytes((8, 0), config=":4096:2:16:8") == 8_519_680


def test_find_gpu_ignores_case_and_punctuation_and_names_the_known_ones():
    assert gpu.find_gpu("rtx 4090").capability == (8, 9)
    assert gpu.find_gpu("NVIDIA L4").key == "L4"
    with pytest.raises(gpu.GpuError, match="known: H100-80GB, A100-80GB"):
        gpu.find_gpu("A100-20GB")


def test_device_fit_arithmetic_and_the_reserved_peak_slot():
    spec = gpu.GPUS["L4"]
    fit = gpu.device_fit(10 * 2**30, gpu=spec)
    assert fit.capacity_bytes == spec.total_memory and fit.basis == "peak_bytes"
    assert fit.headroom_bytes == spec.total_memory - gpu.CUDA_CONTEXT.bytes - 10 * 2**30 and fit.fits
    later = gpu.device_fit(10 * 2**30, gpu=spec, reserved_peak_bytes=spec.total_memory)
    assert later.basis == "reserved_peak_bytes" and later.headroom_bytes == -gpu.CUDA_CONTEXT.bytes and not later.fits
    assert gpu.DeviceFit.from_dict(later.to_dict()) == later
    cpu = gpu.device_fit(100, capacity_bytes=100, cuda=False)
    assert cpu.outside == () and cpu.headroom_bytes == 0 and cpu.fits


def test_attention_backward_temporaries_follow_torchs_allocations():
    flash = "_scaled_dot_product_flash_attention_backward"
    kw = dict(batch=2, heads=8, heads_kv=8, seq_q=1000, seq_k=1000, head_dim=80, itemsize=2, grad_out_copy=False)
    # softmax_d (2, 8, 1024) float32 and dq_accum (2, 1024, 8, 96) float32
    assert gpu.attention_backward_bytes(flash, **kw) == 2 * 8 * 1024 * 4 + 2 * 1024 * 8 * 96 * 4
    # head_dim past 128 rounds to 64; a non-contiguous output gradient is copied; GQA expands dK and dV
    wide = {**kw, "head_dim": 136}
    assert gpu.attention_backward_bytes(flash, **wide) == 2 * 8 * 1024 * 4 + 2 * 1024 * 8 * 192 * 4
    copy = 2 * 1000 * 8 * 80 * 2
    assert (
        gpu.attention_backward_bytes(flash, **{**kw, "grad_out_copy": True}) == gpu.attention_backward_bytes(flash, **kw) + copy
    )
    gqa = gpu.attention_backward_bytes(flash, **{**kw, "heads_kv": 2})
    assert gqa == gpu.attention_backward_bytes(flash, **kw) + 2 * (2 * 1000 * 8 * 80 * 2)
    eff = "_scaled_dot_product_efficient_attention_backward"
    # delta (2, 8, 1000) float32 and one workspace: the dQ accumulator, seq and dim to 64
    assert gpu.attention_backward_bytes(eff, **kw) == 2 * 8 * 1000 * 4 + 2 * 8 * 1024 * 128 * 4
    # past head_dim 128 the dK and dV accumulators join the same workspace
    assert gpu.attention_backward_bytes(eff, **wide) == 2 * 8 * 1000 * 4 + 3 * 2 * 8 * 1024 * 192 * 4
    with pytest.raises(ValueError, match="not an attention backward op"):
        gpu.attention_backward_bytes("mm", **kw)


def test_nccl_estimate_per_communicator_and_none_for_one_process():
    from memfit.cuda.nccl import Communicator

    MiB = 2**20
    assert gpu.nccl_estimate().bytes == 0 and gpu.nccl_estimate([Communicator(1, 1)]).bytes == 0
    a100 = gpu.GPUS["A100-80GB"]
    two = gpu.nccl_estimate([Communicator(2, 2, allreduce=False)], a100)
    # the ring's 24 channels x (10 + 2) MiB, and 3 blocks of 2 MiB for each of 32 channels, 2 more
    assert two.bytes == 24 * 12 * MiB + 98 * 2 * MiB
    both = gpu.nccl_estimate([Communicator(2, 2, allreduce=False)] * 2, a100)
    assert both.bytes == 2 * two.bytes and both.source.count("2 ranks: ring 288 + bookkeeping 196 = 484 MiB") == 2
    assert "estimate" in two.source and "nccl-tests#100" in two.source and "24 channels" in two.source
    # a real GPU's spec is keyed by the name torch reports: the same board
    named = gpu.GpuSpec(a100.name, a100.name, a100.total_memory, a100.capability, a100.multi_processor_count)
    assert gpu.nccl_estimate([Communicator(2, 2, allreduce=False)], named).bytes == two.bytes


def test_cuda_rates_follow_the_gpus_datasheet():
    from memfit.plan.candidates import DeviceRates

    h100 = DeviceRates.for_device("cuda")
    assert DeviceRates.for_device("cuda", gpu.GPUS["H100-80GB"]) == h100  # the round figures are an H100's
    t4 = DeviceRates.for_device("fake:cuda:0", gpu.GPUS["T4"])
    assert t4.flops_per_s < h100.flops_per_s and t4.bytes_per_s < h100.bytes_per_s
    # a T4's float32 is an eighth of its tensor cores' rate, an H100's a fifteenth
    assert 1.0 < t4.fp32_slower < h100.fp32_slower
    # no datasheet figures (AWS's A10G): an H100's rates, not made-up ones
    assert gpu.datasheet(gpu.GPUS["A10G"]) is None and DeviceRates.for_device("cuda", gpu.GPUS["A10G"]) == h100
    # a real GPU as torch describes it is found by its name
    real = gpu.GpuSpec("Tesla T4", "Tesla T4", 15 * 2**30, (7, 5), 40)
    assert DeviceRates.for_device("cuda", real) == t4
