"""Bad input, all in one place: each gives a clear error (a :class:`memfit.MemfitError`
whose message names what is wrong) and leaves the model and optimizer as they were.

Walks the list: budgets that do not parse, are negative, NaN, above 100% or below the
lowest reachable peak; inputs the model cannot take; losses that are not a scalar with
grad; a model on another device than its inputs (or on several); a plan or profile made
for another model; applying twice and removing what is not applied; plan JSON that is
corrupt or from a newer memfit; and the CLI's one-line errors for bad budgets.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from conftest import TinyNet, assert_same, make_plan, snapshot
from torch import nn

import memfit
from memfit import (
    Budget,
    BudgetError,
    BudgetInfeasibleError,
    Choice,
    ForwardError,
    LossError,
    MemfitError,
    Plan,
    PlanError,
    StepOptions,
    WorkloadError,
    parse_budget,
)
from memfit.cli import main
from memfit.compat import torch_compat
from memfit.recompute.checkpoint import applied_choices


@pytest.fixture
def step():
    """A model with buffers and dropout, its inputs, and an optimizer that has state."""
    torch.manual_seed(0)
    model, x = TinyNet(width=16), torch.randn(8, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, x, opt


def _refused(step, error: type[MemfitError], match: str, *, inputs=None, **plan_kwargs) -> MemfitError:
    """memfit.plan on ``step`` raises ``error`` matching ``match`` and changes nothing."""
    model, x, opt = step
    plan_kwargs.setdefault("budget", 0.5)
    plan_kwargs.setdefault("optimizer", opt)
    before = snapshot(model, opt)
    with pytest.raises(error, match=match) as info:
        memfit.plan(model, x if inputs is None else inputs, **plan_kwargs)
    assert isinstance(info.value, MemfitError)
    assert "\n" not in str(info.value)
    assert applied_choices(model) is None
    assert_same(before, snapshot(model, opt))
    return info.value


# -- budgets -------------------------------------------------------------------------------------

_UNPARSABLE = "cannot parse byte amount"
_FRACTION = r"fraction must be in \[0, 1\]"

BAD_BUDGETS = [
    ("6 GB of RAM", _UNPARSABLE + " '6 GB of RAM'"),
    ("abc", _UNPARSABLE + " 'abc'"),
    ("", _UNPARSABLE),
    ("nan", _UNPARSABLE + " 'nan'"),
    ("1.2.3GB", _UNPARSABLE),
    ("6 GiBs", _UNPARSABLE),
    (-1, "bytes must be positive, got -1"),
    (0, "bytes must be positive, got 0"),
    ("0MB", "bytes must be positive"),
    ("-1GiB", "must be >= 0, got '-1GiB'"),
    ("-1", "must be >= 0, got '-1'"),
    ("50", r"budget '50' has no unit: write '50%' for a fraction, '50B' or '50MiB' for bytes"),
    ("1", "budget '1' has no unit"),
    ("0", "budget '0' has no unit"),
    ("1e9", "budget '1e9' has no unit"),
    ("2.5e-1", "budget '2.5e-1' has no unit"),
    (-0.1, _FRACTION + r".*got -0.1"),
    ("-50%", _FRACTION + r".*got '-50%'"),
    (float("nan"), _FRACTION + r".*got nan"),
    (math.inf, _FRACTION + r".*got inf"),
    (1.5, _FRACTION + r".*got 1.5"),
    ("1.5", _FRACTION + r".*got '1.5'"),
    ("150%", _FRACTION + r".*got '150%'"),
    ("1e400B", "'1e400B' is too large"),
    (None, "budget must be bytes .* or a fraction"),
    (True, "budget must be bytes .* or a fraction"),
    ([1], "budget must be bytes .* got list"),
]


@pytest.mark.parametrize("budget, match", BAD_BUDGETS, ids=[repr(b) for b, _ in BAD_BUDGETS])
def test_bad_budget(step, budget, match):
    with pytest.raises(BudgetError, match=match):
        parse_budget(budget)
    _refused(step, BudgetError, match, budget=budget)


@pytest.mark.parametrize(
    "budget, understood",
    [
        (0.25, Budget(fraction=0.25)),
        ("0.25", Budget(fraction=0.25)),
        ("1.0", Budget(fraction=1.0)),
        ("50%", Budget(fraction=0.5)),
        ("6GiB", Budget(bytes=6 * 2**30)),
        ("800MB", Budget(bytes=800 * 10**6)),
        ("50B", Budget(bytes=50)),
        ("1e9B", Budget(bytes=10**9)),
        (8_000_000_000, Budget(bytes=8_000_000_000)),  # a Python int is bytes: typed, not ambiguous
        (50, Budget(bytes=50)),
    ],
)
def test_documented_budget_forms(budget, understood):
    assert parse_budget(budget) == understood


def test_budget_below_the_lowest_peak_states_p_min(step):
    err = _refused(step, BudgetInfeasibleError, r"below the lowest peak .* P_min = .* \(\d+ bytes\); P_none = ", budget=1024)
    assert err.min_peak_bytes > err.budget_bytes == 1024
    assert isinstance(err, ValueError) and f"({err.min_peak_bytes} bytes)" in str(err)


# -- the step: inputs, loss, devices --------------------------------------------------------------


def test_inputs_of_the_wrong_shape(step):
    _refused(
        step, ForwardError, r"forward of module 'fc1' \(Linear\) raised RuntimeError: mat1 and mat2", inputs=torch.randn(8, 5)
    )


def test_inputs_of_the_wrong_number(step):
    x = step[1]
    _refused(step, ForwardError, r"forward of the root module \(TinyNet\) raised TypeError", inputs=(x, x))


def test_inputs_of_the_wrong_kind(step):
    _refused(step, WorkloadError, "inputs must be a tensor, a tuple .* got set", inputs={1, 2})


@pytest.mark.parametrize(
    "loss_fn, match",
    [
        (lambda out: out, r"loss must be a scalar, got a tensor of shape \(8, 16\)"),
        (lambda out: out.sum().detach(), "loss does not require grad"),
        (lambda out: out.detach().sum(), "loss does not require grad"),
        (lambda out: 3.0, "loss must be a tensor, got float"),
    ],
    ids=["not-scalar", "detached", "no-grad", "float"],
)
@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_bad_loss(step, loss_fn, match, fake):
    _refused(step, LossError, match, loss_fn=loss_fn, fake=fake)


def test_no_trainable_parameter():
    model, x = nn.Linear(4, 4).requires_grad_(False), torch.randn(2, 4)
    before = snapshot(model)
    with pytest.raises(WorkloadError, match="no parameter that requires grad"):
        memfit.plan(model, x, 0.5)  # once a ValueError from building the default optimizer
    assert_same(before, snapshot(model))


def test_inputs_on_another_device_than_the_model(step):
    x = step[1]
    _refused(step, WorkloadError, "an input is on meta but the model is on cpu", inputs=x.to("meta"))
    _refused(step, WorkloadError, "an input is on meta but the model is on cpu", inputs=x.to("meta"), fake=True)
    # with a profile given the planner measures nothing itself: it used to run the step on
    # the meta input and fail inside torch
    prof = memfit.profile(step[0], x, optimizer=step[2])
    _refused(step, WorkloadError, "an input is on meta but the model is on cpu", inputs=(x.to("meta"),), profile=prof)


def test_model_on_another_device_than_its_inputs():
    # the model's device is the one to fix: meta holds no data, whatever the inputs' device
    with pytest.raises(WorkloadError, match="the model is on the meta device, which holds no data"):
        memfit.plan(TinyNet(width=16).to("meta"), torch.randn(8, 16), 0.5)


def test_model_on_several_devices():
    # it used to fail copying the meta half into the sandbox (NotImplementedError)
    torch.manual_seed(0)
    model = TinyNet(width=16)
    model.fc2.to("meta")
    fc1 = model.fc1.weight.detach().clone()
    for call in (lambda: memfit.plan(model, torch.randn(8, 16), 0.5), lambda: memfit.profile(model, torch.randn(8, 16))):
        with pytest.raises(WorkloadError, match=r"more than one device: 'fc1.weight' is on cpu but 'fc2.weight' is on meta"):
            call()
    assert torch.equal(model.fc1.weight, fc1) and model.fc1.weight.grad is None


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_model_and_inputs_on_the_meta_device(fake):
    # Both on meta agree on the device: the real step failed copying the parameters out
    # ("Cannot copy out of meta tensor"), the fake one measured a step on no real device.
    model, x = TinyNet(width=16).to("meta"), torch.randn(8, 16, device="meta")
    for call in (lambda: memfit.profile(model, x, fake=fake), lambda: memfit.plan(model, x, 0.5, fake=fake)):
        with pytest.raises(WorkloadError, match=r"the model is on the meta device, which holds no data: .*to_empty.*fake=True"):
            call()


def _raising_loss(out):
    raise KeyError("labels")


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_a_loss_function_that_raises_is_named(step, fake):
    # it was reported as "forward of the model (TinyNet) raised KeyError"
    err = _refused(
        step, LossError, r"the loss function _raising_loss raised KeyError: 'labels'", loss_fn=_raising_loss, fake=fake
    )
    assert "forward" not in str(err)


class _LogitsAndLoss(nn.Module):
    """Returns ``(logits, loss)``, as many hand-written models do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor):
        logits = self.fc(x)
        return logits, logits.square().mean()


