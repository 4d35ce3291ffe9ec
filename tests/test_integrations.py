"""memfit inside transformers' Trainer and Lightning (tiny models from configs, CPU).

Each run is trained twice from the same seed: once with memfit's one line (``fit_trainer``
or a callback) and a budget below the step's unplanned peak, once by hand with the same
plan applied with ``memfit.apply`` and the same batch / accumulation settings. Losses and
parameters must be bitwise equal: memfit must not change what training computes (and
drawing the batch it measures must not move the data order or dropout's RNG).

The step peak within the budget is memfit's own measurement: the recorder's ledger of the
Trainer's step (its model with the plan applied, its optimizer, its batches and
accumulation), run for real.

Lightning's BatchSizeFinder finds its batch by running steps until one raises CUDA's
out-of-memory error. There is no such error on a CPU, so the limit is EMULATED: a callback
raises ``RuntimeError("CUDA out of memory. ...")`` before a training batch whose step peak,
measured by memfit's recorder on the real step with that very batch, is over the limit.
memfit's finder predicts from fake tensors and runs no step for the search at all.
"""

from __future__ import annotations

import functools
import runpy
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import memfit
from memfit.measure.step import StepOptions


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core machine
    OpenMP's waiting threads make every step (and memfit's timed probes) many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- import hygiene ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def imports() -> list[str]:
    """What a fresh interpreter prints for the two tests below, from one interpreter: first
    after ``import memfit, memfit.integrations`` alone, then (where transformers and
    Lightning are installed) after each integration beside its framework. One start-up of
    torch and memfit instead of two; the first check runs before any framework is imported."""
    import importlib.util

    code = (
        "import sys, memfit, memfit.integrations\n"
        "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    if all(importlib.util.find_spec(m) for m in ("transformers", "lightning")):
        code += (
            "import transformers\n"
            "import memfit.integrations.transformers\n"
            "print('lightning' in sys.modules, 'pytorch_lightning' in sys.modules)\n"
            "import lightning.pytorch\n"
            "before = set(sys.modules)\n"
            "import memfit.integrations.lightning\n"
            "print(sorted(m for m in set(sys.modules) - before if not m.startswith('memfit')))\n"
        )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split("\n")


def test_import_memfit_loads_no_framework(imports):
    assert imports[0].strip() == ""


def test_each_integration_imports_only_its_framework(imports):
    """What memfit's integration adds over importing the framework itself (Lightning may
    load transformers on its own, when installed): nothing of the other framework."""
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    assert imports[1:3] == ["False False", "[]"]


# -- transformers -----------------------------------------------------------------------

SEQ, VOCAB, SAMPLES, BATCH = 32, 128, 32, 8


def _gpt2(arch: str = "gpt2"):
    """A small causal LM (GPT-2) or seq2seq model (T5) from a config, dropout on."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "t5":
        config = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)
        return tf.T5ForConditionalGeneration(config)
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ))


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, arch: str = "gpt2") -> None:
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
        self.arch = arch

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # seq2seq: the target is the first half of the source (a short summary, say)
        return {"input_ids": self.ids[i], "labels": self.ids[i, : SEQ // 2] if self.arch == "t5" else self.ids[i]}


def _hf_trainer(tmp_path, model, *, batch=BATCH, accumulate=1, callbacks=None, arch="gpt2", **extra):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # Trainer needs it
    tf.logging.set_verbosity_error()
    args = tf.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **extra,
    )
    return tf.Trainer(model=model, args=args, train_dataset=_Tokens(arch), callbacks=callbacks)


def _losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


class _RecordedSteps:
    """memfit's recorder on every training step as the framework runs it (its loop, its
    clipping, its zero_grad, not memfit's own step), from before the step's first forward to
    after its optimizer step, the phases set from the framework's hooks: each step's peak.
    The step's batch is alive before the recording starts and no hook hands it over: its
    bytes (a few KiB here) are left out."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._rec = None

    def begin(self, model: nn.Module, optimizer, inputs=(), dataset=()) -> None:
        """``inputs``: the step's batch, alive before it. ``dataset``: tensors the loader
        indexes for a later micro-batch inside the step: alive before and after, and no part
        of the step's memory (registered so that their views are known, then subtracted)."""
        from memfit.integrations.transformers import _plain_optimizer
        from memfit.measure.ledger import Category
        from memfit.measure.recorder import Recorder, storage_bytes
        from memfit.measure.scope import Phase, Scope
        from memfit.recompute.checkpoint import CHECKPOINTED

        self._model = model
        self._scope = Scope(model).__enter__()
        self._scope.set_phase(Phase.FORWARD)
        rec = Recorder(self._scope, device=torch.device("cpu"), checkpointed=model.__dict__.get(CHECKPOINTED) or {})
        state = _plain_optimizer(optimizer).state.values()
        for tensors, category in (
            (model.parameters(), Category.PARAMETER),
            (model.buffers(), Category.BUFFER),
            ((p.grad for p in model.parameters() if p.grad is not None), Category.GRADIENT),
            ([v for st in state for v in st.values() if isinstance(v, torch.Tensor)], Category.OPTIMIZER),
            (inputs, Category.INPUT),
            (dataset, Category.OTHER),
        ):
            rec.register_start(tensors, category)
        storages = {id(t.untyped_storage()): t.untyped_storage() for t in dataset}
        self._outside = sum(storage_bytes(s.nbytes(), s.device) for s in storages.values())
        self._rec = rec.__enter__()

    def phase(self, name: str) -> None:
        from memfit.measure.ledger import Category
        from memfit.measure.scope import Phase

        if self._rec is None:
            return
        if name == "after backward":  # the graph went with backward; the next micro-batch's forward
            self._rec.free_graph()
            name = "forward"
        elif name == "optimizer":
            self._rec.mark((p.grad for p in self._model.parameters() if p.grad is not None), Category.GRADIENT)
        self._scope.set_phase(Phase[name.upper()])

    def end(self) -> None:
        rec, self._rec = self._rec, None
        rec.__exit__(None, None, None)
        self.peaks.append(rec.ledger().peak_bytes - self._outside)
        rec.close()
        self._scope.__exit__(None, None, None)


def _recorded_trainer_steps(trainer) -> _RecordedSteps:
    """Records each of the transformers Trainer's steps (test code beside the run; the user's run has only memfit's line)."""
    tf = pytest.importorskip("transformers")
    steps = _RecordedSteps()

    class Hooks(tf.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            steps.begin(model, optimizer)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            steps.phase("optimizer")

        def on_step_end(self, args, state, control, **kwargs):
            steps.end()

    backward = trainer.accelerator.backward

    def recorded_backward(loss, **kwargs):  # no callback between a micro-batch's forward and its backward
        steps.phase("backward")
        backward(loss, **kwargs)
        steps.phase("after backward")

    trainer.accelerator.backward = recorded_backward
    trainer.add_callback(Hooks())
    return steps


@functools.cache
def _hf_budget(arch: str = "gpt2") -> tuple[int, int]:
    """60% of the way from the step's start to its unplanned peak: recompute or micro-batches needed."""
    model = _gpt2(arch)
    data = _Tokens(arch)
    batch = {key: torch.stack([data[i][key] for i in range(BATCH)]) for key in ("input_ids", "labels")}
    prof = memfit.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()))
    return prof.start_bytes + (prof.peak_bytes - prof.start_bytes) * 6 // 10, prof.peak_bytes


