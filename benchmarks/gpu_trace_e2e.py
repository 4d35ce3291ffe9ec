"""End to end: predict a real GPU's training-step memory on fake CUDA, and check it against the
``torch.cuda.memory._dump_snapshot`` trace that GPU recorded, for a model whose recording code is
public with the trace.

    python benchmarks/gpu_trace_e2e.py MIRRORS [--deps DIR] [--only NAME] [--out table.md]

``MIRRORS`` holds the fetched repositories as the fetch tool lays them out
(``MIRRORS/<owner>+<name>/repo``, a bare git directory; never committed: docs/benchmarks/gpu-traces.md says which).
For each case below, the recording repository's model and optimizer code is exported at the
trace's commit into a temporary directory and imported from there; the same step (dims, batch,
context length, autocast, optimizer, the recording script's loop) runs on fake CUDA in a fresh
interpreter (``MEMFIT_FAKE_CUDA=1`` before torch starts) under :func:`memfit.profile`, and its
``allocated_peak_bytes`` / ``reserved_peak_bytes`` are compared with the peaks the GPU recorded
over the traced span (:func:`memfit.cuda.snapshot.relive`: the state the trace starts with
included, as memfit's peaks include the step's start).

What the traced span is, per recording script, and how the prediction covers the same span:

* CS336 assignment 2 ``nsys_profile.py --memory-profiler pytorch --pattern full-training-step``
  (Wedsonlin/assignment2-systems): 5 warm-up steps, ``del output, loss``, ``zero_grad``, then
  recording of one step ``forward + cross_entropy, backward, optimizer.step()``. The trace starts
  with the parameters, AdamW's state and the token tensors alive, and with the segments the
  warm-up steps left cached. memfit's ``reserved_peak_bytes`` replays one step from an empty
  cache; ``warm`` below also replays the warm-up the script ran (the first step creating the
  optimizer state mid-step, then steady steps) before the measured step, through the same model.
* The same script's ``--pattern forward-only``: ``model.eval()``, under ``torch.inference_mode()``
  5 warm-up forwards whose output is dropped, then one recorded forward. The trace starts with the
  parameters, the token tensors and cuBLAS's workspace alive and the warm-up's segments cached;
  memfit's step is ``StepOptions(inference=True)``, and ``warm`` replays the 5 forwards first.
* MAGMA27/assignment2-systems ``cs336_systems/benchmarking_script.py``: 5 warm-up passes (forward,
  cross_entropy, backward) with no ``zero_grad`` and no optimizer, then one traced pass. The trace
  starts with the gradients and the last warm-up's logits alive. memfit's step keeps gradients
  (``set_to_none=False``), steps a stand-in optimizer that allocates nothing (``SGD(lr=0)``) and
  holds the previous pass's logits until the next forward returns, as the script does
  (``StepOptions(holds_output=True)``: ``lm_head = model(data)`` rebinds them then).
* JasperSolt/EoR_NN ``counterfactuals.py``: the model run once before the loop (``get_samples``), then
  Adam on the input image for 10 steps; memfit's step says so (``StepOptions(forward_before_loop=True)``:
  the forward's cuBLAS workspace exists before the first step) and its own loop replay is the script's.
* Maphsge4/select_n ``bert/bert_original.py`` -> ``validate_old.py``: BERT-large masked-LM evaluation
  under ``no_grad``, two batches, the first's logits held until the second forward returns
  (``output = model(images)``: memfit's step says so, ``StepOptions(holds_output=True)``), recorded
  from before the first; the model is the repository's bundled transformers 4.31 BERT (``BERT_MODEL``).
  Its cuBLAS workspace (32 MiB) is the script's ``CUBLAS_WORKSPACE_CONFIG`` (the case's ``env``).

Every case names the GPU it runs as (``gpu``): the traces' cuBLAS workspaces (8,519,680 B; BERT's set by
its env) say pre-Hopper, and memfit's default (H100) would add 32 MiB workspaces instead.

The fetched code needs ``einops``, ``einx`` and ``jaxtyping`` importable (``--deps DIR``: a
``pip install --target DIR einops einx jaxtyping``, put on the child's path only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

# (name, repo, commit, trace path, model dims, context length, autocast dtype or None, what the trace covers)
_MEDIUM = {"vocab_size": 10000, "d_model": 1024, "d_ff": 4096, "num_layers": 24, "num_heads": 16}
_W = ("Wedsonlin/assignment2-systems", "87b086417ea831f54f7535eb3680f90da0952722")
CASES = [
    {
        "name": f"medium ctx{n} {'bf16 autocast' if dtype else 'fp32'} train",
        "repo": _W[0],
        "commit": _W[1],
        "trace": f"results/medium_{n}_training_memory_snapshot.pickle",
        "code": "cs336-basics",
        "family": "decoder LM",
        "script": "cs336_systems/nsys_profile.py",
        "dims": {**_MEDIUM, "context_length": n},
        "batch": 4,
        "autocast": dtype,
        "warmup": 5,
        "span": "full-training-step",
        "gpu": "A100-80GB",  # the trace holds two 8,519,680 B cuBLAS workspaces (forward's and backward's thread)
        "output_module": "lm_head",
    }
    # the script's --autocast flag is not in the trace: read from it (the logits lm_head allocates are 4 B
    # per element at 128 and 256 tokens, 2 B at 512 and 1024, with float32 log_softmax copies beside them)
    for n, dtype in ((128, None), (256, None), (512, "bfloat16"), (1024, "bfloat16"))
]
# JasperSolt/EoR_NN counterfactuals.py (the trace's own frames: regressors/latent_cnn.py lines 59-70 as at
# this commit): a trained CNN (lcnn, cnn_config.yaml: 30 channels in, 256 x 256, convs 16/32/64 with
# BatchNorm and max-pool, linear 200/100/20/1), frozen, and Adam (lr 0.005) on a copy of its input
# image. The trace's own sizes confirm it: conv0's weight 17,280 B (16 x 30 x 3 x 3 floats), linear0's
# 51,200 B (200 x 64), the image 7,864,320 B (30 x 256 x 256), two cuBLAS workspaces of 8,519,680 B
# (torch's default before Hopper), one 7,864,320 B Adam temporary (_multi_tensor_adam). The recording
# began after the model was on the GPU and had run a forward (get_samples: the trace starts with the
# forward's cuBLAS workspace alive in the 20 MiB segment of that forward's input copy), which the step
# says (StepOptions.forward_before_loop), and spans the image's copy to the GPU and 10 steps (the first
# creates Adam's state). The two loss terms the script logs (x_loss_e, y_loss_e) live until the next
# step rebinds them: two 512 B blocks alive at the backward peak. Not modelled: the script's
# set_detect_anomaly(True), whose NaN checks fake tensors cannot run (1-byte blocks allocated and freed
# in backward, none alive at the peak).
CASES.append(
    {
        "name": "small CNN, Adam on its input image",
        "kind": "eor_counterfactual",
        "repo": "JasperSolt/EoR_NN",
        "commit": "6686e9f4bc5edcc86209915a0d5fe694b836b8b7",
        "trace": "snapshot.pickle",
        "code": "regressors",
        "family": "CNN",
        "script": "counterfactuals.py",
        "path": ".",
        "gpu": "A100-80GB",
    }
)
# --- issue 23 item 5 (corpus): cases appended in one block ---
# The same script's --pattern forward-only: model.eval(), under torch.inference_mode() 5 warm-up
# forwards whose output is dropped, reset_peak_memory_stats(), then one recorded forward. The
# --autocast flag again read from the trace: the logits are 4 B per element at 128, 256 and 1024
# tokens (fp32; the 1024-token scores are fp32 16x1024x1024 blocks of 256 MiB, no bf16 copies of
# the weights), 2 B at 512 (bf16, beside bf16 casts of every weight).
CASES += [
    {
        "name": f"medium ctx{n} {'bf16 autocast' if dtype else 'fp32'} eval",
        "repo": _W[0],
        "commit": _W[1],
        "trace": f"results/medium_{n}_inference_memory_snapshot.pickle",
        "code": "cs336-basics",
        "family": "decoder LM",
        "script": "cs336_systems/nsys_profile.py",
        "dims": {**_MEDIUM, "context_length": n},
        "batch": 4,
        "autocast": dtype,
        "warmup": 5,
        "inference": True,
        # the trace holds one 8,519,680 B block from before it began: cuBLAS's default workspace
        # below compute capability 9 (Hopper's is 32 MiB); any 8.x GPU answers the same here
        "gpu": "A100-80GB",
        "span": "forward-only",
        "output_module": "lm_head",
    }
    for n, dtype in ((128, None), (256, None), (512, "bfloat16"), (1024, None))
]
# MAGMA27's benchmarking_script.py at "ep5" (the CS336 small configuration as it sets it: d_model 768,
# d_ff 3072, 12 layers, 12 heads, vocab 10,000, batch 32 x 256, fp32): 5 warm-up passes
# `lm_head = model(data); loss = cross_entropy(lm_head, target); loss.backward()` with no optimizer
# and no zero_grad (gradients accumulate), then one recorded pass. The trace's own sizes: the logits
# are 32*256*10,000*4 = 327,680,000 B; the 72 blocks of 9,437,184 B are the 12 layers' w1/w2/w3 and
# their gradients (768*3,072*4), alive from the start; the last warm-up's logits are freed when the
# recorded forward returns (`lm_head` is rebound then, nothing `del`s it); two 8,519,680 B cuBLAS workspaces.
CASES += [
    {
        "name": "small ctx256 fp32 5 passes accumulating",
        "repo": "MAGMA27/assignment2-systems",
        "commit": "15883f2b1d6bc52439d8935e280bce430151f361",
        "trace": "memory_snapshot.pickle",
        "code": "cs336-basics",
        "family": "decoder LM",
        "script": "cs336_systems/benchmarking_script.py",
        "dims": {"vocab_size": 10000, "context_length": 256, "d_model": 768, "d_ff": 3072, "num_layers": 12,
                 "num_heads": 12, "rope_theta": 10000},
        "batch": 32,
        "autocast": None,
        "warmup": 5,
        "optimizer": None,
        "set_to_none": False,
        "holds_output": True,  # `lm_head = model(data)`: the previous pass's logits live until it is rebound
        "del_output": False,
        "gpu": "A100-80GB",
        "span": "forward + loss + backward, gradients accumulating",
        "output_module": "lm_head",
    }
]

# Maphsge4/select_n bert/bert_original.py (run as `python -m bert.bert_original`, default arguments except
# the batch): BertForMaskedLM from bert/bert_large_uncased_config.json (24 layers, hidden 1024, 16 heads,
# ffn 4096, vocab 30,522), fp32, model.cuda(), then validate_old.py: model.eval(), torch.no_grad(),
# _record_memory_history, then `for images, target in loader: images = images.cuda(); target = ...;
# output = model(images)` over the loader's 2 batches (prepare_dataloader(2 * batch, batch, vocab)), then
# the snapshot: no loss, no backward. The trace's own sizes confirm it: it starts with 1,341,517,312 B
# alive (the weights; the 30,522 x 1,024 embedding, tied to the decoder, one 120 MiB block, the split rule
# leaving its 0.8 MiB tail in it), the logits are 500,072,448 B = 8*512*30,522*4 (batch 8, fp32), the
# scores 134,217,728 B = 8*16*512*512*4, hidden states 16 MiB = 8*512*1,024*4; the first batch's logits
# are freed when the second forward returns (`output` rebound), after the second's were made: two logits
# blocks at the peak. The cuBLAS workspace is 33,554,432 B: utils.seed_all sets
# CUBLAS_WORKSPACE_CONFIG=:4096:8 (8 x 4 MiB) before CUDA starts. Not modelled: torch 2.1's separate
# 1 MiB cuBLASLt workspace, allocated and freed around each addmm (torch now shares cuBLAS's), the
# 32 KiB token batches re-copied per batch, the 5,120 B `target` batch copied and never used, and memfit's evaluation step running under inference_mode
# where the script ran no_grad (neither keeps anything for backward in a forward).
CASES += [
    {
        "name": "BERT-large MLM eval 8x512 fp32 no_grad",
        "kind": "bert_eval",
        "repo": "Maphsge4/select_n",
        "commit": "1f2f548046cdbb1962c54843a8149a88b930a5f1",
        "trace": "snapshot.pickle",
        "code": "lib/transformers bert",  # the bundled transformers and the config file, exported
        "config": "bert/bert_large_uncased_config.json",
        "path": ".",
        "family": "encoder",
        "script": "bert/bert_original.py -> validate_old.py",
        "batch": 8,
        "seq_len": 512,
        "inference": True,
        "warmup": 1,  # the first of the loader's two batches; the trace spans both
        "peaks_from_start": True,  # recording began before the first batch; no peak reset
        "holds_output": True,
        "del_output": False,
        "output_module": "cls.predictions.decoder",
        "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        "gpu": "A100-80GB",  # the trace does not say which GPU: its workspace size is the env's, not the GPU's
        "span": "2 evaluation forwards, the first's logits held into the second",
    }
]

CS336_MODEL = r"""
import json, sys
import memfit  # first: loads the fake CUDA shim before torch (MEMFIT_FAKE_CUDA=1)
import torch
from cs336_basics.model import BasicsTransformerLM
from cs336_basics.optimizer import AdamW
from cs336_basics.nn_utils import cross_entropy

