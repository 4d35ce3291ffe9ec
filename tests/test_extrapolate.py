"""A step's ledger for L identical layers extrapolated from steps of k, k+1 and k+2 layers
(:mod:`memfit.measure.extrapolate`, :class:`memfit.measure.layered.LayeredSession`; issues 26
and 27): on configs small enough to record in full as well, the extrapolated L-layer ledger
is the recorded one byte for byte, and so are the fake-CUDA allocated and reserved peaks;
a stack of layers that are not identical is recorded in full, saying why."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import needs

pytestmark = needs("transformers", "peft")

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

# in the session's fake-CUDA interpreter: the same fine-tune profiled from one fake copy of the
# whole model, and from its 2-, 3- and 4-layer versions (with checkpointing 3, 4, 5)
COMPARE = textwrap.dedent(
    """
    import hashlib, json, time
    from memfit.integrations.finetune import LoraSpec, lora_session, lora_workload
    json.dump(config, open(path, "w"))
    t = time.process_time()
    spec = LoraSpec(4, targets=tuple(targets), quant=quant)

    def build(n=None):
        sizes = None if n is None else {"num_hidden_layers": n}
        return lora_workload(path, spec, batch_size=batch, seq_len=seq, checkpointing=ckpt, sizes=sizes)

    work = build()
    got = {}
    for how, rebuild in (("whole", None), ("layered", build)):
        with lora_session(work, rebuild=rebuild) as session:
            prof = session.profile()
            text = json.dumps(prof.ledger.to_dict())
            got[how] = {
                "ledger": hashlib.sha256(text.encode()).hexdigest(), "ticks": len(prof.ledger.ticks),
                "allocated": prof.allocated_peak_bytes, "reserved": prof.reserved_peak_bytes,
                "profile": prof.to_dict(ledger=False),
                "note": getattr(session, "note", None), "extrapolated": getattr(session, "extrapolated", None),
            }
    got["cpu"] = time.process_time() - t
    print("RESULT" + json.dumps(got))
    """
)


def _compare(fake_cuda, tmp_path, config, *, batch=2, seq=64, targets=("q_proj", "v_proj"), quant="none", ckpt=False):
    head = (
        f"config, path = {config!r}, {str(tmp_path / 'config.json')!r}\n"
        f"batch, seq, targets, quant, ckpt = {batch}, {seq}, {list(targets)!r}, {quant!r}, {ckpt}\n"
    )
    done = fake_cuda.script(head + COMPARE, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])


def _exact(got):
    whole, layered = got["whole"], got["layered"]
    assert layered["note"] is None and layered["extrapolated"] == 1, layered["note"]
    assert whole["ticks"] > 0 and layered["ticks"] == whole["ticks"]
    assert layered["ledger"] == whole["ledger"]  # the ledger's JSON, byte for byte
    assert (layered["allocated"], layered["reserved"]) == (whole["allocated"], whole["reserved"])
    assert layered["profile"] == whole["profile"]  # and everything the profile says from it


@pytest.mark.parametrize(
    "case, config, kwargs",
    [
        ("llama, batch 1", LLAMA, {"batch": 1, "seq": 32}),
        ("llama, batch 3", LLAMA, {"batch": 3, "seq": 64}),
        ("qwen2 (q/k/v biases)", {**LLAMA, "model_type": "qwen2"}, {}),
        ("mistral", {**LLAMA, "model_type": "mistral"}, {}),
        ("gemma (tied embeddings, head_dim)", {**LLAMA, "model_type": "gemma", "head_dim": 16, "tie_word_embeddings": True}, {}),
        ("llama, every linear layer adapted", LLAMA, {"targets": ("all-linear",)}),
        ("llama, gradient checkpointing", LLAMA, {"ckpt": True}),
    ],
)
def test_extrapolated_ledger_is_the_recorded_one(fake_cuda, tmp_path, case, config, kwargs):
    _exact(_compare(fake_cuda, tmp_path, config, **kwargs))


@needs("bitsandbytes")
def test_qlora_ledger_extrapolated_is_the_recorded_one(fake_cuda, tmp_path):
    _exact(_compare(fake_cuda, tmp_path, LLAMA, quant="4bit"))


@needs("bitsandbytes")
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "gradient checkpointing"])
def test_int8_ledger_extrapolated_is_the_recorded_one(fake_cuda, tmp_path, ckpt):
    # LLM.int8 base layers: their int8 matmul's temporaries (int32 product, float16 copies) per layer
    _exact(_compare(fake_cuda, tmp_path, LLAMA, quant="8bit", ckpt=ckpt))


def test_layers_that_differ_are_recorded_in_full_saying_why(fake_cuda, tmp_path):
    """gemma2 alternates sliding-window and full attention (config.layer_types): refused before
    any small step is recorded, the whole step's answer, and the note says why."""
    got = _compare(fake_cuda, tmp_path, {**LLAMA, "model_type": "gemma2", "head_dim": 16})
    whole, layered = got["whole"], got["layered"]
    assert layered["extrapolated"] == 0 and "layer_types are not all the same" in layered["note"]
    assert layered["ledger"] == whole["ledger"] and layered["profile"] == whole["profile"]


