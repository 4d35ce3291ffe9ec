"""The end-to-end GPU-trace corpus is data: each case names what the child and the table read,
and every candidate trace examined says why it was kept or not."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEX40 = re.compile(r"[0-9a-f]{40}")


def _cases() -> list[dict]:
    spec = importlib.util.spec_from_file_location("gpu_trace_e2e", ROOT / "benchmarks" / "gpu_trace_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CASES


def test_every_case_names_its_setup_source_and_family():
    cases = _cases()
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names)), "case names select cases (--only): they must differ"
    for c in cases:
        # every case: where its setup and trace come from; the CS336 child also its dims and loop
        keys = ("repo", "commit", "trace", "code", "family", "script")
        if c.get("kind", "cs336") == "cs336":
            keys += ("dims", "batch", "warmup", "output_module")
        for key in keys:
            assert key in c, f"{c['name']}: no {key!r}"
        assert HEX40.fullmatch(c["commit"]), c["name"]
        assert c["family"] in {"CNN", "decoder LM", "encoder", "encoder-decoder", "diffusion", "vision transformer"}
        assert c.get("autocast") in (None, "bfloat16", "float16")
        # an evaluation step has no gradients to keep between steps
        assert not (c.get("inference") and c.get("set_to_none") is False), c["name"]


def test_every_candidate_trace_says_why_it_was_kept_or_not():
    rows = [line.split("\t") for line in (ROOT / "benchmarks" / "allocator_traces.tsv").read_text().splitlines()]
    assert len({r[0] for r in rows}) == len(rows), "file names key the traces directory: they must differ"
    for r in rows:
        assert len(r) == 5, f"{r[0]}: file, repository, commit, path, note"
        assert HEX40.fullmatch(r[2]), r[0]
        assert r[4].startswith(("kept", "not ")), f"{r[0]}: the note says kept or not, and why"
    kept = {(r[1], r[2], r[3]) for r in rows if r[4].startswith("kept")}
    for c in _cases():
        assert (c["repo"], c["commit"], c["trace"]) in kept, f"{c['name']}: its trace is not listed as kept"