case = json.loads(sys.argv[1])
d = case["dims"]
torch.manual_seed(0)
model = BasicsTransformerLM(**d)
if case.get("optimizer", "AdamW") == "AdamW":
    optimizer = AdamW(model.parameters())
else:
    # The script steps no optimizer; memfit's step always runs one. Plain SGD with lr 0 (no momentum,
    # no weight decay) keeps no state and updates in place (_foreach_add_): it allocates nothing.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
x = torch.randint(0, d["vocab_size"], (case["batch"], d["context_length"]))
y = torch.randint(0, d["vocab_size"], (case["batch"], d["context_length"]))
inference = case.get("inference", False)
# The script binds the output to a name and the traced step starts with the last warm-up's (no `del`
# before it): memfit's step holds it so (a script that `del`s it before the traced step starts without;
# its warm-up steps' holding is the loop replay's, below).
holds = case.get("holds_output", not inference) and not case.get("del_output", True)
step = memfit.StepOptions(
    autocast=case["autocast"], inference=inference, set_to_none=case.get("set_to_none", True), holds_output=holds
)
if inference:  # the script calls the model and drops what it returns: no loss, no targets
    prof = memfit.profile(model, x, optimizer=optimizer, fake="cuda", step=step, gpu=case.get("gpu"))
else:
    prof = memfit.profile(
        model, x, targets=y, loss_fn=cross_entropy, optimizer=optimizer, fake="cuda", step=step, gpu=case.get("gpu")
    )
