"""The fused probe's child build (``rank/probe_child.py``) is started only where it saves time.

A cold Triton cache: the child builds (~11 s on an H200, none of it on the job's threads). A cache that holds the
kernel already: no child, since the rank's own warm-up loads it in ~0.5 s while a child spends ~4 s on torch's
import and CUDA's start before it could (read on an H200, fixtures/gpu/job_leave_on_1gpu.json); every point in
that window takes the plain path.
"""

from __future__ import annotations

from workbench.rank import probe_child


def _fresh(monkeypatch, cache) -> None:
    monkeypatch.setattr(probe_child, "_BUILD", {})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    for k in ("WORKBENCH_PROBE_CHILD_BUILD", "WORKBENCH_PROBE_WARM", "WORKBENCH_PROBE_FUSED"):
        monkeypatch.delenv(k, raising=False)


def test_a_cache_holding_the_kernel_starts_no_child(monkeypatch, tmp_path):
    (tmp_path / "0a1b2c").mkdir()
    (tmp_path / "0a1b2c" / "probe_all_kernel.cubin").write_bytes(b"")
    _fresh(monkeypatch, tmp_path)
    assert probe_child.cache_holds_kernel()
    assert probe_child.prebuild_probe(0) is False and "proc" not in probe_child._BUILD
    assert probe_child.await_prebuild() is None


def test_a_cache_with_other_kernels_only_is_cold(monkeypatch, tmp_path):
    (tmp_path / "9f8e").mkdir()
    (tmp_path / "9f8e" / "triton_poi_fused_add_0.cubin").write_bytes(b"")
    (tmp_path / "probe_all_kernel.cubin").write_bytes(b"")  # not in a build's folder: not a build
    _fresh(monkeypatch, tmp_path)
    assert not probe_child.cache_holds_kernel()
    monkeypatch.setenv("WORKBENCH_PROBE_CHILD_BUILD", "0")  # cold, but the child turned off: none started
    assert probe_child.prebuild_probe(0) is False and "proc" not in probe_child._BUILD


def test_a_missing_cache_is_cold(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path / "nowhere")
    assert not probe_child.cache_holds_kernel()


def test_a_capture_opening_where_no_gpu_is_seen_starts_no_child(monkeypatch, tmp_path):
    """``prebuild_probe()`` with no index is a capture opening before torch is up: on a box without GPUs (or with
    CUDA_VISIBLE_DEVICES emptied) a child would only import torch to say 'no CUDA device'."""
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe_child.prebuild_probe() is False and "proc" not in probe_child._BUILD


def test_a_capture_closing_while_the_child_builds_loads_nothing_and_waits_for_none(monkeypatch, tmp_path):
    """A job shorter than the cold build closes its capture while the warm-up waits for the child: the close
    (``settle_warm``) returns without joining it, and the warm-up then loads nothing in-process. A real child runs
    (on this CUDA-less box it says 'no CUDA device'); the test holds the warm-up's lock so that the close comes,
    for certain, while the warm-up is still at the child's step."""
    import torch

    from workbench.rank import probe_fused

    _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(probe_fused, "_WARM", {})
    monkeypatch.setenv("WORKBENCH_PROBE_NVRTC", "0")  # Triton's child build: the fallback where NVRTC cannot build
    with probe_fused._WARM_LOCK:
        t = probe_fused.warm_async(torch.device("cuda", 0), plain_meanwhile=True)
        assert t is not None
        assert probe_fused.settle_warm(600) is True  # returned at once: it did not join the thread
    t.join(300)
    assert not t.is_alive()
    assert probe_fused._WARM["result"] == {"warm": False, "why": "the capture closed before the build ended"}
    if not torch.cuda.is_available():
        assert probe_fused._WARM["child"]["why"] == "no CUDA device"  # the child ran, for real