def test_an_output_of_several_tensors_without_a_loss_is_refused():
    # The default loss summed logits and loss together: training on a loss nobody wrote.
    torch.manual_seed(0)
    model, x = _LogitsAndLoss(), torch.randn(8, 16)
    before = snapshot(model)
    with pytest.raises(LossError, match=r"output is a tuple of 2 floating-point tensors and has no loss.*pass loss_fn"):
        memfit.profile(model, x)
    assert_same(before, snapshot(model))
    prof = memfit.profile(model, x, loss_fn=lambda out: out[1])
    assert prof.peak_bytes > 0


def test_an_output_holding_one_tensor_is_summed():
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x), 3, None  # one floating tensor beside plain values: nothing to choose

    assert memfit.profile(One(), torch.randn(8, 16)).peak_bytes > 0


def test_an_optimizer_over_another_models_parameters(step):
    model, x, _ = step
    other = torch.optim.AdamW(TinyNet(width=16).parameters())
    _refused(step, WorkloadError, r"the optimizer \(AdamW\) holds none of the model's parameters", optimizer=other)
    # a tensor the model does not own: memfit would neither restore it nor find it in a fake copy
    extra = nn.Parameter(torch.zeros(3))
    mixed = torch.optim.AdamW([*model.parameters(), extra])
    _refused(step, WorkloadError, r"holds 1 tensor that is not a parameter of the model", optimizer=mixed)
    # part of the model, like a head being fine-tuned alone, is fine
    memfit.profile(model, x, optimizer=torch.optim.AdamW(model.fc2.parameters()))


