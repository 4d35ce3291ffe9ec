"""Rendering for the terminal (rich): the names the CLI and the integrations import.

Each result type has its renderer in a module of its own (``profiles``, ``plans``, ``recipes``,
``bench``, ``snapshots``, ``zoo``), over the shared table layout (``layout``) and progress
(``progress``); this module gathers their public names so that callers import from one place.
"""

from __future__ import annotations

from memfit.report.bench import render_bench
from memfit.report.compiled import render_compiled
from memfit.report.layout import shorten_name
from memfit.report.plans import describe_ops, render_before_after, render_left_out, render_plan, render_untimed
from memfit.report.profiles import (
    render_cuda_memory,
    render_device_fit,
    render_groundtruth,
    render_profile,
    render_ranks,
    sparkline,
)
from memfit.report.progress import ProgressLines, progress_bar, status
from memfit.report.recipes import (
    render_fit,
    render_max_batch,
    render_rank_fit,
    render_training_arguments,
    render_world_size_fit,
)
from memfit.report.snapshots import render_snapshot
from memfit.report.zoo import render_zoo

__all__ = [
    "render_profile",
    "render_compiled",
    "render_ranks",
    "render_device_fit",
    "render_cuda_memory",
    "render_groundtruth",
    "render_plan",
    "render_before_after",
    "render_untimed",
    "render_bench",
    "render_fit",
    "render_max_batch",
    "render_rank_fit",
    "render_world_size_fit",
    "render_training_arguments",
    "render_left_out",
    "render_zoo",
    "render_snapshot",
    "describe_ops",
    "shorten_name",
    "progress_bar",
    "status",
    "ProgressLines",
    "sparkline",
]
