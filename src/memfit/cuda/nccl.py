"""NCCL's device memory outside the caching allocator, per communicator: plain data, no torch.

A stated estimate, from NCCL's source (NVIDIA/nccl 2.30.7; what changed since 2.18 is said where
it matters) and the environment variables a job sets. What a communicator allocates on a rank:

- **connections**: for each channel and each peer it exchanges data with, the receiving rank holds
  one buffer per protocol, ``NCCL_LL_BUFFSIZE`` (512 KiB) + ``NCCL_LL128_BUFFSIZE`` (4.6875 MiB) +
  ``NCCL_BUFFSIZE`` (Simple, 4 MiB), with a 4 KiB ``ncclRecvMem``, and the sending rank a 4 KiB
  ``ncclSendMem`` (``transport/p2p.cc`` ``p2pRecvSetup``/``p2pSendSetup``). Each is rounded up to
  2 MiB (``CUDA_IPC_MIN``, and cuMem's granularity). So a connection pair is 10 + 2 MiB by default;
  on Ampere over NVLink (P2P read) the Simple buffer moves to the sender: 6 + 6 MiB. Every protocol's
  buffer is allocated whatever ``NCCL_PROTO`` says.
- **which connections**: the ring's (previous and next rank) on every channel; the tree's
  (another peer on each side) when the communicator all-reduces and has more than 2 ranks (with 2
  the tree's peers are the ring's and its connections are shared); ``channels per peer`` for each
  send/recv peer (pipeline parallelism). Since NCCL 2.22 (``NCCL_RUNTIME_CONNECT=1``, with cuMem)
  an algorithm connects at its first use; before, or with ``NCCL_RUNTIME_CONNECT=0``, ring and tree
  connect at init.
- **NVLink SHARP** (NVLS: H100-class GPUs on an NVSwitch): ``nvls channels x 2 x NVLS_CHUNKSIZE
  (128 KiB) x 8 steps x its ranks on the node``, 16 channels on sm90: 256 MiB for 8 ranks
  (``transport/nvls.cc`` ``ncclNvlsBufferSetup``; 2.18 to 2.20 used ``NCCL_BUFFSIZE`` + 2 MiB per
  1 MiB here, 1.5 GiB; 2.21 1 + 2 MiB), plus a 2 MiB credit block and one 2 MiB peer table per
  NVLS channel.
- **bookkeeping**: with cuMem each ``ncclCudaCalloc`` takes a whole 2 MiB granule: three per
  channel set up at init (``channel.cc``: the peer tables and the ring's ranks, for
  ``max(channels, p2p channels)`` channels) and two per communicator (``ncclDevComm`` and its
  rank table). Its work FIFO and proxy state are in host memory.

The channel count is the topology's: NCCL searches the node's links at init. memfit takes what
public logs show on each GPU's usual board (:data:`TOPOLOGIES`), moved by ``NCCL_MIN_NCHANNELS``
and ``NCCL_MAX_NCHANNELS`` as NCCL moves it. Variables are read once, by :func:`settings_from_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from memfit.errors import MemfitError

__all__ = [
    "NcclConfigError",
    "NcclSettings",
    "settings_from_env",
    "Topology",
    "TOPOLOGIES",
    "topology",
    "Communicator",
    "Part",
    "communicator_parts",
    "connection_pair_bytes",
]

KiB, MiB = 1024, 1024**2
GRANULE = 2 * MiB
"""``CUDA_IPC_MIN`` (``include/comm.h``), which p2p buffers are aligned to, and cuMem's minimum
allocation granularity on A100 and H100 (``ncclCuMemAlloc`` rounds every allocation up to it)."""
STEPS = 8  # NCCL_STEPS (include/device.h)
MEM_ALIGN = 4096  # sizeof(ncclSendMem) == sizeof(ncclRecvMem) (include/comm.h)
LL_BUFFSIZE = 8 * 512 * STEPS * 16
"""``DEFAULT_LL_BUFFSIZE`` (init.cc): lines per thread x LL threads x steps x 16 B lines: 512 KiB."""
LL128_BUFFSIZE = 120 * 640 * STEPS * 8
"""``DEFAULT_LL128_BUFFSIZE`` (init.cc): elements per thread x LL128 threads x steps x 8 B: 4.6875 MiB."""
SIMPLE_BUFFSIZE = 4 * MiB  # DEFAULT_BUFFSIZE (init.cc), NCCL_BUFFSIZE
MAX_CHANNELS = 64  # MAXCHANNELS (include/device.h; 32 before 2.25)
NVLS_CHUNKSIZE = 128 * KiB  # NCCL_NVLS_CHUNKSIZE's default (transport/nvls.cc)
ALGORITHMS = ("ring", "tree", "nvls", "nvlstree", "collnetdirect", "collnetchain", "pat")
PROTOCOLS = ("ll", "ll128", "simple")


class NcclConfigError(MemfitError, ValueError):
    """An NCCL environment variable memfit cannot read."""


def _up(n: int, m: int = GRANULE) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class NcclSettings:
    """The NCCL variables that move its device memory, as the job's environment sets them (None:
    NCCL's default)."""

    buffsize: int = SIMPLE_BUFFSIZE
    ll_buffsize: int = LL_BUFFSIZE
    ll128_buffsize: int = LL128_BUFFSIZE
    min_channels: int | None = None
    max_channels: int | None = None
    min_p2p_channels: int | None = None
    max_p2p_channels: int | None = None
    nvls_enable: bool | None = None
    """``NCCL_NVLS_ENABLE``: None (2, NCCL's default) where the hardware has it."""
    nvls_channels: int | None = None
    nvls_chunksize: int = NVLS_CHUNKSIZE
    algorithms: frozenset[str] | None = None
    """``NCCL_ALGO``: the algorithms any collective may use; None: all."""
    protocols: frozenset[str] | None = None
    """``NCCL_PROTO``: read and checked; it changes no buffer (each connection holds all three)."""
    runtime_connect: bool = True
    cumem: bool = True
    given: tuple[str, ...] = field(default=())
    """The variables the environment set, for the estimate's reason."""

    def uses(self, algorithm: str) -> bool:
        return self.algorithms is None or algorithm in self.algorithms


