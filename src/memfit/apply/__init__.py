"""Apply: the public verbs that put memfit's decisions on the user's model, in place and reversibly.

``apply(model, plan)`` / ``remove(model)`` for a :class:`~memfit.Plan`; ``apply_recipe``
(:mod:`memfit.apply.recipe`) for a :class:`~memfit.Recipe`. The mechanisms they use sit lower:
recompute and the KV cache switch in :mod:`memfit.recompute`, the training step in
:mod:`memfit.measure.step`. The top of the library with the integrations: it may import
every layer below it.
"""

from __future__ import annotations

from torch import nn

from memfit.errors import PlanError
from memfit.plan.result import Plan, check_fingerprint
from memfit.recompute.checkpoint import apply_choices, mechanisms, remove, unwrap

__all__ = ["apply", "remove", "mechanisms"]


def apply(model: nn.Module, plan: Plan, mechanism: str | None = None) -> nn.Module:
    """Recompute what ``plan`` says, in place; returns ``model``. Undo with :func:`remove`.

    Module names, ``state_dict`` keys, classes and hooks are unchanged. Raises PlanError if
    the plan was made for a model of another structure, or a plan is already applied.
    ``model`` may also be the model wrapped by ``torch.compile`` or DistributedDataParallel:
    the plan goes on the module inside (whose names it uses), and the wrapper is returned.
    The modules in ``plan.use_cache_off`` run with ``use_cache=False`` while training
    (transformers' KV cache, as its gradient checkpointing does; :mod:`memfit.recompute.cache`).

    ``mechanism`` says how selective choices run: ``"auto"`` through torch_remat where it is
    installed and the choice can be said in its regions (decided by the first step, which
    runs under today's selective-checkpoint policy), else that policy; ``"remat"`` insists
    on torch_remat (PlanError where it cannot); ``"sac"`` never uses it. None: the
    environment variable ``MEMFIT_RECOMPUTE`` if set, else ``"auto"``.
    :func:`mechanisms` says which each module got, and why.
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"apply needs a memfit.Plan, got {type(plan).__name__}")
    if not isinstance(model, nn.Module):
        raise PlanError(f"apply needs a torch.nn.Module, got {type(model).__name__}")
    inner = unwrap(model)
    check_fingerprint(inner, plan.fingerprint, plan.model_type, "plan", "make a plan for it with memfit.plan")
    apply_choices(inner, {name: (c.mode, c.save_ops) for name, c in plan.checkpointed.items()}, plan.use_cache_off, mechanism)
    return model
