"""memfit: fit a PyTorch training step in a memory budget at the highest throughput.

Public API (everything else is internal)::

    import memfit
    prof = memfit.profile(model, inputs)            # where the memory of a step goes
    print(memfit.format_bytes(prof.peak_bytes))
"""

from memfit.errors import BudgetError, ForwardError, LossError, MemfitError, TargetError, WorkloadError
from memfit.measure.ledger import Block, Category, Ledger, Phase, Tick
from memfit.measure.profile import ModuleStats, Profile, profile
from memfit.units import format_bytes, parse_bytes
from memfit.workload import Workload, load_target

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # measure
    "profile",
    "Profile",
    "ModuleStats",
    "Ledger",
    "Block",
    "Tick",
    "Category",
    "Phase",
    # workloads
    "Workload",
    "load_target",
    # units
    "parse_bytes",
    "format_bytes",
    # errors
    "MemfitError",
    "TargetError",
    "WorkloadError",
    "ForwardError",
    "LossError",
    "BudgetError",
]