class _CompiledSGD(torch.optim.Optimizer):
    """An update compiled with fullgraph, as torchao's low-bit optimizers do theirs."""

    def __init__(self, params, compiled: bool = True) -> None:
        super().__init__(params, {"lr": 0.1})
        update = lambda p, g: p.sub_(0.1 * g)  # noqa: E731
        self._update = torch.compile(update, fullgraph=True, backend="eager") if compiled else update
        self.raise_in_step = False

    @torch.no_grad()
    def step(self, closure=None):
        if self.raise_in_step:
            raise ValueError("no step today")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad)


def test_an_optimizer_whose_step_fails_under_the_recorder_is_named():
    model, x = TinyNet(width=16), torch.randn(8, 16)
    opt = _CompiledSGD(model.parameters())
    before = snapshot(model)
    if torch_compat.torch_version() < (2, 13):
        # torch 2.6 and 2.11's dynamo runs the frame eagerly under a dispatch mode: measured as the eager update
        compiled = memfit.profile(model, x, optimizer=opt)
        eager = memfit.profile(model, x, optimizer=_CompiledSGD(model.parameters(), compiled=False))
        assert compiled.breakdown == eager.breakdown and compiled.peak_bytes == eager.peak_bytes
    else:
        with pytest.raises(WorkloadError, match=r"optimizer step \(_CompiledSGD\) runs torch.compile.*torch.optim.AdamW"):
            memfit.profile(model, x, optimizer=opt)
    assert_same(before, snapshot(model))
    plain = _CompiledSGD(model.parameters(), compiled=False)
    plain.raise_in_step = True
    with pytest.raises(WorkloadError, match=r"optimizer step \(_CompiledSGD\) raised ValueError: no step today"):
        memfit.profile(model, x, optimizer=plain)
    assert_same(before, snapshot(model))