NO_LORA = textwrap.dedent(
    """
    import hashlib, json, torch, transformers
    from memfit.measure.checked import checked_step
    from memfit.measure.extrapolate import Layers
    from memfit.measure.layered import LayeredSession
    from memfit.measure.profile import fake_session
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))

    def step(n):  # every parameter trained, no adapters
        cfg = transformers.LlamaConfig(**{**config, "num_hidden_layers": n}, use_cache=False)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return checked_step(model, {"input_ids": ids, "labels": ids.clone()}, optimizer=opt, fake="cuda")

    full = step(6)
    with fake_session(full, light=True) as whole:
        want, want_peak = whole.profile(), whole.peak(micro_batches=2)
    small = [fake_session(step(n), light=True) for n in (2, 3, 4)]
    sessions = [s.__enter__() for s in small]
    layered = LayeredSession(full, sessions, Layers("model.layers."), 2, 6, lambda: fake_session(full, light=True))
    with layered:
        got = layered.profile()
        peak = layered.peak(micro_batches=2)
    for s in small:
        s.__exit__(None, None, None)
    same = json.dumps(got.ledger.to_dict()) == json.dumps(want.ledger.to_dict())
    print("RESULT" + json.dumps({"note": layered.note, "n": layered.extrapolated, "same": same,
        "peaks": [got.allocated_peak_bytes, got.reserved_peak_bytes, want.allocated_peak_bytes, want.reserved_peak_bytes],
        "profile": got.to_dict(ledger=False) == want.to_dict(ledger=False), "micro": [peak, want_peak]}))
    """
)


