"""The command line's step options: a flag per StepOptions field that changes memory, on
every command that takes step options (profile, plan), checked in one line, recorded in the JSON."""

from __future__ import annotations

import json

import pytest

from memfit import Plan, StepOptions
from memfit.cli import build_parser, main
from memfit.cli.options import step_options

# one layer: what the flags record and the plans keep is the same at any depth, and the fake
# profiles and plans below cost per op
SMALL = ["--size", "n_layer=1", "n_embd=64", "n_head=4", "block_size=32", "vocab_size=512", "--batch-size", "4"]

FLAGS = [
    (["--accumulate", "3"], StepOptions(accumulate=3)),
    (["--micro-batches", "2"], StepOptions(micro_batches=2)),
    (["--loss-scale", "0.25"], StepOptions(loss_scale=0.25)),
    (["--keep-grads"], StepOptions(set_to_none=False)),
    (["--autocast", "float16", "--grad-scaler"], StepOptions(autocast="float16", grad_scaler=True)),
    (["--param-dtype", "bfloat16"], StepOptions(param_dtype="bfloat16")),
    (["--foreach", "off"], StepOptions(foreach=False)),
    (["--foreach", "on"], StepOptions(foreach=True)),
    (["--optimizer-8bit"], StepOptions(optimizer_8bit=True)),
    (["--offload"], StepOptions(offload=True)),
    (["--forward-before-loop"], StepOptions(forward_before_loop=True)),
    (["--holds-output"], StepOptions(holds_output=True)),
    (["--drops-output"], StepOptions(drops_output=True)),
    ([], None),
]


@pytest.mark.parametrize("command", ["profile", "plan"])
@pytest.mark.parametrize("flags, step", FLAGS)
def test_each_flag_parses_to_its_step_option(command, flags, step):
    ns = build_parser().parse_args([command, "gpt", *flags])
    assert step_options(ns) == step


def test_eval_is_the_inference_step():
    assert step_options(build_parser().parse_args(["profile", "gpt", "--eval"])) == StepOptions(inference=True)
    both = StepOptions(inference=True, holds_output=True)  # an evaluation loop holds its output too
    assert step_options(build_parser().parse_args(["profile", "gpt", "--eval", "--holds-output"])) == both


def test_every_memory_field_has_a_flag():
    text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()  # type: ignore[union-attr]
    for field in StepOptions.__dataclass_fields__:
        flag = {"set_to_none": "--keep-grads", "inference": None}.get(field, "--" + field.replace("_", "-"))
        assert flag is None or flag in text, field


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--accumulate", "0"], "--accumulate takes a positive integer, got '0'"),
        (["--accumulate", "two"], "--accumulate takes a positive integer, got 'two'"),
        (["--micro-batches", "1.5"], "--micro-batches takes a positive integer, got '1.5'"),
        (["--loss-scale", "-1"], "--loss-scale takes a positive number"),
        (["--loss-scale", "inf"], "--loss-scale takes a positive number"),
        (["--autocast", "fp8"], "--autocast takes one of bfloat16, float16, got 'fp8'"),
        (["--param-dtype", "float32"], "--param-dtype takes one of bfloat16, float16"),
        (["--foreach", "yes"], "--foreach takes one of on, off, got 'yes'"),
        (["--optimizer-8bit", "--foreach", "on"], "--foreach is a flag of torch's optimizers; with --optimizer-8bit"),
    ],
)
@pytest.mark.parametrize("command", ["profile", "plan"])
def test_bad_values_are_one_line_and_exit_2(command, flags, message, capsys):
    budget = ["--budget", "50%"] if command == "plan" else []
    assert main([command, "gpt", *SMALL, "--device", "fake", *budget, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memfit: error: ") and message in err, err


def test_eval_with_training_options_names_the_flags(capsys):
    assert main(["profile", "gpt", *SMALL, "--device", "fake", "--eval", "--accumulate", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--eval" in err and "--accumulate" in err


def test_step_flags_refused_per_rank(capsys):
    assert main(["plan", "gpt", "--device", "fake", "--world-size", "2", "--budget", "1GiB", "--accumulate", "2"]) == 2
    assert "do not take step options" in capsys.readouterr().err


def test_profile_and_plan_json_record_the_step(tmp_path, capsys):
    flags = ["--accumulate", "3", "--keep-grads", "--autocast", "bfloat16"]
    step = StepOptions(accumulate=3, set_to_none=False, autocast="bfloat16")
    assert main(["profile", "gpt", *SMALL, "--device", "fake", *flags, "--json", str(tmp_path / "p.json")]) == 0
    assert "accumulate 3" in capsys.readouterr().out
    assert StepOptions.from_dict(json.loads((tmp_path / "p.json").read_text())["step"]) == step
    assert main(["plan", "gpt", *SMALL, "--device", "fake", "--budget", "1GiB", *flags, "--json", str(tmp_path / "q.json")]) == 0
    plan = Plan.from_json((tmp_path / "q.json").read_text())
    assert plan.step == step
    # the plan's own peak is the step it records: three passes over the whole batch, gradients kept
    assert plan.predicted_peak_bytes == plan.none_peak_bytes > plan.start_bytes
    # each module runs once per pass: three calls, as the plan says (it said "1 calls" before)
    assert plan.excluded["transformer.h.0"].startswith("called 3 times in a step")
    assert "runs every module 3 times" in " ".join(capsys.readouterr().out.split())


def test_holds_output_is_recorded_and_kept_by_plans(tmp_path, capsys):
    """--holds-output: the profile JSON says so, its ledger pairs the previous step's output with
    the step's own, and a plan is verified on that step and records it (its unplanned peak is the
    held step's). Left out of the JSON when not given, as readers before it expect."""
    from memfit.measure.ledger import Ledger

    assert main(["profile", "gpt", *SMALL, "--device", "fake", "--json", str(tmp_path / "base.json")]) == 0
    assert main(["profile", "gpt", *SMALL, "--device", "fake", "--holds-output", "--json", str(tmp_path / "p.json")]) == 0
    assert "holds output" in capsys.readouterr().out
    base, data = (json.loads((tmp_path / n).read_text()) for n in ("base.json", "p.json"))
    assert "holds_output" not in base["step"] and "held_output" not in base["ledger"]
    assert data["step"]["holds_output"] is True
    ledger = Ledger.from_dict(data["ledger"])
    logits = 4 * 32 * 512 * 4  # batch 4 x 32 tokens x 512 vocabulary, float32
    # the whole output is held: zoo gpt returns (logits, loss)
    pairs = [(ledger.blocks[i].nbytes, ledger.blocks[j].nbytes) for i, j in ledger.held_output.items()]  # type: ignore[index]
    assert pairs == [(logits, logits), (4, 4)]
    # the step starts with the held output (and, on the CPU, the graph its tensors keep)
    assert data["start_bytes"] > base["start_bytes"] + logits
    flags = ["--device", "fake", "--budget", "1GiB", "--holds-output", "--json", str(tmp_path / "q.json")]
    assert main(["plan", "gpt", *SMALL, *flags]) == 0
    plan = Plan.from_json((tmp_path / "q.json").read_text())
    assert plan.step == StepOptions(holds_output=True)
    assert (plan.start_bytes, plan.none_peak_bytes) == (data["start_bytes"], data["peak_bytes"])
