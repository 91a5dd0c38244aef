"""Regenerate tests/data/bad_graphs: init-graph files fxinit must refuse.

    python tests/data/make_bad_graphs.py

Each file is a small valid graph (tests/artifact_helpers.Small) damaged in one way; the
name says how, and REFUSALS says what the refusal must say. ``*.pt`` files are in the
current layout (a torch.save archive with a checksum record); ``header_layout_*.fxg`` files
are damaged copies of tests/data/small_header_layout.fxg, a file the previous release wrote
(still loaded). Add a file here whenever fuzzing finds a new way to break the reader.
"""

from __future__ import annotations

import io
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from fxinit.artifact import SCHEMA_VERSION  # noqa: E402
from tests.artifact_helpers import (  # noqa: E402
    HEADER_LAYOUT_FILE, dumps, header_layout, hostile, hostile_payload, mutated, payload_of, record_data_at,
    valid_bytes)

OUT = Path(__file__).resolve().parent / "bad_graphs"

#: file name -> a phrase the ArtifactError refusing it must contain
REFUSALS = {
    "empty.pt": "not an fxinit init graph",
    "not_a_zip.pt": "not an fxinit init graph",
    "truncated_half.pt": "damaged archive",
    "truncated_end.pt": "damaged archive",
    "appended_bytes.pt": "checksum mismatch",
    "bitflip_pickle.pt": "checksum mismatch",
    "bitflip_tensor.pt": "checksum mismatch",
    "bitflip_central_directory_time.pt": "checksum mismatch",
    "bitflip_digest.pt": "checksum mismatch",
    "bitflip_checksum_crc.pt": "checksum mismatch",
    "resaved_by_torch_save.pt": "no fxinit_sha256 record",
    "hostile_pickle.pt": "unreadable payload",
    "not_a_dict.pt": "payload is not a dict",
    "newer_schema.pt": "newer than this fxinit reads",
    "op_os_system.pt": "not allowed",
    "op_from_file.pt": "not allowed",
    "op_unknown.pt": "unknown op",
    "opaque_not_allowed.pt": "init function",
    "opaque_body_not_a_string.pt": "body",
    "opaque_default_device_not_a_device.pt": "default device",
    "spec_lies.pt": "declares",
    "random_without_rng.pt": "no generator snapshot",
    "forward_reference.pt": "unknown or later node",
    "rng_state_wrong_size.pt": "wrong size",
    "output_to_missing_node.pt": "output 'x'",
    "hf_config_int_key.pt": "has a key of type int",
    "hf_config_tuple.pt": "is a tuple, not JSON data",
    "hf_config_too_deep.pt": "nested deeper than",
    "hf_config_in_schema_1.pt": "a schema 1 payload with hf_config",
    "schema_2_without_hf_config.pt": "a schema [2-9] payload without hf_config",
    "header_layout_truncated_header.fxg": "damaged header",
    "header_layout_bitflip_body.fxg": "checksum mismatch",
    "header_layout_truncated_half.fxg": "checksum mismatch",
    "header_layout_hostile_pickle.fxg": "unreadable payload",
    "header_layout_newer_schema.fxg": "newer than this fxinit reads",
    "numerics_bad_value.pt": "setting 'deterministic_algorithms' = 'maybe'",
    "numerics_not_pairs.pt": "graph: numerics",
}


def _set_target(target: str):
    def edit(p: dict) -> None:
        p["nodes"][-1]["target"] = target
    return edit


def _first(p: dict, pred) -> dict:
    return next(n for n in p["nodes"] if pred(n))


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0x01
    return bytes(out)


def _record_data_at(data: bytes, suffix: str) -> int:
    """Offset of the data of the record whose name ends with ``suffix``."""
    return record_data_at(data, next(i for i in zipfile.ZipFile(io.BytesIO(data)).infolist()
                                     if i.filename.endswith(suffix)))


def _declare_larger_shape(p: dict) -> None:
    spec = _first(p, lambda n: n["spec"] is not None and n["target"].startswith("aten.empty"))["spec"]
    spec[0] = [s + 1 for s in spec[0]]


def _nested(depth: int) -> dict:
    config: dict = {"model_type": "llama"}
    for _ in range(depth):
        config = {"x": config}
    return config


