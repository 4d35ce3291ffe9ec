"""memfit's batch-size finder against Lightning's BatchSizeFinder (issue 16, item 2).

    python benchmarks/batch_size_finder.py [--out FILE.md] [--passes 2]

Runs ``compare_finders`` of tests/test_integrations.py (the test that asserts the same
answer) for each model (a 4-block MLP; a 2-layer GPT-2 from a config, random weights) and
each mode (power, binsearch), at the test's limits and GPT-2 at a higher one: Lightning's finder under an out-of-memory limit EMULATED on
the CPU (a step whose real peak, measured by memfit's recorder, is over the limit raises
CUDA's out-of-memory error), and memfit's finder, which predicts on fake tensors. Times are
the whole ``Trainer.fit`` (the search and one training step) less the emulation's own
measuring. Pass 1 is each case's first run in the process (what a user pays once); later
passes run warm (torch's fake-tensor dispatch cache and Lightning's imports are filled).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from _table import emit  # benchmarks/_table.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
finders = importlib.import_module("test_integrations")  # the test's models, limit and runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--passes", type=int, default=2)
    ns = parser.parse_args()
    rows = [
        "| pass | model | mode | largest batch under the limit | Lightning's batch | memfit's batch | Lightning: trial steps "
        "(batch sizes) | of which out of memory (emulated) | Lightning: time | memfit: fake-tensor profiles | memfit: search "
        "| memfit: time | memfit: steps over the limit run |",
        "|---:|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    # the test's cases, and GPT-2 under a higher limit (more trials for Lightning; the same 4 profiles for memfit)
    cases = [(model, largest) for model, (_, largest) in finders.FINDER_MODELS.items()] + [("gpt2", 45)]
    for run in range(1, ns.passes + 1):
        for model, largest in cases:
            for mode in ("power", "binsearch"):
                with tempfile.TemporaryDirectory() as root:
                    got = finders.compare_finders(Path(root), model, mode, largest)
                tried = got["lightning_emulation"].tried[:-1]  # the last is the fit's own step
                line = (
                    f"| {run} | {model} | {mode} | {got['largest']} | {got['lightning']} | {got['memfit']} "
                    f"| {len(tried)} ({', '.join(map(str, tried))}) | {len(got['lightning_emulation'].refused)} "
                    f"| {got['lightning_s']:.2f} s | {got['memfit_profiles']} | {got['memfit_search_s']:.2f} s "
                    f"| {got['memfit_s']:.2f} s | {len(got['memfit_emulation'].refused)} |"
                )
                print(line, flush=True)
                rows.append(line)
    emit(rows, "cpu", ns.out)


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the test: tiny models gain nothing from a second thread
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    main()