"""

# BERT-large masked-LM evaluation (Maphsge4/select_n bert/bert_original.py -> validate_old.py). The model
# classes are the repository's own lib/transformers/models/bert/modeling_bert.py (transformers 4.31 as
# bundled, exported at the trace's commit), not the installed transformers': its attention computes
# matmul, / sqrt(d), + the all-ones mask's additive form, softmax, and keeps scores and probabilities until
# the layer returns, where the installed eager path (matmul * scale, softmax, no mask) frees the first at
# softmax; the two place the 64 MiB FFN blocks into the 128 MiB score segments differently (+2.95% reserved
# with the installed one). The bundled package itself does not import here (4.31 wants `requests` and the
# hub client of its day), so its modeling file is loaded into the installed transformers.models.bert
# package (its relative imports resolve to the installed PreTrainedModel, outputs and activations), given
# back what it calls on 4.31's PreTrainedModel that transformers 5 dropped (the mask helpers, compiled from
# the bundled modeling_utils.py's own source) and transformers 5's form of its tied weights (the decoder
# shares the word embeddings, as in 4.31). Weights random, the repository's config file, no download.
BERT_MODEL = r"""
import ast, importlib.util, json, os, sys, typing, warnings
import memfit  # first: loads the fake CUDA shim before torch (MEMFIT_FAKE_CUDA=1)
import torch
import transformers.pytorch_utils
from transformers import BertConfig
from transformers.models.bert import modeling_bert as installed
from transformers.utils import logging

