"""The PNG timeline's text: long titles stay inside the figure, span labels of many layers show."""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import torch
from matplotlib.text import Text
from torch import nn

import memfit
from memfit.measure.ledger import Phase
from memfit.report.timeline import profile_timeline, timeline_figure


def _prof(layers: int = 22) -> memfit.Profile:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
    return memfit.profile(model, torch.randn(8, 32), fake=True)


def _texts(fig) -> list[Text]:
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def test_long_titles_stay_inside_the_figure():
    prof = _prof(4)
    title = "memfit plan path/to/a/workload/file/with/a/long/name.py:workload, budget 80.0 GiB H100-80GB - 0.50 GiB CUDA context estimate, on fake:cuda:0 " * 2
    tl = profile_timeline(prof, title)
    long_label = "the step with the recipe applied (micro-batches x4, bf16 autocast, recompute of 22 blocks); reserved peak 77.6 GiB"
    tl.tracks[0] = dataclasses.replace(tl.tracks[0], label=long_label)
    fig = timeline_figure(tl)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        width = fig.bbox.width
        for text in _texts(fig):
            box = text.get_window_extent(renderer)
            assert box.x0 >= -1 and box.x1 <= width + 1, (text.get_text()[:60], box.x1, width)
        shown = " ".join(t.get_text() for t in _texts(fig)).split()
        assert "77.6" in shown and "GiB" in shown  # wrapped, not cut
    finally:
        plt.close(fig)


def test_span_labels_of_22_layers_show_without_overlapping():
    prof = _prof(22)
    fig = timeline_figure(profile_timeline(prof, "22 layers"))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        lane = fig.axes[1]
        for row_y in (1.5, 0.5):  # forward above, backward below
            labels = [t for t in lane.texts if abs(t.get_position()[1] - row_y) < 1e-6]
            assert len(labels) >= 11, (row_y, [t.get_text() for t in labels])  # at least every other layer
            boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
            assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))  # none over another
        spans = [s for s in prof.ledger.spans if s.phase is Phase.FORWARD and s.module.isdigit()]
        assert len(spans) == 22
    finally:
        plt.close(fig)