def test_profile_of_another_model(step):
    other = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    prof = memfit.profile(other, step[1])
    _refused(step, PlanError, r"the profile was made for another model \(Sequential", profile=prof)


# -- plans: another model, applied twice, nothing to remove ---------------------------------------


def test_plan_naming_modules_the_model_does_not_have():
    model = TinyNet(width=16)
    with pytest.raises(PlanError, match=r"names module 'encoder', which this model does not have"):
        memfit.apply(model, make_plan(fc1=Choice("full"), encoder=Choice("full")))
    assert applied_choices(model) is None and "forward" not in model.fc1.__dict__


def test_plan_made_for_another_model(step):
    model, x, opt = step
    plan = memfit.plan(model, x, 0.0, optimizer=opt)
    other = TinyNet(width=8)  # same module names, other parameter shapes
    with pytest.raises(PlanError, match=r"made for another model \(TinyNet, fingerprint [0-9a-f]{16}\); this TinyNet has"):
        memfit.apply(other, plan)
    hand = dataclasses.replace(make_plan(fc1=Choice("full")), fingerprint="0123456789abcdef", model_type="GPT")
    with pytest.raises(PlanError, match=r"made for another model \(GPT, fingerprint 0123456789abcdef\)"):
        memfit.apply(other, hand)
    assert applied_choices(other) is None and all("forward" not in m.__dict__ for m in other.modules())


def test_unknown_recompute_mode():
    model = TinyNet(width=16)
    with pytest.raises(PlanError, match="unknown recompute mode 'partial' for 'fc2'"):
        memfit.apply(model, make_plan(fc1=Choice("full"), fc2=Choice("partial")))
    assert applied_choices(model) is None and "forward" not in model.fc1.__dict__


def test_apply_twice_keeps_the_first_plan():
    model = TinyNet(width=16)
    memfit.apply(model, make_plan(fc1=Choice("full")))
    with pytest.raises(PlanError, match=r"already applied to this model; call memfit.remove\(model\)"):
        memfit.apply(model, make_plan(fc2=Choice("full")))
    assert applied_choices(model) == {"fc1": ("full", ())} and "forward" not in model.fc2.__dict__
    memfit.remove(model)


def test_remove_with_nothing_applied():
    model = TinyNet(width=16)
    with pytest.raises(PlanError, match="no memfit plan is applied to this model, so there is nothing to remove"):
        memfit.remove(model)
    memfit.apply(model, make_plan(fc1=Choice("full")))
    memfit.remove(model)
    with pytest.raises(PlanError, match="nothing to remove"):
        memfit.remove(model)
    assert "forward" not in model.fc1.__dict__


@pytest.mark.parametrize("what", [None, "not a plan", TinyNet()], ids=["None", "str", "module"])
def test_apply_arguments_of_the_wrong_kind(what):
    model = TinyNet(width=16)
    with pytest.raises(PlanError, match="apply needs a memfit.Plan"):
        memfit.apply(model, what)
    with pytest.raises(PlanError, match="apply needs a torch.nn.Module"):
        memfit.apply("model", make_plan())


# -- plan JSON --------------------------------------------------------------------------------------


_DELETE = object()


def _plan_json(**changes) -> str:
    data = make_plan(fc1=Choice("full"), bn=Choice("selective", ("native_batch_norm",))).to_dict()
    for key, value in changes.items():
        if value is _DELETE:
            del data[key]
        else:
            data[key] = value
    return json.dumps(data)


def test_plan_json_round_trips():
    plan = Plan.from_json(_plan_json())
    assert plan.checkpointed == {"fc1": Choice("full"), "bn": Choice("selective", ("native_batch_norm",))}