case = json.loads(sys.argv[1])
inference = True
lib = os.path.join(case["code_dir"], "lib", "transformers")
if not hasattr(transformers.pytorch_utils, "find_pruneable_heads_and_indices"):  # imported, used by prune_heads only
    transformers.pytorch_utils.find_pruneable_heads_and_indices = None
spec = importlib.util.spec_from_file_location(
    "transformers.models.bert.select_n_modeling_bert", os.path.join(lib, "models", "bert", "modeling_bert.py")
)
bundled = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bundled
spec.loader.exec_module(bundled)

mu = os.path.join(lib, "modeling_utils.py")
tree = ast.parse(open(mu).read(), mu)
helpers = {"get_extended_attention_mask", "create_extended_attention_mask_for_decoder", "get_head_mask",
           "_convert_head_mask_to_5d", "invert_attention_mask", "warn_if_padding_and_no_attention_mask"}
defs = [f for c in tree.body if isinstance(c, ast.ClassDef) and c.name in ("ModuleUtilsMixin", "PreTrainedModel")
        for f in c.body if isinstance(f, ast.FunctionDef) and f.name in helpers]
mixin = ast.ClassDef(name="ModuleUtilsMixin", bases=[], keywords=[], body=defs, decorator_list=[])
ns = {"torch": torch, "Tensor": torch.Tensor, "Optional": typing.Optional, "Tuple": typing.Tuple, "warnings": warnings,
      "logger": logging.get_logger(spec.name)}
