"""memfit: fit a PyTorch training step in a memory budget at the highest throughput.

Public API (everything else is internal)::

    import memfit
    prof = memfit.profile(model, inputs)            # where the memory of a step goes
    plan = memfit.plan(model, inputs, "50%")        # what to recompute to fit a budget
    memfit.apply(model, plan)                       # in place, reversible: memfit.remove(model)
    recipe = memfit.fit(model, inputs, "6GiB")      # the fastest levers that fit (recompute, micro-batches, ...)
    big = memfit.max_batch(model, inputs, "6GiB")   # the largest batch that fits, and its recipe
    print(recipe.snippet()); run = memfit.apply_recipe(recipe, model, optimizer)
"""

# ruff: noqa: E402
# First, before anything imports torch: fake CUDA has to be loaded ahead of it (when asked for).
from memfit.cuda import fake as _fake_cuda

_fake_cuda.preload()

from memfit.api import fit, max_batch, plan, profile
from memfit.apply import apply, mechanisms, remove
from memfit.apply.recipe import apply_recipe
from memfit.errors import (
    BudgetError,
    BudgetInfeasibleError,
    ForwardError,
    LossError,
    MemfitError,
    PlanError,
    TargetError,
    WorkloadError,
)
from memfit.levers.max_batch import BatchLimit, MaxBatch
from memfit.levers.recipe import Recipe
from memfit.measure.compiled import CompiledProfile, fit_memory_budget, profile_compiled
from memfit.measure.ledger import Block, Category, Ledger, Phase, Tick
from memfit.measure.profile import ModuleStats, Profile
from memfit.measure.step import StepOptions
from memfit.plan.budget import Budget, parse_budget
from memfit.plan.result import Choice, Plan
from memfit.target import load_target
from memfit.units import format_bytes, parse_bytes
from memfit.workload import Parallel, Where, Workload

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
    "StepOptions",
    "profile_compiled",
    "CompiledProfile",
    "fit_memory_budget",
    # plan and apply
    "plan",
    "Plan",
    "Choice",
    "Budget",
    "parse_budget",
    "apply",
    "remove",
    "mechanisms",
    # every lever
    "fit",
    "Recipe",
    "apply_recipe",
    "max_batch",
    "MaxBatch",
    "BatchLimit",
    # workloads
    "Workload",
    "Parallel",
    "Where",
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
    "BudgetInfeasibleError",
    "PlanError",
]