@pytest.mark.parametrize(
    "text, match",
    [
        pytest.param("", "does not parse", id="empty"),
        pytest.param("not json at all", "does not parse", id="not-json"),
        pytest.param(_plan_json()[:-20], "does not parse", id="truncated"),
        pytest.param("\x00\xff garbage", "does not parse", id="binary"),
        pytest.param("null", "not a memfit plan", id="null"),
        pytest.param("[]", "not a memfit plan", id="list"),
        pytest.param("{}", "not a memfit plan", id="empty-object"),
        pytest.param(_plan_json(format="memfit.profile/1"), "not a memfit plan", id="a-profile"),
        pytest.param(_plan_json(version=_DELETE), r"no valid format version \(got None", id="no-version"),
        pytest.param(_plan_json(version="1"), r"no valid format version \(got '1'", id="version-string"),
        pytest.param(_plan_json(version=0), r"no valid format version \(got 0", id="version-0"),
        pytest.param(_plan_json(budget_bytes=_DELETE), "missing or has malformed fields", id="missing-field"),
        pytest.param(_plan_json(surprise=1), "missing or has malformed fields", id="unknown-field"),
        pytest.param(_plan_json(budget_bytes="6GiB"), "budget_bytes must be an integer, got '6GiB'", id="bytes-string"),
        pytest.param(_plan_json(checkpointed=["fc1"]), "missing or has malformed fields", id="checkpointed-list"),
        pytest.param(_plan_json(checkpointed={"fc1": "full"}), "missing or has malformed fields", id="choice-string"),
        pytest.param(_plan_json(checkpointed={"fc1": {"save_ops": []}}), "missing or has malformed fields", id="no-mode"),
        pytest.param(
            _plan_json(checkpointed={"fc1": {"mode": "partial"}}), "module 'fc1' has unknown mode 'partial'", id="bad-mode"
        ),
        pytest.param(
            _plan_json(checkpointed={"fc1": {"mode": "selective", "save_ops": "addmm"}}),
            "module 'fc1' has save_ops 'addmm'",
            id="save-ops-string",
        ),
    ],
)
def test_corrupt_plan_json(text, match):
    with pytest.raises(PlanError, match=match):
        Plan.from_json(text)


def test_plan_json_from_a_newer_memfit():
    with pytest.raises(PlanError, match=r"plan format version 3 is newer than this memfit reads \(2\); upgrade memfit"):
        Plan.from_json(_plan_json(version=3))


def test_plan_json_records_its_step_and_reads_version_1():
    step = StepOptions(accumulate=4, set_to_none=False, autocast="bfloat16")
    data = dataclasses.replace(make_plan(fc1=Choice("full")), step=step).to_dict()
    assert data["version"] == 2 and data["step"]["accumulate"] == 4 and data["step"]["set_to_none"] is False
    assert Plan.from_dict(data).step == step
    # a version 1 plan (memfit before the step was recorded) was verified on the usual step
    old = {k: v for k, v in data.items() if k != "step"} | {"version": 1}
    assert Plan.from_dict(old).step == StepOptions()
    with pytest.raises(PlanError, match="step must hold memfit.StepOptions fields"):
        Plan.from_dict(data | {"step": {"accumulate": 0}})
    with pytest.raises(PlanError, match="step must hold memfit.StepOptions fields"):
        Plan.from_dict(data | {"step": {"no_such": 1}})


# -- the CLI --------------------------------------------------------------------------------------

SMALL = ["--batch-size", "2", "--size", "n_layer=2", "--size", "n_embd=32", "--size", "n_head=2", "--size", "block_size=16"]