def _trainer_step_peak(trainer, plan) -> int:
    """memfit's measurement of the run's step as the Trainer ran it: its model (plan
    applied), its optimizer (state created), a step's batch in its micro-batches. Every
    step of this run has the same shapes (fixed-length samples), so one stands for all."""
    from memfit.integrations.transformers import _plain_optimizer

    k = trainer.args.gradient_accumulation_steps
    assert trainer.model.__dict__.get("_memfit_applied") or not (plan and plan.checkpointed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = iter(trainer.get_train_dataloader().base_dataloader)
        micro = [next(batches) for _ in range(k)]
    batch = {key: torch.cat([m[key] for m in micro]) for key in micro[0]}
    return memfit.profile(
        trainer.model, batch, optimizer=_plain_optimizer(trainer.optimizer), step=StepOptions(micro_batches=k)
    ).peak_bytes


@pytest.mark.parametrize(("mode", "arch"), [("fit", "gpt2"), ("plan", "gpt2"), ("callback", "t5")])
def test_trainer_fits_and_trains_as_by_hand(tmp_path, mode, arch):
    """``fit``: fit_trainer before train() (micro-batches allowed); ``plan``: fit_trainer,
    recompute only; ``callback``: MemfitCallback, which plans at on_train_begin, with
    gradient_checkpointing=True, which the plan replaces."""
    from memfit.integrations.transformers import MemfitCallback, fit_trainer

    budget, none_peak = _hf_budget(arch)
    said: list[str] = []
    if mode in ("fit", "plan"):
        trainer = _hf_trainer(tmp_path / "a", _gpt2(arch), arch=arch)
        callback = fit_trainer(trainer, budget, mode=mode, log=said.append)  # the one line
    else:
        callback = MemfitCallback(budget, log=said.append)
        trainer = _hf_trainer(tmp_path / "a", _gpt2(arch), callbacks=[callback], gradient_checkpointing=True, arch=arch)
    steps = _recorded_trainer_steps(trainer)
    trainer.train()
    assert callback.predicted_peak_bytes <= budget < none_peak
    assert len(steps.peaks) == 3 and max(steps.peaks) <= budget, (steps.peaks, budget)  # every step the Trainer ran
    assert callback.measured_peak_bytes is not None and callback.measured_peak_bytes <= budget
    assert any("predicted" in line and "measured" in line for line in said), said
    batch, k = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert batch * k == BATCH  # the effective batch is unchanged
    plan = callback.plan
    if mode == "plan":  # applied before train(), which builds the dataloader after it
        assert plan.checkpointed and k == 1
    elif mode == "callback":
        assert plan.checkpointed and k == 1
        assert any("gradient_checkpointing=True" in line for line in said), said
        # the plan's modules only, not transformers' every-layer checkpointing beside them
        assert not trainer.args.gradient_checkpointing and not trainer.model.is_gradient_checkpointing
    else:
        recipe = callback.recipe
        assert recipe.levers and ("microbatch" in recipe.levers) == (k > 1)
        # what fit_trainer set is what the recipe says, also after a round trip through JSON
        again = memfit.Recipe.from_json(recipe.to_json()).training_arguments()
        assert again.get("per_device_train_batch_size", BATCH) == batch
        assert again.get("gradient_accumulation_steps", 1) == k
        assert recipe.training_arguments_missing() == []
        # memfit fit's output says the same in the Trainer's terms
        from rich.console import Console

        from memfit.report.console import render_fit

        console = Console(record=True, width=200)
        render_fit(recipe, console)
        line = next(row for row in console.export_text().splitlines() if row.startswith("in transformers' Trainer"))
        if k > 1:
            assert f"per_device_train_batch_size={batch}, gradient_accumulation_steps={k}" in line
    assert _trainer_step_peak(trainer, plan) <= budget

    by_hand = _gpt2(arch)
    if plan is not None and plan.checkpointed:
        memfit.apply(by_hand, plan)
    reference = _hf_trainer(tmp_path / "b", by_hand, batch=batch, accumulate=k, arch=arch)
    reference.train()
    assert len(_losses(trainer)) == 3
    assert _losses(trainer) == _losses(reference)
    for p, q in zip(trainer.model.parameters(), reference.model.parameters()):
        assert torch.equal(p, q)


# -- Lightning --------------------------------------------------------------------------

WIDTH, TOKENS, ROWS = 64, 32, 256


def _lightning():
    return pytest.importorskip("lightning.pytorch", reason="lightning is not installed: pip install 'memfit[lightning]'")


def _module_base(batch_size: int, limit: int | None):
    """What the test's LightningModules share: ``batch_size`` (the finders' batch_arg_name),
    AdamW, a shuffled loader of ``self.data``, and the emulated memory limit's hook."""
    pl = _lightning()

    class Base(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = batch_size
            self.emulated = _EmulatedLimit(limit) if limit is not None else None

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def on_train_batch_start(self, batch, batch_idx):
            # a module hook, not a callback: Lightning's finder runs its trials without callbacks
            if self.emulated is not None:
                self.emulated(self, batch)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    return Base


def _net(batch_size: int = 16, limit: int | None = None):
    class Net(_module_base(batch_size, limit)):
        def __init__(self) -> None:
            super().__init__()
            blocks = [
                nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * WIDTH, WIDTH))
                for _ in range(4)
            ]
            self.layers = nn.Sequential(*blocks)
            self.head = nn.Linear(WIDTH, 10)
            g = torch.Generator().manual_seed(3)
            self.data = torch.utils.data.TensorDataset(
                torch.randn(ROWS, TOKENS, WIDTH, generator=g), torch.randint(0, 10, (ROWS,), generator=g)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.head(self.layers(x).mean(1)), y)
            self.log("train_loss", loss)
            return loss

    torch.manual_seed(0)
    return Net()


