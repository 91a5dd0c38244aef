"""Regenerate tests/data/bad_graphs: init-graph files fxinit must refuse.

    python tests/data/make_bad_graphs.py

Each file is a small valid graph (tests/artifact_helpers.Small) damaged in one way; the
name says how. Add a file here whenever fuzzing finds a new way to break the reader.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from fxinit.artifact import SCHEMA_VERSION  # noqa: E402
from tests.artifact_helpers import dumps, hostile, mutated, valid_bytes  # noqa: E402

OUT = Path(__file__).resolve().parent / "bad_graphs"


def _set_target(target: str):
    def edit(p: dict) -> None:
        p["nodes"][-1]["target"] = target
    return edit


def _first(p: dict, pred) -> dict:
    return next(n for n in p["nodes"] if pred(n))


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        data = valid_bytes(Path(d))
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    cases = {
        "empty": b"",
        "bad_magic": b"PK\x03\x04" + data[4:],
        "truncated_header": data[:25],
        "truncated_half": data[: len(data) // 2],
        "bitflip_body": bytes(flipped),
        "not_a_dict": dumps([1, 2, 3]),
        "newer_schema": mutated(data, lambda p: p.update(schema_version=SCHEMA_VERSION + 1)),
        "op_os_system": mutated(data, _set_target("os.system")),
        "op_from_file": mutated(data, _set_target("aten.from_file.default")),
        "op_unknown": mutated(data, _set_target("aten.no_such_op.default")),
        "opaque_not_allowed": mutated(data, lambda p: _first(
            p, lambda n: n["target"] == "fxinit.ops.call_init_function")["args"]["tuple"].__setitem__(0, "os.system")),
        "spec_lies": mutated(data, lambda p: _first(
            p, lambda n: n["spec"] is not None and n["target"].startswith("aten.empty"))["spec"].__setitem__(0, [10**6])),
        "random_without_rng": mutated(data, lambda p: _first(p, lambda n: n["rng"]).update(rng=None)),
        "forward_reference": mutated(data, lambda p: p["nodes"][1].update(
            args={"tuple": [{"node": p["nodes"][-1]["name"]}]})),
        "rng_state_wrong_size": mutated(data, lambda p: p["rng"].update(
            {k: {"device": "cpu", "state": torch.zeros(3, dtype=torch.uint8)} for k in p["rng"]})),
        "output_to_missing_node": mutated(data, lambda p: p["outputs"].update({"x": "nope"})),
        "hostile_pickle": hostile("/nonexistent-dir/fxinit-pwned"),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    for name, blob in cases.items():
        (OUT / f"{name}.fxg").write_bytes(blob)
    print(f"wrote {len(cases)} files to {OUT}")


if __name__ == "__main__":
    main()
