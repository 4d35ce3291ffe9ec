"""``python -m memfit.bench.child`` as docs/levers.md shows it: run by hand, without the
allocator setting, beside a workload that prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from memfit.bench.child import run_child

_NOISY = textwrap.dedent(
    """
    import torch
    from torch import nn

    import memfit

    class Loud(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256)

        def forward(self, x):
            print("forward!", end="")  # no newline: it would run into the JSON
            return self.fc(x).relu()

    def work():
        print("building the model")
        return memfit.Workload(Loud(), torch.randn(64, 256))
    """
)


def _child(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "loud.py").write_text(_NOISY)
    cmd = [sys.executable, "-m", "memfit.bench.child", f"{tmp_path / 'loud.py'}:work", "--measure", "memory"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_child_json_is_alone_on_stdout_and_sets_the_allocator_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = _child(tmp_path, env)
    out = json.loads(proc.stdout)  # the whole stdout: nothing the workload printed
    assert "error" not in out, out
    assert out["step_peak_bytes"] > 0 and out["method_used"] == "rss_hwm"
    assert out["malloc_mmap_threshold"] == "65536"  # ran again with it, as glibc needs it from the start
    assert "building the model" in proc.stderr and "forward!" in proc.stderr


def test_run_child_reads_a_printing_workload(tmp_path):
    (tmp_path / "loud.py").write_text(_NOISY)
    out = run_child(f"{tmp_path / 'loud.py'}:work", measure="flops")
    assert "error" not in out and out["step_flops"] > 0