def _pl_trainer(tmp_path, callbacks, max_steps=3, **extra):
    pl = _lightning()
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
        **extra,
    )


def _losses_callback():
    pl = _lightning()

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.values.append(outputs["loss"].item())

    return Losses()


def _step_peak(module, batch, optimizer) -> int:
    """Lightning's steady step at ``batch`` (the last step's gradients alive through the forward), measured for real."""
    from memfit.integrations.lightning import LIGHTNING_STEP, TrainingStep, training_loss

    return memfit.profile(
        TrainingStep(module), (batch,), loss_fn=training_loss, optimizer=optimizer, step=LIGHTNING_STEP
    ).peak_bytes


def _pl_model(kind: str = "mlp", **kwargs):
    """A LightningModule: ``mlp`` (_net), ``gpt2`` (a causal LM) or ``t5`` (a seq2seq model), as _lm."""
    return _net(**kwargs) if kind == "mlp" else _lm(arch=kind, **kwargs)


@functools.cache
def _pl_budget(kind: str = "mlp") -> tuple[int, int]:
    net = _pl_model(kind)
    opt = torch.optim.AdamW(net.parameters())
    from memfit.integrations.lightning import LIGHTNING_STEP, TrainingStep, training_loss

    batch = [t[:16].clone() for t in net.data.tensors]
    prof = memfit.profile(TrainingStep(net), (batch,), loss_fn=training_loss, optimizer=opt, step=LIGHTNING_STEP)
    return prof.start_bytes + (prof.peak_bytes - prof.start_bytes) * 6 // 10, prof.peak_bytes


