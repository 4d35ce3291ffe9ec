"""Activation offload: saved activations kept in host memory (``torch.autograd.graph.save_on_cpu``).
A CUDA step's lever; not combined with recompute, whose checkpointed regions keep their own
saved tensors. :func:`memfit.fit` also measures its peak once before weighing it: a step that
cannot run with it leaves it out with that reason."""

from __future__ import annotations

from memfit.levers.catalog.base import Lever, Lines, Reason, Why


def _settings(s):
    if s.fake_cuda:
        return Reason(
            Why.UNAVAILABLE,
            "not weighed on fake CUDA (host memory and copies are not simulated): weigh it with fit on the GPU",
        )
    if s.device.type == "cpu":
        return Reason(
            Why.NOT_APPLICABLE,
            "activations offloaded to host memory (save_on_cpu) save nothing when the step runs on the host already",
        )
    if s.device.type != "cuda":
        return Reason(
            Why.UNAVAILABLE, f"activation offload to host memory is modelled for CUDA steps; this one runs on {s.device.type}"
        )
    if "offload" in s.exclude:
        return Reason(Why.EXCLUDED, s.exclude["offload"])
    return (True,)


LEVER = Lever(
    name="offload",
    exact=True,
    does="keep saved activations in host memory (torch.autograd.graph.save_on_cpu)",
    settings=_settings,
    used=lambda combo, plan, s: combo.offload,
    step=lambda combo, s: {"offload": combo.offload},
    words=lambda step, plan, optimizer_type: "activations offloaded to host memory",
    field="offload",
    lines=lambda recipe: Lines(context=("run.offload()", "torch.autograd.graph.save_on_cpu(pin_memory=True)")),
)
