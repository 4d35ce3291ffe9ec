import memfit

# The public surface, pinned: changing it is a deliberate act that edits this list.
EXPECTED = {
    "__version__",
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
    "plan",
    "Plan",
    "Choice",
    "Budget",
    "parse_budget",
    "apply",
    "remove",
    "mechanisms",
    "fit",
    "max_batch",
    "MaxBatch",
    "BatchLimit",
    "Recipe",
    "apply_recipe",
    "Workload",
    "Parallel",
    "load_target",
    "parse_bytes",
    "format_bytes",
    "MemfitError",
    "TargetError",
    "WorkloadError",
    "ForwardError",
    "LossError",
    "BudgetError",
    "BudgetInfeasibleError",
    "PlanError",
}


def test_all_is_pinned():
    assert set(memfit.__all__) == EXPECTED
    assert len(memfit.__all__) == len(EXPECTED)


def test_every_public_name_exists():
    for name in memfit.__all__:
        assert hasattr(memfit, name), name


def test_errors_share_one_base():
    for name in (n for n in EXPECTED if n.endswith("Error") and n != "MemfitError"):
        assert issubclass(getattr(memfit, name), memfit.MemfitError)


def test_budget_infeasible_is_a_value_error():
    assert issubclass(memfit.BudgetInfeasibleError, ValueError)