_INTS = {
    "NCCL_BUFFSIZE": "buffsize",
    "NCCL_LL_BUFFSIZE": "ll_buffsize",
    "NCCL_LL128_BUFFSIZE": "ll128_buffsize",
    "NCCL_MIN_NCHANNELS": "min_channels",
    "NCCL_MAX_NCHANNELS": "max_channels",
    "NCCL_MIN_P2P_NCHANNELS": "min_p2p_channels",
    "NCCL_MAX_P2P_NCHANNELS": "max_p2p_channels",
    "NCCL_NVLS_NCHANNELS": "nvls_channels",
    "NCCL_NVLS_CHUNKSIZE": "nvls_chunksize",
}
_FLAGS = {"NCCL_NVLS_ENABLE": "nvls_enable", "NCCL_RUNTIME_CONNECT": "runtime_connect", "NCCL_CUMEM_ENABLE": "cumem"}


def _int(name: str, text: str) -> int:
    # NCCL reads its integer variables with strtoll(value, NULL, 0): decimal, 0x hex or 0 octal
    try:
        value = int(text.strip(), 0)
    except ValueError:
        raise NcclConfigError(
            f"{name}={text!r} is not an integer: NCCL takes a plain number (bytes or a count), e.g. 4194304"
        ) from None
    if value < 0:
        raise NcclConfigError(f"{name}={text!r} is negative; give 0 or more")
    return value


def _names(name: str, text: str, known: Sequence[str]) -> frozenset[str]:
    """``NCCL_ALGO``/``NCCL_PROTO``: a list (``Ring,Tree``), its complement (``^NVLS``), or per
    collective (``allreduce:tree,ring;allgather:ring``, 2.24+): what any collective may use."""
    chosen: set[str] = set()
    for part in filter(None, (p.strip() for p in text.split(";"))):
        names = part.split(":", 1)[-1].strip()
        exclude = names.startswith("^")
        listed = {n.strip().lower() for n in names.lstrip("^").split(",") if n.strip()}
        bad = sorted(listed - set(known))
        if bad:
            raise NcclConfigError(f"{name}={text!r}: {bad[0]!r} is not one of NCCL's ({', '.join(known)})")
        chosen |= set(known) - listed if exclude else listed
    if not chosen:
        raise NcclConfigError(f"{name}={text!r} names nothing: give a list such as {known[0]},{known[1]}")
    return frozenset(chosen)


