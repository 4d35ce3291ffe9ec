"""The KV cache switch's real check (memfit.measure.cache_check) runs two real CPU steps; for a
fake plan of a model too large for this host it does not try, and the cache stays on."""

import importlib

import torch
from torch import nn

cache_check = importlib.import_module("memfit.measure.cache_check")


def test_a_step_too_large_for_the_host_is_not_run(monkeypatch):
    model = nn.Linear(64, 64)
    ran = []
    monkeypatch.setattr(cache_check, "switch_changes_numbers", lambda *a, **k: ran.append(1))
    monkeypatch.setattr(cache_check, "host_available_bytes", lambda: 4 * 64 * 65 * 2 * 3)  # under 4x the params + grads
    why = cache_check.real_switch_check(model, (torch.randn(2, 64),), {}, torch.optim.SGD(model.parameters(), lr=0.1), None, ())
    assert why is not None and "over a quarter of this host's" in why and not ran
    monkeypatch.setattr(cache_check, "host_available_bytes", lambda: 2**40)
    cache_check.real_switch_check(model, (torch.randn(2, 64),), {}, torch.optim.SGD(model.parameters(), lr=0.1), None, ())
    assert ran == [1]


def test_host_memory_is_read():
    available = cache_check.host_available_bytes()
    assert available is None or available > 0
