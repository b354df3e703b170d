"""Programmatic dependent launch (kernels/hopper/pdl.py): where the kernels ask for it.

The GPU half -- graph replays with it equal to launches without it, bit for bit -- is in
``test_kernels_backend.test_cuda_graph_replay_follows_new_builds``."""
from __future__ import annotations

import types

import torch

import mla_fuzz.kernels.hopper.pdl as kpdl


def _on(monkeypatch, device, capability, *, interpret="0", cuda="13.0"):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    kpdl._has_pdl.cache_clear()
    try:
        return kpdl.pdl_on(types.SimpleNamespace(device=torch.device(device)))
    finally:
        kpdl._has_pdl.cache_clear()


def test_pdl_only_on_hopper_and_later_cuda_devices_outside_the_interpreter(monkeypatch):
    """On for a CUDA tensor of a compute capability 9.0+ device; off for a CPU tensor, an Ampere
    device, a CUDA runtime before 12.3 (whose graphs cannot capture it), a torch without CUDA and
    the CPU interpreter (which knows no ``griddepcontrol``). The launch option follows it, and is
    absent when off (the interpreter takes no CUDA launch options)."""
    assert _on(monkeypatch, "cuda:0", (9, 0))
    assert _on(monkeypatch, "cuda:1", (10, 0))
    assert not _on(monkeypatch, "cpu", (9, 0))
    assert not _on(monkeypatch, "cuda:0", (8, 0))
    assert not _on(monkeypatch, "cuda:0", (9, 0), interpret="1")
    assert _on(monkeypatch, "cuda:0", (9, 0), cuda="12.3")
    assert not _on(monkeypatch, "cuda:0", (9, 0), cuda="12.2")
    assert not _on(monkeypatch, "cuda:0", (9, 0), cuda=None)
    assert kpdl.launch_options(True) == {"launch_pdl": True}
    assert kpdl.launch_options(False) == {}
