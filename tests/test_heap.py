"""HeapWatch: memory a run freed does not stay resident past the slack (glibc's malloc_trim)."""

from __future__ import annotations

import pytest
import torch

from fxinit.backends import heap

MiB = 1 << 20


def _fragment() -> list[torch.Tensor]:
    """Leave ~150 MiB free in the middle of the C heap: 1 MiB blocks (under malloc's mmap
    threshold once a 16 MiB block was freed), every fourth kept."""
    del_me = torch.ones(16 * MiB // 4)
    del del_me  # raises glibc's mmap threshold past 1 MiB: the blocks below come from the heap
    blocks = [torch.ones(MiB // 4) for _ in range(200)]
    return blocks[::4]


def _resident_beyond_base_and_kept(trim: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    if not trim:
        monkeypatch.setattr(heap, "_malloc_trim", lambda: (lambda pad: 0))
    watch = heap.HeapWatch(slack=64 * MiB)
    base = watch.base
    kept = _fragment()
    watch.kept(kept)
    assert watch.held == sum(t.untyped_storage().nbytes() for t in kept)
    return heap.resident_bytes() - base - watch.held


def test_a_run_that_freed_more_than_the_slack_gives_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    if heap._malloc_trim() is None or heap.resident_bytes() == 0:
        pytest.fail("this test needs Linux with glibc (what CI runs)")
    with monkeypatch.context() as m:
        assert _resident_beyond_base_and_kept(False, m) > 100 * MiB  # freed blocks stay resident untrimmed
    assert _resident_beyond_base_and_kept(True, monkeypatch) < 64 * MiB


def test_no_trim_within_the_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: (lambda pad: calls.append(pad)))
    watch = heap.HeapWatch(slack=1 << 40)
    watch.kept([torch.ones(1000)])
    assert calls == [] and watch.held == 4000