exec(compile(ast.fix_missing_locations(ast.Module(body=[mixin], type_ignores=[])), mu, "exec"), ns)
for name in helpers:
    setattr(bundled.BertModel, name, ns["ModuleUtilsMixin"].__dict__[name])
# Its padding check reads a value (`pad_token_id in input_ids[:, [-1, 0]]`, an .item()), which fake tensors
# cannot answer; on the GPU it made three 512 B blocks in the small pool and freed them: skipped here.
bundled.BertModel.warn_if_padding_and_no_attention_mask = lambda self, input_ids, attention_mask: None
bundled.BertForMaskedLM._tied_weights_keys = installed.BertForMaskedLM._tied_weights_keys

config = BertConfig.from_json_file(os.path.join(case["code_dir"], case["config"]))
torch.manual_seed(0)
model = bundled.BertForMaskedLM(config)
assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
# the script's dummy data loader: token ids in [3, vocab) of shape batch x 512, copied to the GPU per batch
x = torch.randint(3, config.vocab_size, (case["batch"], case["seq_len"]))
# memfit's step always has an optimizer; an inference step never steps it (the script's Adam is never stepped)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
# `output = model(images)`: the first batch's MaskedLMOutput (its logits) lives until the second
# forward returns; memfit's evaluation step holds the whole output so (StepOptions.holds_output)
step = memfit.StepOptions(inference=True, holds_output=case.get("holds_output", False) and not case.get("del_output", True))
prof = memfit.profile(model, x, optimizer=optimizer, fake="cuda", step=step, gpu=case.get("gpu"))
"""

# The recording loop replayed over the profiled step's ledger: needs `case`, `prof` and `inference`.
LOOP_REPLAY = r"""
from memfit.cuda.allocator import Alloc, CachingAllocator, Free
from memfit.measure.replay import ledger_events
from memfit.measure.ledger import Phase
from memfit.measure.profile import allocator_settings_from_env

