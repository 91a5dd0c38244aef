"""Fuzz the init-graph file reader with many more examples than the test suite runs, and
count the outcomes.

    python tools/fuzz_artifacts.py --examples 3000

Runs the two property tests of ``tests/test_artifact.py`` (raw byte mutations of a valid
file; files with a correct checksum whose payload is edited) under a fixed Hypothesis seed,
then flips one bit in every byte of a valid file, and of a file in the older header layout.
Any outcome other than a clean refusal (``ArtifactError``), or for an accepted payload a
run that succeeds or raises ``DeferredInitError``, fails the property and this script.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tests.test_artifact as cases  # noqa: E402
from fxinit.errors import ArtifactError  # noqa: E402
from fxinit.graph import loads  # noqa: E402
from tests.artifact_helpers import HEADER_LAYOUT_FILE  # noqa: E402


def every_bit_flip(data: bytes) -> tuple[int, list[int]]:
    """Flip bit ``pos % 8`` of each byte in turn: how many were refused, and the positions
    that were accepted (any other exception propagates)."""
    refused, accepted = 0, []
    for pos in range(len(data)):
        flipped = bytearray(data)
        flipped[pos] ^= 1 << (pos % 8)
        try:
            loads(bytes(flipped))
        except ArtifactError:
            refused += 1
        else:
            accepted.append(pos)
    return refused, accepted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=3000, help="inputs per property")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    counts: collections.Counter[str] = collections.Counter()
    raw_case = cases.test_fuzz_raw_bytes.hypothesis.inner_test
    payload_case = cases.test_fuzz_signed_payloads.hypothesis.inner_test
    real_loads = cases.loads

    def raw(data: st.DataObject) -> None:
        raw_case(data)
        counts["raw mutations refused with ArtifactError (or no net change)"] += 1

    def payload(data: st.DataObject) -> None:
        outcome = {}

        def loads(blob: bytes):  # records whether the edited payload passed validation
            try:
                graph = real_loads(blob)
            except ArtifactError:
                outcome["load"] = "refused at load with ArtifactError"
                raise
            outcome["load"] = "accepted, then ran or raised DeferredInitError"
            return graph

        cases.loads = loads
        try:
            payload_case(data)
        finally:
            cases.loads = real_loads
        counts["payload edits " + outcome.get("load", "unchanged")] += 1

    for prop in (raw, payload):
        run = settings(max_examples=args.examples, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))(given(st.data())(prop))
        seed(args.seed)(run)()
    for what, n in sorted(counts.items()):
        print(f"{n:>6}  {what}")
    print(f"{sum(counts.values()):>6}  inputs, none crashed, hung or ran code")
    failed = False
    for what, data in (("a valid file", cases._valid()), ("a header-layout file", HEADER_LAYOUT_FILE.read_bytes())):
        refused, accepted = every_bit_flip(data)
        print(f"{refused:>6}  of {len(data)} one-bit flips (one per byte) of {what} refused with ArtifactError")
        if accepted:
            failed = True
            print(f"        accepted at bytes {accepted[:20]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