def cases() -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as d:
        data = valid_bytes(Path(d))
    old = HEADER_LAYOUT_FILE.read_bytes()
    payload = payload_of(data)
    central = zipfile.ZipFile(io.BytesIO(data)).start_dir
    digest_at = _record_data_at(data, "/fxinit_sha256")
    resaved = io.BytesIO()
    torch.save(payload, resaved)
    old_payload = payload_of(old[old.index(b"\n", 13) + 1:])
    return {
        "empty.pt": b"",
        "not_a_zip.pt": b"\x00" + data[1:],
        "truncated_half.pt": data[: len(data) // 2],
        "truncated_end.pt": data[:-10],
        "appended_bytes.pt": data + b"\x00" * 16,
        "bitflip_pickle.pt": _flip(data, _record_data_at(data, "/data.pkl") + 100),
        "bitflip_tensor.pt": _flip(data, _record_data_at(data, "/data/0") + 3),
        "bitflip_central_directory_time.pt": _flip(data, central + 12),  # last-modified time: no reader checks it
        "bitflip_digest.pt": _flip(data, digest_at + 10),
        "bitflip_checksum_crc.pt": _flip(data, digest_at + 64 + 4),  # the CRC-32 in its data descriptor
        "resaved_by_torch_save.pt": resaved.getvalue(),
        "hostile_pickle.pt": hostile("/nonexistent-dir/fxinit-pwned"),
        "not_a_dict.pt": dumps([1, 2, 3]),
        "newer_schema.pt": mutated(data, lambda p: p.update(schema_version=SCHEMA_VERSION + 1)),
        "op_os_system.pt": mutated(data, _set_target("os.system")),
        "op_from_file.pt": mutated(data, _set_target("aten.from_file.default")),
        "op_unknown.pt": mutated(data, _set_target("aten.no_such_op.default")),
        "opaque_not_allowed.pt": mutated(data, lambda p: _first(
            p, lambda n: n["target"] == "fxinit.ops.call_init_function")["args"]["tuple"].__setitem__(0, "os.system")),
        "opaque_body_not_a_string.pt": mutated(data, lambda p: _first(
            p, lambda n: n["target"] == "fxinit.ops.call_init_function").update(body=5)),
        "opaque_default_device_not_a_device.pt": mutated(data, lambda p: _first(
            p, lambda n: n["target"] == "fxinit.ops.call_init_function")["kwargs"].update(default_device="cuda")),
        "spec_lies.pt": mutated(data, _declare_larger_shape),
        "random_without_rng.pt": mutated(data, lambda p: _first(p, lambda n: n["rng"]).update(rng=None)),
        "forward_reference.pt": mutated(data, lambda p: p["nodes"][1].update(
            args={"tuple": [{"node": p["nodes"][-1]["name"]}]})),
        "rng_state_wrong_size.pt": mutated(data, lambda p: p["rng"].update(
            {k: {"device": "cpu", "state": torch.zeros(3, dtype=torch.uint8)} for k in p["rng"]})),
        "output_to_missing_node.pt": mutated(data, lambda p: p["outputs"].update({"x": "nope"})),
        "hf_config_int_key.pt": mutated(data, lambda p: p.update(hf_config={"model_type": "llama", 1: "x"})),
        "hf_config_tuple.pt": mutated(data, lambda p: p.update(hf_config={"model_type": "llama", "x": (1, 2)})),
        "hf_config_too_deep.pt": mutated(data, lambda p: p.update(hf_config=_nested(40))),
        "hf_config_in_schema_1.pt": mutated(data, lambda p: p.update(schema_version=1)),
        "schema_2_without_hf_config.pt": mutated(data, lambda p: p.pop("hf_config")),
        "numerics_bad_value.pt": mutated(data, lambda p: p.update(numerics=[["deterministic_algorithms", "maybe"]])),
        "numerics_not_pairs.pt": mutated(data, lambda p: p.update(numerics={"num_threads": 2})),
        "header_layout_truncated_header.fxg": old[:25],
        "header_layout_bitflip_body.fxg": _flip(old, len(old) // 2),
        "header_layout_truncated_half.fxg": old[: len(old) // 2],
        "header_layout_hostile_pickle.fxg": header_layout(hostile_payload("/nonexistent-dir/fxinit-pwned")),
        "header_layout_newer_schema.fxg": header_layout(old_payload | {"schema_version": SCHEMA_VERSION + 1}),
    }


def main() -> None:
    made = cases()
    assert set(made) == set(REFUSALS), set(made) ^ set(REFUSALS)
    OUT.mkdir(parents=True, exist_ok=True)
    for stale in [*OUT.glob("*.pt"), *OUT.glob("*.fxg")]:
        stale.unlink()
    for name, blob in made.items():
        (OUT / name).write_bytes(blob)
    print(f"wrote {len(made)} files to {OUT}")


if __name__ == "__main__":
    main()