led = prof.ledger

# The recording script's warm-up before the traced step, through the same allocator model: the
# parameters and token tensors first, a first step that has no optimizer state to free (it creates
# it), then steady steps, then the traced step, whose peaks are taken from its start
# (torch.cuda.reset_peak_memory_stats): allocated from what is alive then, reserved as the cache
# then holds it. What a step frees of its start (AdamW's old state) is what the step before left
# alive (its new state): paired in order, sizes checked.
blocks = {b.id: b for b in led.blocks}
events = ledger_events(led)
starting = [e.id for e in events if isinstance(e, Alloc) and blocks[e.id].born < 0]
body = [e for e in events if not (isinstance(e, Alloc) and blocks[e.id].born < 0)]
dying = [e.id for e in body if isinstance(e, Free) and blocks[e.id].born < 0]
kept = [e.id for e in body if isinstance(e, Alloc) and blocks[e.id].died is None]
if [blocks[i].nbytes for i in dying] != [blocks[i].nbytes for i in kept]:
    raise SystemExit("the step's freed start tensors do not pair with the tensors it leaves alive")
successor = dict(zip(dying, kept))
settings = allocator_settings_from_env()
alloc = CachingAllocator(settings)
live = {}

def run(evs):
    for e in evs:
        if isinstance(e, Alloc):
            live[e.id] = alloc.malloc(e.size)
        else:
            b = live.pop(e.id, None)
            if b is not None:
                alloc.free(b)

# The script keeps `output` (the logits) until the next step's forward has returned
# (`output = model(...)` rebinds it then), and `del`s it only before the traced step. The logits: the
# largest tensor the forward made in the model's last module. An evaluation loop that drops the output
# (`model(x)` unassigned) holds nothing across steps; one that assigns it (`output = model(x)`,
# "holds_output") holds it until the next forward returns. Where memfit's step holds it already
# (StepOptions.holds_output: the traced step starts with it, no `del` before), its ledger has the
# previous step's output alive at the start, freed as the forward returns, and its own alive at the end,
# which the pairing above joins: nothing to do here. Else (memfit's step drops it after backward) the
# warm-up steps hold it by hand.
last_module = [b for b in led.blocks if b.phase is Phase.FORWARD and b.module == case["output_module"]]
logits = max(last_module, key=lambda b: b.nbytes).id
holds_output = case.get("holds_output", not inference) and not prof.step.holds_output
rebound = next(
    i for i, t in enumerate(led.ticks) if i > blocks[logits].born and (t.module is None or t.phase is not Phase.FORWARD)
)

def tick(e):
    return blocks[e.id].born if isinstance(e, Alloc) else blocks[e.id].died

def step(k, hold_previous):
    # step k's own tensors are (k, id); a start tensor it frees is step k-1's survivor
    out = []
    for e in body:
        if hold_previous and tick(e) >= rebound:
            out.append(Free((k - 1, logits)))
            hold_previous = False
        if isinstance(e, Alloc):
            out.append(Alloc((k, e.id), e.size))
        elif e.id == logits and holds_output:
            continue
        elif e.id in successor:
            out.append(Free((k - 1, successor[e.id])))
        else:
            out.append(Free((k, e.id)))
    return out

run([Alloc((0, i), blocks[i].nbytes) for i in starting if i not in successor])
for k in range(1, case["warmup"] + 1):
    run(step(k, hold_previous=holds_output and k > 1))
# Without `del output` before the traced step, the last warm-up's logits live into it.
held = holds_output and not case.get("del_output", True)
if holds_output and not held:
    run([Free((case["warmup"], logits))])  # del output, loss
if not case.get("peaks_from_start", False):  # the script reset the peaks before the traced step
    alloc.allocated_peak, alloc.reserved_peak = alloc.allocated, alloc.reserved
    alloc.reserved_at_allocated_peak = alloc.reserved