def _recorded_lightning_steps(callback) -> tuple[_RecordedSteps, object]:
    """Records each of Lightning's steps (a test callback beside the run), on the module as
    memfit's callback applied the plan (to its TrainingStep wrapper, whose names the plan uses)."""
    pl = _lightning()
    from memfit.integrations.lightning import TrainingStep

    steps = _RecordedSteps()

    class Hooks(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % trainer.accumulate_grad_batches == 0:
                module = callback._wrapper or TrainingStep(pl_module)
                steps.begin(module, trainer.optimizers[0], batch, pl_module.data.tensors)

        def on_before_backward(self, trainer, pl_module, loss):
            steps.phase("backward")

        def on_after_backward(self, trainer, pl_module):
            steps.phase("after backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            steps.phase("optimizer")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                steps.end()

    return steps, Hooks()


@pytest.mark.parametrize(
    ("mode", "kind"), [("plan", "mlp"), ("plan", "gpt2"), ("plan", "t5"), pytest.param("fit", "mlp", marks=pytest.mark.slow)]
)
def test_lightning_callback_fits_and_trains_as_by_hand(tmp_path, mode, kind):
    from memfit.integrations.lightning import MemfitCallback, TrainingStep

    warnings.filterwarnings("ignore", module="lightning")
    budget, none_peak = _pl_budget(kind)
    said: list[str] = []
    callback, losses = MemfitCallback(budget, mode=mode, log=said.append), _losses_callback()
    steps, recording = _recorded_lightning_steps(callback)
    net = _pl_model(kind)
    torch.manual_seed(5)
    trainer = _pl_trainer(tmp_path / "a", [callback, losses, recording])
    trainer.fit(net)
    assert callback.predicted_peak_bytes <= budget < none_peak
    assert len(steps.peaks) == 3 and max(steps.peaks) <= budget, (steps.peaks, budget)  # every step Lightning ran
    assert callback.measured_peak_bytes <= budget
    assert any("predicted" in line and "measured" in line for line in said), said
    k = callback.recipe.step.micro_batches if callback.recipe is not None else 1
    # what fit mode changed for the run is put back at its end
    assert net.batch_size == 16 and trainer.accumulate_grad_batches == 1
    plan = callback.plan
    if mode == "plan":
        assert plan.checkpointed and k == 1
    # the step as Lightning ran it (plan applied, micro-batch of batch_size, accumulated k times): memfit's ledger
    wrapper = TrainingStep(net)
    if plan is not None and plan.checkpointed:
        memfit.apply(wrapper, plan)
    batch = [t[:16].clone() for t in net.data.tensors]
    from memfit.integrations.lightning import LIGHTNING_STEP, training_loss

    peak = memfit.profile(
        wrapper, (batch,), loss_fn=training_loss, optimizer=trainer.optimizers[0], step=replace(LIGHTNING_STEP, micro_batches=k)
    ).peak_bytes
    assert peak <= budget

    by_hand = _pl_model(kind)
    hand = TrainingStep(by_hand)
    if plan is not None and plan.checkpointed:
        memfit.apply(hand, plan)
    by_hand.batch_size = 16 // k  # the micro-batch the callback trained with
    reference = _losses_callback()
    torch.manual_seed(5)
    _pl_trainer(tmp_path / "b", [reference], accumulate_grad_batches=k).fit(by_hand)
    assert len(losses.values) == 3 * k
    assert losses.values == reference.values
    for p, q in zip(net.parameters(), by_hand.parameters()):
        assert torch.equal(p, q)


class _EmulatedLimit:
    """Raises CUDA's out-of-memory error (the message Lightning's finder catches) before a
    training batch whose real step, measured by memfit's recorder, peaks over ``limit``."""

    peaks: dict[tuple[str, int], int] = {}
    """(model class, batch size) -> measured peak, shared by the runs (same model, same shapes)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tried: list[int] = []
        self.refused: list[int] = []
        self.ran: list[int] = []
        self.measuring_s = 0.0
        """Time spent measuring (not part of what Lightning's finder would take on a GPU)."""

    @classmethod
    def peak(cls, module, batch, optimizer) -> int:
        key = (type(module).__name__, batch[0].shape[0])
        if key not in cls.peaks:
            cls.peaks[key] = _step_peak(module, batch, optimizer)
        return cls.peaks[key]

    def __call__(self, module, batch) -> None:
        size = batch[0].shape[0]
        self.tried.append(size)
        started = time.perf_counter()
        peak = self.peak(module, batch, module.trainer.optimizers[0])
        self.measuring_s += time.perf_counter() - started
        if peak > self.limit:
            self.refused.append(size)
            raise RuntimeError(f"CUDA out of memory. (emulated on CPU: the step of batch {size} peaks over the limit)")
        self.ran.append(size)


def _lm(batch_size: int = 16, limit: int | None = None, arch: str = "gpt2"):
    """The finder's second model: a small GPT-2 LightningModule from a config (random
    weights, dropout on), trained on random token ids as its own labels; ``arch="t5"``: a
    small T5 (seq2seq), its target the first half of its source."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()

    class LM(_module_base(batch_size, limit)):
        def __init__(self) -> None:
            super().__init__()
            if arch == "t5":
                config = tf.T5Config(
                    vocab_size=64,
                    d_model=32,
                    d_kv=8,
                    d_ff=64,
                    num_layers=2,
                    num_heads=4,
                    decoder_start_token_id=0,
                    use_cache=False,
                )
                self.model = tf.T5ForConditionalGeneration(config)
            else:
                config = tf.GPT2Config(
                    n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0, use_cache=False
                )
                self.model = tf.GPT2LMHeadModel(config)
            ids = torch.randint(0, 64, (ROWS, 16), generator=torch.Generator().manual_seed(4))
            self.data = torch.utils.data.TensorDataset(ids)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids[:, :8].contiguous() if arch == "t5" else ids).loss
            self.log("train_loss", loss)
            return loss

    torch.manual_seed(0)
    return LM()


FINDER_MODELS = {"mlp": (_net, 45), "gpt2": (_lm, 7)}
"""model -> (its LightningModule, the largest batch under the emulated limit: not a power of two)."""


def compare_finders(root: Path, model: str, mode: str, largest: int | None = None) -> dict:
    """Lightning's BatchSizeFinder and memfit's on ``model`` under the emulated limit (the
    real step's measured peak at the largest batch in FINDER_MODELS): what each chose, the
    trial steps and out-of-memory errors, and the time of each. benchmarks/batch_size_finder.py
    tabulates this (``largest``: another batch for the limit than FINDER_MODELS')."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    from memfit.integrations.lightning import MemfitBatchSizeFinder

    warnings.filterwarnings("ignore", module="lightning")
    make, default = FINDER_MODELS[model]
    largest = largest or default
    probe = make()
    rows = probe.data.tensors
    limit = _EmulatedLimit.peak(probe, [t[:largest].clone() for t in rows], torch.optim.AdamW(probe.parameters(), lr=1e-3))

    lightnings = make(batch_size=2, limit=limit)
    emulated = lightnings.emulated
    finder = BatchSizeFinder(mode=mode, steps_per_trial=1, init_val=2, margin=0.0)
    started = time.perf_counter()
    _pl_trainer(root / "lightning", [finder], max_steps=1).fit(lightnings)
    lightning_s = time.perf_counter() - started

    ours = make(batch_size=2, limit=limit)
    memfit_finder = MemfitBatchSizeFinder(limit, mode=mode, init_val=2, margin=0.0, log=lambda s: None)
    started = time.perf_counter()
    _pl_trainer(root / "memfit", [memfit_finder], max_steps=1).fit(ours)
    memfit_s = time.perf_counter() - started
    return {
        "model": model,
        "mode": mode,
        "limit": limit,
        "largest": largest,
        "lightning": finder.optimal_batch_size,
        "lightning_module": lightnings.batch_size,
        "lightning_emulation": emulated,
        # the trial steps (the last batch tried is the fit's own first step, once the search is over)
        "lightning_trials": len(emulated.tried) - 1,
        "lightning_s": lightning_s - emulated.measuring_s,
        "memfit": memfit_finder.optimal_batch_size,
        "memfit_module": ours.batch_size,
        "memfit_largest": memfit_finder.limit.max_batch,
        "memfit_emulation": ours.emulated,
        "memfit_profiles": memfit_finder.limit.measurements,
        "memfit_search_s": memfit_finder.search_time_s,
        "memfit_s": memfit_s - ours.emulated.measuring_s,
    }


# one xdist worker per model: its two modes then share _EmulatedLimit.peaks (the real steps measured per batch)
@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.xdist_group(f"finder-{m}")) for m in ("mlp", "gpt2")])
@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_batch_size_finder_same_answer_as_lightnings(tmp_path, mode, model):
    got = compare_finders(tmp_path, model, mode)
    emulated, watch = got["lightning_emulation"], got["memfit_emulation"]
    assert emulated.refused  # the limit bit: Lightning's answer came from running out of memory
    # binsearch needs the largest batch that fits; power mode only the largest power of two (fewer profiles)
    from memfit.integrations.lightning import power_ladder

    wanted = got["largest"] if mode == "binsearch" else max(b for b in power_ladder(2, 8192) if b <= got["largest"])
    assert got["memfit_largest"] == wanted
    assert got["memfit"] == got["lightning"] == got["lightning_module"] == got["memfit_module"]
    assert watch.refused == [] and watch.ran == [got["memfit_module"]]  # memfit ran no step that does not fit
    print(
        f"{model} {mode}: batch {got['memfit']}; Lightning's finder: {got['lightning_trials']} trial steps at "
        f"{len(set(emulated.tried[:-1]))} batch sizes, {len(emulated.refused)} out of memory (emulated), "
        f"{got['lightning_s']:.2f} s less the emulation's measuring; memfit's: {got['memfit_profiles']} fake-tensor "
        f"profiles, {got['memfit_search_s']:.2f} s, no trial step"
    )


def test_fit_trainer_refuses_what_it_cannot_set(tmp_path):
    from memfit.integrations.transformers import fit_trainer

    trainer = _hf_trainer(tmp_path, _gpt2())
    with pytest.raises(memfit.PlanError, match="bf16=True"):
        fit_trainer(trainer, "5MiB", allow="amp")
    with pytest.raises(memfit.PlanError, match="mode"):
        fit_trainer(trainer, "5MiB", mode="everything")
    assert (
        trainer.args.per_device_train_batch_size == BATCH
        and trainer.callback_handler.callbacks[-1].__class__.__name__ != "MemfitCallback"
    )


def test_fit_exclude_names_only_levers_a_loop_can_lack():
    model = nn.Linear(4, 4)
    with pytest.raises(memfit.PlanError, match="'recompute'"):
        memfit.fit(model, torch.randn(8, 4), 10**9, exclude={"recompute": "no"})


def test_lightning_answer_follows_lightnings_rules():
    pytest.importorskip("lightning")
    from memfit.integrations.lightning import lightning_answer

    assert lightning_answer(45, "power") == 32
    assert lightning_answer(64, "power") == 64
    assert lightning_answer(45, "binsearch", margin=0.0) == 45
    assert lightning_answer(45, "binsearch") == 42  # int(45 * 0.95), as Lightning's margin
    assert lightning_answer(1, "power", init_val=2) == 1
    assert lightning_answer(10, "power", init_val=64) == 8  # 64, 32, 16 fail: Lightning halves until one fits
    assert lightning_answer(10_000, "power", max_val=8192) == 8192
    with pytest.raises(memfit.PlanError):
        lightning_answer(4, "exhaustive")
    with pytest.raises(memfit.PlanError, match="not even a batch of 1 fits"):
        lightning_answer(0, "power")


# -- the examples -----------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_example_hf_trainer(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    trainer = runpy.run_path(str(EXAMPLES / "hf_trainer.py"))["main"]()
    assert len(_losses(trainer)) == 3
    err = capsys.readouterr().err
    assert "memfit: budget 5.00 MiB:" in err and "predicted" in err


def test_example_lightning(capsys):
    _lightning()
    warnings.filterwarnings("ignore", module="lightning")
    fitted, finder = runpy.run_path(str(EXAMPLES / "lightning_module.py"))["main"]()
    assert fitted.predicted_peak_bytes <= fitted.plan.budget_bytes
    from memfit.integrations.lightning import lightning_answer

    assert finder.limit.max_batch > 2
    assert finder.optimal_batch_size == lightning_answer(finder.limit.max_batch, "binsearch")  # less the 5% margin
    assert finder.limit.peak_bytes <= 16 * 2**20


def test_applied_plan_keeps_the_forwards_signature():
    """transformers' Trainer keeps only the dataset columns its model's forward takes (read
    from the signature): a plan applied before the dataloader is built must not hide them."""
    import inspect

    from memfit.recompute.checkpoint import apply_choices

    model = _gpt2()
    before = list(inspect.signature(model.forward).parameters)
    apply_choices(model, {"": ("full", ()), "transformer.h.0": ("full", ())}, [""])
    assert list(inspect.signature(model.forward).parameters) == before
    assert "input_ids" in before
    memfit.remove(model)
