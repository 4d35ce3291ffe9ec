"""NCCL's device memory outside the caching allocator (memfit.cuda.nccl): the formula's parts, read
from NCCL's source, and the environment variables that move them. Plain arithmetic: no torch."""

from __future__ import annotations

import pytest

from memfit.cuda import gpu, nccl
from memfit.cuda.nccl import Communicator, NcclConfigError, NcclSettings, settings_from_env

MiB = 2**20
H100, A100, L4 = nccl.TOPOLOGIES["H100-80GB"], nccl.TOPOLOGIES["A100-80GB"], nccl.topology("L4")


def parts(comm, topo=H100, **kw):
    return {p.name.split(":")[0].split(" (")[0]: p.bytes for p in nccl.communicator_parts(comm, topo, NcclSettings(**kw))}


def test_a_connection_pair_is_nccls_buffers_in_2_mib_granules():
    # NCCL's defaults: LL 512 KiB, LL128 4.6875 MiB, Simple 4 MiB (init.cc), and 4 KiB ncclRecvMem
    assert (nccl.LL_BUFFSIZE, nccl.LL128_BUFFSIZE) == (512 * 1024, 4_915_200)
    s = NcclSettings()
    # the receiver's 10 MiB and the sender's 2 MiB: the two sizes NCCL allocates in nccl#1685
    assert nccl.connection_pair_bytes(s) == 10 * MiB + 2 * MiB
    # P2P read (Ampere over NVLink): the Simple buffer on the sender, 6 + 6 MiB
    assert nccl.connection_pair_bytes(s, read=True) == 6 * MiB + 6 * MiB
    # NCCL_BUFFSIZE scales the Simple buffer: 16 MiB makes the receiver's 22 MiB (9.2 + 12 rounded up)
    assert nccl.connection_pair_bytes(NcclSettings(buffsize=16 * MiB)) == 22 * MiB + 2 * MiB
    assert nccl.connection_pair_bytes(NcclSettings(buffsize=1 * MiB, ll128_buffsize=0)) == 2 * MiB + 2 * MiB


def test_parts_of_one_communicator_by_algorithm():
    fsdp = parts(Communicator(8, 8, allreduce=False))
    assert fsdp == {
        "ring": 24 * 12 * MiB,
        "NVLS buffers": 16 * 2 * 1 * 8 * MiB,  # nvls channels x 2 x (128 KiB x 8 steps) x 8 ranks of the node
        "NVLS peer tables and credits": 17 * 2 * MiB,
        "bookkeeping": (32 * 3 + 2) * 2 * MiB,  # 3 blocks for each of 32 channels (p2p's, a power of 2), 2 more
    }
    # an all-reduce connects the tree too: another peer on each side, more than 2 ranks only
    assert parts(Communicator(8, 8))["tree"] == 24 * 12 * MiB
    assert "tree" not in parts(Communicator(2, 2))
    # before lazy connection (NCCL_RUNTIME_CONNECT=0, or no cuMem) the tree connects at init
    assert "tree" in parts(Communicator(8, 8, allreduce=False), runtime_connect=False)
    # no NVLS on A100s; over PCIe 2 channels
    assert "NVLS buffers" not in parts(Communicator(8, 8), A100)
    assert parts(Communicator(8, 8, allreduce=False), L4) == {"ring": 2 * 12 * MiB, "bookkeeping": 8 * 2 * MiB}
    # a pipeline's group: send/recv to its 2 neighbours on all 32 p2p channels (nccl#1685's 32 to a peer)
    pp = parts(Communicator(4, 4, allreduce=False, p2p_peers=2, collectives=False))
    assert pp == {"send/recv": 2 * 32 * 12 * MiB, "bookkeeping": 98 * 2 * MiB}
    # a group of one rank holds nothing
    assert nccl.communicator_parts(Communicator(1, 1), H100, NcclSettings()) == []


def test_channels_follow_nccls_variables():
    assert nccl.channel_counts(H100, NcclSettings()) == (24, 32)
    assert nccl.channel_counts(H100, NcclSettings(), across_nodes=True) == (16, 16)
    assert nccl.channel_counts(H100, NcclSettings(max_channels=4)) == (4, 4)
    assert nccl.channel_counts(L4, NcclSettings(min_channels=5)) == (5, 8)
    assert nccl.channel_counts(H100, NcclSettings(min_channels=200)) == (64, 64)
    # the ring's buffers scale with the channels and NCCL_BUFFSIZE
    few = parts(Communicator(8, 8, allreduce=False), max_channels=4)
    assert few["ring"] == 4 * 12 * MiB and few["bookkeeping"] == (4 * 3 + 2) * 2 * MiB
    big = parts(Communicator(8, 8, allreduce=False), buffsize=16 * MiB)
    assert big["ring"] == 24 * 24 * MiB
    # NVLS off, by its switch or by NCCL_ALGO; its channels by NCCL_NVLS_NCHANNELS
    assert "NVLS buffers" not in parts(Communicator(8, 8), nvls_enable=False)
    assert "NVLS buffers" not in parts(Communicator(8, 8), algorithms=frozenset({"ring", "tree"}))
    assert parts(Communicator(8, 8), nvls_channels=8)["NVLS buffers"] == 8 * 2 * 8 * MiB


