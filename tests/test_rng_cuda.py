"""The CUDA generator in checkpoints: the current device's state only, restored onto the current
device; older checkpoints (one entry per visible device) are read by device number, and a resume
that sees fewer GPUs than the run that saved does not fail. torch.cuda is mocked: no GPU here."""

from __future__ import annotations

import pytest
import torch

from mileage import seeding


class FakeCuda:
    """The torch.cuda calls seeding uses, on `count` devices with `current` selected."""

    def __init__(self, monkeypatch, count: int, current: int):
        self.count, self.current = count, current
        self.states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(count)}
        self.set_calls: list[tuple[int, list[int]]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)

        def everything(*_a, **_k):
            raise AssertionError("the state of every device must not be read or written")

        monkeypatch.setattr(torch.cuda, "get_rng_state_all", everything)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", everything)

    def get(self, device="cuda"):
        index = device if isinstance(device, int) else self.current
        return self.states[index].clone()

    def set(self, state, device="cuda"):
        index = device if isinstance(device, int) else self.current
        if index >= self.count:
            raise IndexError(index)
        self.set_calls.append((index, state.tolist()))


def test_capture_saves_the_current_device_only(monkeypatch):
    FakeCuda(monkeypatch, count=4, current=2)
    tensors, _ = seeding.capture_rng_state()
    assert set(tensors) == {"torch_cpu", seeding.CUDA_KEY}
    assert tensors[seeding.CUDA_KEY].tolist() == [2] * 8


def test_restore_onto_the_current_device_with_fewer_gpus(monkeypatch):
    saver = FakeCuda(monkeypatch, count=8, current=0)
    tensors, plain = seeding.capture_rng_state()
    resumer = FakeCuda(monkeypatch, count=1, current=0)
    seeding.restore_rng_state(tensors, plain)
    assert resumer.set_calls == [(0, saver.states[0].tolist())]


def test_legacy_checkpoint_is_read_by_device_number(monkeypatch):
    # an older checkpoint of 11 devices: text order would put torch_cuda_10 before torch_cuda_2
    legacy = {f"torch_cuda_{i}": torch.full((8,), i, dtype=torch.uint8) for i in range(11)}
    tensors = {"torch_cpu": torch.get_rng_state(), **legacy}
    plain = seeding.capture_rng_state()[1]
    for current, count in ((2, 4), (10, 11)):
        fake = FakeCuda(monkeypatch, count=count, current=current)
        seeding.restore_rng_state(tensors, plain)
        assert fake.set_calls == [(current, [current] * 8)]


@pytest.mark.parametrize(
    "saved", [{}, {"torch_cuda_0": torch.zeros(8, dtype=torch.uint8)}], ids=["cpu-run", "legacy"]
)
def test_nothing_saved_for_this_device_restores_nothing(monkeypatch, saved):
    tensors = {"torch_cpu": torch.get_rng_state(), **saved}
    plain = seeding.capture_rng_state()[1]
    fake = FakeCuda(monkeypatch, count=4, current=3)
    seeding.restore_rng_state(tensors, plain)  # no IndexError, no foreign state
    assert fake.set_calls == []


def test_cpu_only_machine_ignores_a_saved_cuda_state(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_before = torch.get_rng_state()
    tensors = {"torch_cpu": cpu_before, seeding.CUDA_KEY: torch.zeros(8, dtype=torch.uint8)}
    torch.rand(3)
    seeding.restore_rng_state(tensors, seeding.capture_rng_state()[1])
    assert torch.equal(torch.get_rng_state(), cpu_before)