run(step(case["warmup"] + 1, hold_previous=held))
warm = alloc.stats()
print(json.dumps({
    "peak_bytes": prof.peak_bytes,
    "allocated_peak_bytes": prof.allocated_peak_bytes,
    "reserved_peak_bytes": prof.reserved_peak_bytes,
    "warm_allocated_peak_bytes": warm.allocated_peak_bytes,
    "warm_reserved_peak_bytes": warm.reserved_peak_bytes,
    "peak_phase": prof.peak["phase"],
}))
"""


EOR_CHILD = r"""
import json, sys, types
import memfit  # first: loads the fake CUDA shim before torch (MEMFIT_FAKE_CUDA=1)
import torch
from torch import nn, optim
from memfit.cuda import fake as _fake_cuda
from memfit.cuda.gpu import GPUS

case = json.loads(sys.argv[1])
# latent_cnn.py imports, for its training functions, modules the model class does not use (h5py, pandas)
sys.modules.setdefault("omegaconf", types.SimpleNamespace(OmegaConf=None))
sys.modules["EoR_Dataset"] = types.SimpleNamespace(SimpleEORImageDataset=None)
sys.modules["util"] = types.ModuleType("util")
sys.modules["util.plotting"] = types.SimpleNamespace(plot_loss=None)
from regressors.latent_cnn import lcnn

_fake_cuda.set_gpu(GPUS[case["gpu"]])
ns = lambda **k: types.SimpleNamespace(**k)
cfg = ns(
    model=ns(conv_channels=[16, 32, 64], downsample=[True] * 3, global_maxpool=True, linear_features=[200, 100, 20]),
    data=ns(zlength=30, boxlength=256),
)


class Counterfactual(nn.Module):
    # The image Adam optimizes is the step's parameter (memfit steps a model's parameters); it is
    # the module's own, so .to() order puts it after the CNN's, as the script copies it to the GPU last.
    def __init__(self, cnn, x_prime):
        super().__init__()
        self.cnn = cnn
        self.x_prime = nn.Parameter(x_prime)

    def forward(self, x):
        return self.cnn(self.x_prime), self.x_prime, x


logged = [None, None]  # the script's x_loss_e, y_loss_e: alive until the next step rebinds them


def loss_fn(out, y):  # CounterfactualLoss, and the two detached terms the script logs and keeps
    y_prime, x_prime, x = out
    total = ((x_prime - x) ** 2).mean() - (y_prime - y) ** 2
    logged[0] = ((x_prime - x) ** 2).mean().detach()
    logged[1] = (-((y_prime - y) ** 2)).detach()
    return total


torch.manual_seed(0)
cnn = lcnn(cfg)  # train mode, as get_model leaves it
for p in cnn.parameters():
    p.requires_grad = False