def test_settings_from_the_environment():
    assert settings_from_env({}) == NcclSettings()
    s = settings_from_env(
        {
            "NCCL_BUFFSIZE": "0x800000",
            "NCCL_MAX_NCHANNELS": "8",
            "NCCL_ALGO": "^NVLS",
            "NCCL_PROTO": "LL,Simple",
            "NCCL_RUNTIME_CONNECT": "0",
            "NCCL_NVLS_ENABLE": "2",
            "PATH": "/bin",
        }
    )
    assert s.buffsize == 8 * MiB and s.max_channels == 8 and not s.runtime_connect and s.nvls_enable is None
    assert s.algorithms == frozenset(nccl.ALGORITHMS) - {"nvls"} and s.protocols == {"ll", "simple"}
    assert s.given == (
        "NCCL_BUFFSIZE",
        "NCCL_MAX_NCHANNELS",
        "NCCL_NVLS_ENABLE",
        "NCCL_RUNTIME_CONNECT",
        "NCCL_ALGO",
        "NCCL_PROTO",
    )
    # NCCL 2.24's per-collective form: what any collective may use
    assert settings_from_env({"NCCL_ALGO": "allreduce:tree,ring;allgather:ring"}).algorithms == {"tree", "ring"}
    est = gpu.nccl_estimate([Communicator(8, 8, allreduce=False)], gpu.GPUS["H100-80GB"], s)
    # 8 channels of (14 + 2) MiB pairs for the ring and, connected at init, the tree; no NVLS (^NVLS)
    assert "NCCL_BUFFSIZE" in est.source and est.bytes == 2 * 8 * 16 * MiB + (8 * 3 + 2) * 2 * MiB


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NCCL_BUFFSIZE": "4M"}, "NCCL_BUFFSIZE='4M' is not an integer"),
        ({"NCCL_MAX_NCHANNELS": "-1"}, "negative"),
        ({"NCCL_ALGO": "Ring,Butterfly"}, "'butterfly' is not one of NCCL's"),
        ({"NCCL_PROTO": "^LL,LL128,Simple"}, "names nothing"),
    ],
)
def test_a_bad_variable_is_one_line(env, message):
    with pytest.raises(NcclConfigError, match=message) as err:
        settings_from_env(env)
    assert "\n" not in str(err.value)


def test_a_ranks_communicators_from_its_mesh_and_its_device_fit():
    from types import SimpleNamespace

    from memfit.measure.distributed import nccl_communicators, nccl_outside, rank_device_fit
    from memfit.workload import Parallel

    def comms(n, **kw):
        return nccl_communicators(Parallel(lambda m, mesh: None, **kw), n)

    assert comms(8, name="fsdp2") == [Communicator(8, 8, allreduce=False)]
    assert comms(8, name="ddp") == [Communicator(8, 8)]
    assert comms(1, name="ddp") == []
    # FSDP2 over 32 ranks of 4 TP each: 8 dp ranks 4 apart, 2 of them on a node of 8 GPUs
    dp_tp = comms(32, mesh_shape=(-1, 4), mesh_dim_names=("dp", "tp"), name="fsdp2+tp")
    assert dp_tp == [Communicator(8, 2, allreduce=False), Communicator(4, 4)]
    hsdp = comms(16, mesh_shape=(2, 8), mesh_dim_names=("replicate", "shard"), name="hsdp")
    assert hsdp == [Communicator(2, 1), Communicator(8, 8, allreduce=False)]
    pp = comms(4, name="pp")
    assert pp == [Communicator(4, 4, allreduce=False, p2p_peers=2, collectives=False)]
    # torchtitan clips gradients: an all-reduce on every group, its pipeline's too
    tt = comms(16, mesh_shape=(2, 8), mesh_dim_names=("pp", "dp_shard"), name="torchtitan")
    assert tt == [Communicator(2, 1, allreduce=True, p2p_peers=2), Communicator(8, 8)]

    # a rank's fit against its GPU carries the estimate for its communicators, as a line of its own
    h100 = gpu.GPUS["H100-80GB"]
    parallel = Parallel(lambda m, mesh: None, mesh_shape=(-1, 4), mesh_dim_names=("dp", "tp"), name="fsdp2+tp")
    prof = SimpleNamespace(device="cuda:0", peak_bytes=10 * MiB, allocated_peak_bytes=10 * MiB, reserved_peak_bytes=12 * MiB)
    fit = rank_device_fit(prof, parallel, 32, None, h100)
    outside = {e.name: e.bytes for e in fit.outside}
    assert outside["nccl"] == nccl_outside(parallel, 32, h100, NcclSettings()).bytes > 0
    assert fit.headroom_bytes == h100.total_memory - 12 * MiB - outside["nccl"] - outside["cuda_context"]


def test_profile_ranks_refuses_a_bad_nccl_variable_before_any_rank_runs(monkeypatch):
    from memfit.measure import distributed
    from memfit.workload import Parallel, Workload

    def never(*args, **kwargs):
        raise AssertionError("a rank ran")

    monkeypatch.setattr(distributed, "rank_device", lambda fake: "cuda")
    monkeypatch.setattr(distributed, "_one_rank", never)
    monkeypatch.setenv("NCCL_BUFFSIZE", "4MB")
    import torch

    work = Workload(model=torch.nn.Linear(2, 2), inputs=(), parallel=Parallel(lambda m, mesh: None, name="fsdp2"))
    with pytest.raises(NcclConfigError, match="NCCL_BUFFSIZE='4MB' is not an integer"):
        distributed.profile_ranks(work, world_size=2, fake="cuda")