def settings_from_env(environ: Mapping[str, str] | None = None) -> NcclSettings:
    """The NCCL variables of ``environ`` (default the process's), read once where an estimate is
    made; a bad value is a one-line :class:`NcclConfigError`."""
    env = os.environ if environ is None else environ
    kw: dict[str, object] = {}
    given = [var for var in (*_INTS, *_FLAGS, "NCCL_ALGO", "NCCL_PROTO") if env.get(var, "").strip()]
    for var in given:
        if var in _INTS:
            kw[_INTS[var]] = _int(var, env[var])
        elif var in _FLAGS:
            # NCCL_NVLS_ENABLE=2 is NCCL's own choice, as unset
            value = _int(var, env[var])
            kw[_FLAGS[var]] = None if var == "NCCL_NVLS_ENABLE" and value == 2 else value != 0
        elif var == "NCCL_ALGO":
            kw["algorithms"] = _names(var, env[var], ALGORITHMS)
        else:
            kw["protocols"] = _names(var, env[var], PROTOCOLS)
    return NcclSettings(**kw, given=tuple(given))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Topology:
    """What NCCL finds on a GPU's usual board: the channel count of its rings and trees, its
    send/recv channels per peer, whether p2p uses reads (Ampere over NVLink: ``paths.cc``), and
    NVLink SHARP (NVSwitch with multicast)."""

    channels: int
    p2p_per_peer: int | None
    """Send/recv channels to one peer; None: all the p2p channels (NVSwitch)."""
    p2p_read: bool
    nvls_channels: int
    """0: no NVLS (NVLS_NCHANNELS_SM90 is 16)."""
    source: str
    net_channels: int | None = None
    """Channels of a communicator that spans nodes (None: :attr:`channels`)."""


_NVSWITCH = "24 channels, as NCCL's logs show on 8-GPU NVSwitch boards"
TOPOLOGIES: dict[str, Topology] = {
    # nccl#1259: "Channel 16/24" on 8 H100s with NVLS; nccl#1685: 32 channels (all of them) to each send/recv peer
    # across nodes, 16 (nccl#1453: 24 H100s on 3 nodes, "Channel 00/16"; nccl#1357: 2 nodes)
    "H100-80GB": Topology(24, None, False, 16, _NVSWITCH + " (nccl#1259), 16 across nodes (nccl#1453)", 16),
    # nccl-tests#100 ("Channel 19/24", HGX A100) and nccl#578 (24 rings on 4 of 8 A100s on NVSwitch)
    "A100-80GB": Topology(24, None, True, 0, _NVSWITCH + " (nccl-tests#100)"),
    "A100-40GB": Topology(24, None, True, 0, _NVSWITCH + " (nccl-tests#100)"),
    # nccl#713: 4 V100s, 2 NVLinks a pair: NCCL's ring graph holds 6 channels
    "V100-16GB": Topology(6, 2, False, 0, "6 channels, as NCCL's graph shows on 4 NVLinked V100s (nccl#713)"),
}
PCIE = Topology(2, 2, False, 0, "2 channels, as NCCL's logs show over PCIe (nccl#1358), 2 per send/recv peer")
"""Cards without NVLink (L40S, L4, A10G, RTX, T4): 2 channels, 2 per peer (nccl#1189, #1706)."""


def topology(key: str | None) -> Topology:
    """:data:`TOPOLOGIES`' entry for a ``--gpu`` key (None: H100-80GB, what fake CUDA simulates by
    default); a GPU not listed is taken over PCIe (:data:`PCIE`)."""
    return TOPOLOGIES["H100-80GB"] if key is None else TOPOLOGIES.get(key, PCIE)


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator as one of its ranks sees it."""

    ranks: int
    local_ranks: int
    """Its ranks on this rank's node (NVLS spans those)."""
    allreduce: bool = True
    """It all-reduces (DDP, HSDP's replicate group, TP, gradient clipping): the tree may connect."""
    p2p_peers: int = 0
    """Send/recv peers (a pipeline stage: the previous and the next)."""
    collectives: bool = True
    """False: only send/recv (a pipeline's group): no ring."""


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int