def test_full_fine_tune_without_lora_and_micro_batches(fake_cuda):
    """Not only peft's steps: a plain transformers model trained whole (every parameter's
    gradient and AdamW state in the layers' periods), and a peak at 2 micro-batches."""
    done = fake_cuda.script(f"config = {LLAMA!r}\n" + NO_LORA, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    assert got["note"] is None and got["n"] == 2, got["note"]
    assert got["same"] and got["profile"]
    allocated, reserved, want_allocated, want_reserved = got["peaks"]
    assert (allocated, reserved) == (want_allocated, want_reserved)
    assert got["micro"][0] == got["micro"][1]


CLI = textwrap.dedent(
    """
    import contextlib, io, json
    from memfit.cli import main
    from memfit.integrations import finetune
    json.dump(config, open(path, "w"))
    common = ["finetune", path, "--seq-len", "64", "--batch-size", "2", "--lora-rank", "4", "--gpu", "T4", "--capacity", "552MiB"]
    answers, says = {}, {}
    layered = finetune.lora_session
    for how in ("whole", "layered"):
        # the whole step's session: the answers as memfit finetune gave them before extrapolation
        finetune.lora_session = layered if how == "layered" else (lambda work, rebuild=None, **kw: layered(work, **kw))
        for name, more in (("over", ["--batch-size", "16", "--max", "batch"]),):  # the profile, the search, the levers
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main([*common, *more, "--json", f"{path}.{how}.{name}"]) == 0
            answers[how, name] = json.load(open(f"{path}.{how}.{name}"))
            says[how, name] = " ".join(out.getvalue().split())
    finetune.lora_session = layered
    print("RESULT" + json.dumps({"answers": {f"{h}.{n}": a for (h, n), a in answers.items()},
                                 "says": {f"{h}.{n}": s for (h, n), s in says.items()}}))
    """
)


def test_finetune_answers_are_the_same_with_the_ledger_extrapolated(fake_cuda, tmp_path):
    """``memfit finetune``'s JSON (the profile, the largest batch, the levers) is the one the
    whole step's session gives, but for the field saying how it was made."""
    head = f"config, path = {LLAMA!r}, {str(tmp_path / 'config.json')!r}\n"
    done = fake_cuda.script(head + CLI, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    whole, layered = got["answers"]["whole.over"], dict(got["answers"]["layered.over"])
    how = layered.pop("extrapolated")
    assert "extrapolated" not in whole and layered == whole
    assert how["note"] is None and how["from_layers"] == [2, 3] and how["checked_at"] == 4 and how["layers"] == 6
    # the profile, each batch size the search measured, each micro-batch count the levers tried
    assert how["extrapolated_answers"] == 1 + whole["max"]["measurements"] - 1 + len(whole["recipe"]["tried"])
    assert "extrapolated from 2- and 3-layer steps, checked at 4 layers" in got["says"]["layered.over"]
    assert 2 < whole["max"]["max_batch"] < 16 and whole["recipe"]["micro_batches"] > 1


# -- the mechanism on plain ledgers ---------------------------------------------------------------


def _toy(n: int):
    """A periodic ledger of ``n`` layers: each layer's parameter at the start, its activation in
    forward (saved by it, freed in its backward), the gradient it passes down (freed in the
    backward of the layer below), and a loss outside the layers."""
    from memfit.measure.ledger import Block, Category, Ledger, Phase, Span, Tick

    blocks, ticks = [], []

    def block(nbytes, cat, phase, module, savers=()):
        blocks.append(Block(len(blocks), nbytes, cat, phase, module, len(ticks) if phase is not Phase.START else -1, None, savers))
        if phase is not Phase.START:
            ticks.append(Tick(phase, module, "op"))
        return blocks[-1].id

    def free(i, phase, module):
        blocks[i] = blocks[i].__class__(**{**{f: getattr(blocks[i], f) for f in blocks[i].__slots__}, "died": len(ticks)})
        ticks.append(Tick(phase, module, "free"))

    name = "m.layers.{}".format
    for i in range(n):
        block(100, Category.PARAMETER, Phase.START, None, (name(i),))
    acts = [block(10, Category.ACTIVATION, Phase.FORWARD, name(i), (name(i),)) for i in range(n)]
    loss = block(5, Category.TEMPORARY, Phase.FORWARD, "m.head")  # the size of what the layers pass
    grad = loss
    for i in reversed(range(n)):
        new = block(5, Category.TEMPORARY, Phase.BACKWARD, name(i))
        free(grad, Phase.BACKWARD, name(i))
        free(acts[i], Phase.BACKWARD, name(i))
        grad = new
    free(grad, Phase.BACKWARD, None)
    spans = [Span(name(i), Phase.FORWARD, i, i + 1, ()) for i in range(n)]
    return Ledger(blocks, ticks, spans)


def test_growth_on_a_toy_ledger_and_the_check_refuses_what_differs():
    from dataclasses import replace

    from memfit.measure.extrapolate import Layers, NotPeriodic, extrapolate

    layers = Layers("m.layers.")
    assert layers.shift("m.layers.3.mlp", 2) == "m.layers.5.mlp" and layers.shift("m.norm") == "m.norm"
    assert extrapolate([_toy(2), _toy(3), _toy(4)], layers, 2, 9).to_dict() == _toy(9).to_dict()
    bad = _toy(4)
    bad.blocks[-1] = replace(bad.blocks[-1], nbytes=6)  # the 4-layer step is not the growth of the others
    with pytest.raises(NotPeriodic, match="4-layer ledger synthesized differs from the recorded one: blocks"):
        extrapolate([_toy(2), _toy(3), bad], layers, 2, 9)


def test_layer_stacks_that_are_not_identical_are_refused():
    import torch
    from torch import nn

    from memfit.integrations.finetune import layer_stack

    class Config:
        def __init__(self, **kw):
            self.__dict__.update(kw)

        def to_dict(self):
            return dict(self.__dict__)

    def model(**cfg):
        m = nn.Module()
        m.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        m.config = Config(num_hidden_layers=6, **cfg)
        return m

    assert layer_stack(model())[1] == 6 and layer_stack(model())[0].prefix == "layers."
    assert "layer_types" in layer_stack(model(layer_types=["full", "sliding"] * 3))
    assert layer_stack(model(layer_types=["full"] * 6))[1] == 6
    assert "mixture of experts" in layer_stack(model(num_local_experts=8))
    assert "per-layer list" in layer_stack(model(window=[1, 2, 3, 4, 5, 6]))
    shared = model()
    shared.layers[3] = shared.layers[2]
    assert "not distinct" in layer_stack(shared)
    tied = model()
    tied.layers[4].weight = tied.layers[1].weight
    assert "share parameters" in layer_stack(tied)
    assert isinstance(torch.zeros(1), torch.Tensor)