x = torch.randn(1, 30, 256, 256)
y = cnn(x).detach()
model = Counterfactual(cnn, x + torch.randn_like(x))
optimizer = optim.Adam([model.x_prime], lr=0.005)
# The script ran the model once before its loop (get_samples: y = model(x)), so the forward's cuBLAS
# workspace was made before the loop, not at the first step's first matmul: StepOptions says so
# (forward_before_loop) and memfit's own replay of the loop is then the script's.
step = memfit.StepOptions(forward_before_loop=True)
prof = memfit.profile(model, x, targets=y, loss_fn=loss_fn, optimizer=optimizer, fake="cuda", step=step)
print(json.dumps({
    "peak_bytes": prof.peak_bytes,
    "allocated_peak_bytes": prof.allocated_peak_bytes,
    "reserved_peak_bytes": prof.reserved_peak_bytes,
    "warm_allocated_peak_bytes": prof.allocated_peak_bytes,
    "warm_reserved_peak_bytes": prof.reserved_peak_bytes,
    "peak_phase": prof.peak["phase"],
}))
"""
CHILDREN = {"cs336": CS336_MODEL + LOOP_REPLAY, "bert_eval": BERT_MODEL + LOOP_REPLAY, "eor_counterfactual": EOR_CHILD}


def _git(mirror: Path, *args: str) -> bytes:
    return subprocess.run(["git", "--git-dir", str(mirror), *args], check=True, capture_output=True).stdout


def _mirror(mirrors: Path, repo: str) -> Path:
    m = mirrors / repo.replace("/", "+") / "repo"
    if not m.is_dir():
        raise SystemExit(f"{m}: not fetched (fetch github:{repo} into {mirrors})")
    return m


def recorded(mirrors: Path, case: dict, tmp: Path) -> dict:
    from memfit.cuda.snapshot import load_snapshot, relive

    pickle_path = tmp / "trace.pickle"
    pickle_path.write_bytes(_git(_mirror(mirrors, case["repo"]), "show", f"{case['commit']}:{case['trace']}"))
    rec = relive(load_snapshot(pickle_path))
    return {
        "allocated_peak_bytes": rec.stats.allocated_peak_bytes,
        "reserved_peak_bytes": rec.stats.reserved_peak_bytes,
        "start_allocated_bytes": rec.start_allocated_bytes,
        "start_reserved_bytes": rec.start_reserved_bytes,
    }


def predicted(mirrors: Path, case: dict, tmp: Path, deps: str | None) -> dict:
    code = tmp / "code"
    code.mkdir()
    # "code": the paths exported, space-separated
    archive = _git(_mirror(mirrors, case["repo"]), "archive", case["commit"], *case["code"].split())
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
    path = [SRC, str(code / case.get("path", case["code"]))] + ([deps] if deps else [])
    # the case's "env": what the recording script set in its environment before CUDA started
    env = {**os.environ, **case.get("env", {}), "MEMFIT_FAKE_CUDA": "1", "PYTHONPATH": os.pathsep.join(path)}
    child = CHILDREN[case.get("kind", "cs336")]
    arg = json.dumps({**case, "code_dir": str(code)})
    done = subprocess.run([sys.executable, "-c", child, arg], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{case['name']}: the fake-CUDA step failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pct(a: int, b: int) -> str:
    return f"{100.0 * (a - b) / b:+.2f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mirrors", type=Path)
    ap.add_argument("--deps", help="a directory with einops, einx, jaxtyping (pip install --target)")
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ns = ap.parse_args()
    sys.path.insert(0, SRC)
    mib = 1 << 20
    # allocated: block sizes, as torch.cuda.max_memory_allocated counts them (requests rounded to the
    # allocator's 512 B and split rules), on both sides; reserved: the segments cudaMalloc'd
    rows = [
        "| case | family | setup source (repo @ commit: script) | trace | recorded allocated | recorded reserved | "
        "memfit profile: allocated | err | reserved | err | the script's loop replayed: allocated | err | reserved | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        if ns.only and ns.only not in case["name"]:
            continue
        with tempfile.TemporaryDirectory() as t:
            rec = recorded(ns.mirrors, case, Path(t))
            pred = predicted(ns.mirrors, case, Path(t), ns.deps)
        ra, rr = rec["allocated_peak_bytes"], rec["reserved_peak_bytes"]
        cells = [
            case["name"],
            case["family"],
            f"{case['repo']} @ {case['commit'][:8]}: {case['script']}",
            case["trace"],
            f"{ra / mib:,.1f} MiB",
            f"{rr / mib:,.1f} MiB",
        ]
        for key, ref in (("", ra), ("", rr), ("warm_", ra), ("warm_", rr)):
            name = key + ("allocated_peak_bytes" if ref is ra else "reserved_peak_bytes")
            cells += [f"{pred[name] / mib:,.1f} MiB", _pct(pred[name], ref)]
        row = "| " + " | ".join(cells) + " |"
        rows.append(row)
        print(row, flush=True)
        print(json.dumps({"case": case["name"], "recorded": rec, "predicted": pred}), file=sys.stderr, flush=True)
    if ns.out:
        ns.out.write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