def connection_pair_bytes(s: NcclSettings, read: bool = False) -> int:
    """A rank's share of the connections to one peer on one channel: the buffers it receives into
    and the small block it sends from, each rounded to 2 MiB; with P2P read the Simple buffer is on
    the sending side (``p2p.cc``)."""
    if read:
        return _up(MEM_ALIGN + s.ll_buffsize + s.ll128_buffsize) + _up(MEM_ALIGN + s.buffsize)
    return _up(MEM_ALIGN + s.ll_buffsize + s.ll128_buffsize + s.buffsize) + _up(MEM_ALIGN)


def channel_counts(topo: Topology, s: NcclSettings, across_nodes: bool = False) -> tuple[int, int]:
    """Ring/tree channels and p2p channels (``paths.cc`` ``ncclTopoComputeP2pChannels``: clamped,
    then a power of two), for a communicator within a node or ``across_nodes``."""
    c = topo.net_channels if across_nodes and topo.net_channels else topo.channels
    c = max(c, s.min_channels or 0)
    c = max(1, min(c, s.max_channels or MAX_CHANNELS, MAX_CHANNELS))
    p = min(c, s.max_p2p_channels or MAX_CHANNELS)
    p = max(p, s.min_p2p_channels or 1)
    p = min(1 << (p - 1).bit_length(), MAX_CHANNELS)
    return c, p


def _nvls_parts(comm: Communicator, topo: Topology, s: NcclSettings) -> list[Part]:
    """NVLS's buffers, peer tables and credits, where the GPUs have it and nothing turned it off
    (``NCCL_NVLS_ENABLE=0``, or an ``NCCL_ALGO`` without it); it spans the ranks of one node."""
    nvls = topo.nvls_channels if s.nvls_channels is None else s.nvls_channels
    if not (comm.collectives and topo.nvls_channels and nvls and comm.local_ranks >= 2):
        return []
    # NVLSTree is NVLS across nodes: within one node only NVLS itself uses the buffers
    wanted = s.uses("nvls") or (s.uses("nvlstree") and comm.ranks > comm.local_ranks)
    if s.nvls_enable is False or not wanted:
        return []
    buffers = _up(nvls * 2 * s.nvls_chunksize * STEPS * comm.local_ranks)
    step = s.nvls_chunksize * STEPS // KiB
    return [
        Part(f"NVLS buffers ({nvls} channels x 2 x {step} KiB x {comm.local_ranks} ranks)", buffers),
        Part(f"NVLS peer tables and credits ({nvls} + 1 x 2 MiB)", (nvls + 1) * GRANULE),
    ]


def communicator_parts(comm: Communicator, topo: Topology, s: NcclSettings) -> list[Part]:
    """What one rank of ``comm`` holds outside the allocator once its collectives have run, part by
    part; none for a communicator of one rank."""
    if comm.ranks <= 1:
        return []
    across = comm.ranks > comm.local_ranks
    channels, p2p = channel_counts(topo, s, across)
    pair = connection_pair_bytes(s, read=topo.p2p_read and not across)
    parts = []
    if comm.collectives and s.uses("ring"):
        parts.append(Part(f"ring: {channels} channels x 1 peer pair x {pair // MiB} MiB", channels * pair))
    tree_at_init = not (s.runtime_connect and s.cumem)
    if comm.collectives and comm.ranks > 2 and s.uses("tree") and (comm.allreduce or tree_at_init):
        parts.append(Part(f"tree: {channels} channels x 1 more peer pair x {pair // MiB} MiB", channels * pair))
    parts += _nvls_parts(comm, topo, s)
    if comm.p2p_peers:
        per_peer = min(p2p, topo.p2p_per_peer or p2p)
        peers = min(comm.p2p_peers, comm.ranks - 1)
        parts.append(Part(f"send/recv: {peers} peers x {per_peer} channels x {pair // MiB} MiB", peers * per_peer * pair))
    if s.cumem:
        parts.append(
            Part(f"bookkeeping: {max(channels, p2p)} channels x 3 + 2 blocks of 2 MiB", (max(channels, p2p) * 3 + 2) * GRANULE)
        )
    return parts