def _one_line_error(capsys) -> str:
    # A budget below P_min is found after seconds of measuring, which stderr shows as
    # progress lines (memfit: planning gpt: ..., 2.0 s) when it is not a terminal.
    *progress, err = capsys.readouterr().err.strip().splitlines()
    assert all(re.fullmatch(r"memfit: (?!error: )[^:]+: .*, \d+\.\d s", line) for line in progress), progress
    assert err.startswith("memfit: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "budget, needle",
    [
        ("6 GB of RAM", "cannot parse byte amount '6 GB of RAM'"),
        ("abc", "cannot parse byte amount 'abc'"),
        ("nan", "cannot parse byte amount 'nan'"),
        ("-1", "byte amount must be >= 0, got '-1'"),
        ("50", "budget '50' has no unit: write '50%' for a fraction, '50B' or '50MiB' for bytes"),
        ("1", "budget '1' has no unit"),
        ("-1GiB", "byte amount must be >= 0, got '-1GiB'"),
        ("-50%", "fraction must be in [0, 1] (or 0%..100%), got '-50%'"),
        ("1.5", "fraction must be in [0, 1] (or 0%..100%), got '1.5'"),
        ("150%", "fraction must be in [0, 1] (or 0%..100%), got '150%'"),
        ("1e400B", "'1e400B' is too large"),
        ("1KiB", "below the lowest peak memfit can reach for this step, P_min ="),
    ],
)
def test_cli_bad_budgets_are_one_line(budget, needle, capsys):
    assert main(["plan", "gpt", *SMALL, f"--budget={budget}"]) == 2
    assert needle in _one_line_error(capsys)


def test_fake_is_read_once_into_where(step):
    """``fake=`` is read once where a step comes in (memfit.Where.of): the old spellings and a
    Where give the same step, and anything else is a one-line error naming what would be
    right, before anything runs."""
    from memfit.measure.checked import checked_step

    model, x, opt = step
    for spelling, where in [(False, memfit.Where.REAL), (None, memfit.Where.REAL), (True, memfit.Where.FAKE)]:
        assert memfit.Where.of(spelling) is where
        assert checked_step(model, x, optimizer=opt, fake=spelling).where is where
    assert memfit.Where.of("cpu") is memfit.Where.FAKE and memfit.Where.of("cuda") is memfit.Where.FAKE_CUDA
    for where in memfit.Where:
        assert memfit.Where.of(where) is where and memfit.Where.of(where.value) is where
    with_where = memfit.profile(model, x, optimizer=opt, fake=memfit.Where.FAKE)
    with_bool = memfit.profile(model, x, optimizer=opt, fake=True)
    assert with_where.fake and with_where.where is memfit.Where.FAKE
    assert with_where.peak_bytes == with_bool.peak_bytes
    for bad in ("gpu", 1, "True"):
        err = _refused(step, WorkloadError, r"fake takes False \(real tensors\), True or 'cpu'.*got", fake=bad)
        assert "\n" not in str(err)


def test_remove_refuses_a_checkpoint_another_wrapper_covers():
    """A plan applied before parallelizing, whose parallelize then wraps the module's forward
    (torchtitan's redistribution does): memfit.remove refuses in one line and changes nothing,
    rather than removing that wrapper with its own."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    plan = memfit.Plan.from_dict(
        {**memfit.plan(model, torch.randn(8, 4), 1.0).to_dict(), "checkpointed": {"0": {"mode": "full", "save_ops": []}}}
    )
    memfit.apply(model, plan)
    ours = model[0].forward
    model[0].forward = lambda *a, **k: ours(*a, **k)  # a parallelize's wrapper around memfit's forward
    wrapper = model[0].forward
    with pytest.raises(PlanError, match="removing the plan would remove that wrapper too") as info:
        memfit.remove(model)
    assert "\n" not in str(info.value)
    assert model[0].forward is wrapper and memfit.mechanisms(model)  # nothing changed


@pytest.mark.parametrize("installed", [True, False])
def test_a_torchtitan_that_does_not_import_says_why_in_one_line(monkeypatch, installed):
    import importlib.util
    import sys

    from memfit.errors import TargetError
    from memfit.zoo import torchtitan as tt

    monkeypatch.setitem(sys.modules, "torchtitan", None)  # its import fails, as beside a torch it does not support
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if installed else None)
    words = "installed but does not import beside torch" if installed else "pip install 'memfit\\[torchtitan\\]'"
    with pytest.raises(TargetError, match=words) as info:
        tt._import_torchtitan()
    assert "\n" not in str(info.value)
