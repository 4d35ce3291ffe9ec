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
    "Where",
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


def test_no_signature_takes_fake_as_bool_or_str():
    """``fake=`` is three states (real, fake on the model's device, fake CUDA): read once into
    a :class:`memfit.Where` where a step comes in. A signature may keep the old spellings for
    its callers only beside ``Where`` (the public functions), never ``bool | str`` alone."""
    import ast
    from pathlib import Path

    bad = []
    for path in Path(memfit.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    if "str" in text.split(" | ") and "bool" in text.split(" | ") and "Where" not in text:
                        bad.append(f"{path.name}:{node.lineno} {node.name}({arg.arg}: {text})")
    assert not bad, bad
