"""HeapWatch: memory a run freed does not stay resident past the slack (glibc's malloc_trim)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from fxinit.backends import heap

MiB = 1 << 20

# In a fresh process, so that the state of the C heap is known: ~150 MiB freed in the middle
# of the heap (1 MiB blocks, under malloc's mmap threshold once a 16 MiB block was freed,
# every fourth kept), measured before and after the watch sees the run's kept values.
_FRAGMENT = textwrap.dedent("""
    import json, torch
    from fxinit.backends import heap
    watch = heap.HeapWatch(slack=64 << 20)
    base = watch.base
    first = torch.ones(4 << 20)
    del first
    blocks = [torch.ones(1 << 18) for _ in range(200)]
    kept = blocks[::4]
    del blocks
    held = sum(t.untyped_storage().nbytes() for t in kept)
    before = heap.resident_bytes() - base - held
    watch.kept(kept)
    print(json.dumps({"before": before, "after": heap.resident_bytes() - base - held, "held": watch.held == held}))
""")


def test_a_run_that_freed_more_than_the_slack_gives_it_back() -> None:
    if heap._malloc_trim() is None or heap.resident_bytes() == 0:
        pytest.fail("this test needs Linux with glibc (what CI runs)")
    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["held"]
    assert got["before"] > 100 * MiB, got  # freed blocks stay resident until trimmed
    assert got["after"] < 64 * MiB, got


def test_no_trim_within_the_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: (lambda pad: calls.append(pad)))
    watch = heap.HeapWatch(slack=1 << 40)
    watch.kept([torch.ones(1000)])
    assert calls == [] and watch.held == 4000
