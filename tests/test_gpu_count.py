"""Counting GPUs without importing torch: the driver's own folders, as CUDA_VISIBLE_DEVICES lets them through.

The client counts GPUs to pick a backend before any engine starts; importing torch for it cost 3-4 s of a
4-GPU start. The count must still be the one torch would give (``scripts/gpu_count_check.py`` compares them
on a lent GPU machine)."""

from __future__ import annotations

import pytest

from workbench.rank import host


@pytest.fixture()
def driver(tmp_path, monkeypatch):
    gpus = tmp_path / "gpus"
    for i in range(4):
        (gpus / f"0000:{i:02x}:00.0").mkdir(parents=True)
    monkeypatch.setattr(host, "GPU_DRIVER_PATHS", (str(gpus),))
    return str(gpus)


@pytest.mark.parametrize("visible, n", [(None, 4), ("0,1", 2), ("3", 1), ("", 0), ("-1", 0), ("0,-1,1", 1),
                                        ("0,7", 1), ("GPU-aaaa,GPU-bbbb", 2)])
def test_the_drivers_gpus_as_cuda_visible_devices_lets_them_through(driver, monkeypatch, visible, n):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert host.gpu_count(driver) == n


def test_no_driver_no_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(host, "GPU_DRIVER_PATHS", (str(tmp_path / "absent"),))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert host.gpu_count(str(tmp_path / "absent")) == 0
