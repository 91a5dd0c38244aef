"""The container of an init-graph file: a torch.save archive that carries its own checksum.

``pack`` writes a payload (plain data and tensors) with ``torch.save`` and appends one
record, ``<archive>/fxinit_sha256``: 64 lowercase hex digits, the SHA-256 of every byte of the
file except those 64 and the two CRC-32 fields of that record (in its data descriptor and in
its central-directory entry), which are hashed as zero bytes. Every other byte — each record's
data, every zip header, the central directory — is covered, and the excluded bytes check
themselves (the digest must match, the CRC fields must be the CRC-32 of the digest), so any
change to a file is refused before anything in it is read. ``torch.load(path,
weights_only=True)`` ignores the extra record and returns the payload.

``unpack`` verifies that checksum, then reads the payload with ``torch.load(weights_only=True)``.
It also reads the older header layout (``FXINIT-GRAPH`` and a ``sha256:`` line in front of a
torch.save archive), verified by the checksum in its header.
"""

from __future__ import annotations

import hashlib
import io
import re
import struct
import zipfile
import zlib
from typing import Any

import torch

from fxinit.errors import ArtifactError

CHECKSUM_RECORD = "fxinit_sha256"
HEADER_MAGIC = b"FXINIT-GRAPH\n"  # the older layout
_ZIP_MAGIC = b"PK\x03\x04"
_DESCRIPTOR_MAGIC = b"PK\x07\x08"
_CENTRAL_MAGIC = b"PK\x01\x02"
_DIGEST_BYTES = 64
_HEX_DIGEST = re.compile(rb"[0-9a-f]{64}")
_NOT_A_GRAPH_HINT = "init graphs are written by InitGraph.save / `fxinit trace`"
_DAMAGED_HINT = "the file is truncated or corrupted; save it again"


# ---------------------------------------------------------------------------- write
def pack(payload: Any) -> bytes:
    """The bytes of an init-graph file holding ``payload``: ``torch.save``'s archive with the
    checksum record appended (by ``zipfile``, which keeps torch's records where they are)."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    with zipfile.ZipFile(buf, "a", compression=zipfile.ZIP_STORED) as archive:
        prefix = archive.infolist()[0].filename.split("/", 1)[0]
        archive.writestr(f"{prefix}/{CHECKSUM_RECORD}", bytes(_DIGEST_BYTES))
    data = bytearray(buf.getvalue())
    digest_at, crc_at = _checksum_fields(data, "<new file>")
    digest = _sha256_without(data, digest_at, crc_at).encode()
    data[digest_at:digest_at + _DIGEST_BYTES] = digest
    for pos in crc_at:
        data[pos:pos + 4] = struct.pack("<I", zlib.crc32(digest))
    return bytes(data)


# ---------------------------------------------------------------------------- read
def unpack(data: bytes, source: str) -> Any:
    """The payload of an init-graph file, after its checksum is verified."""
    if data.startswith(HEADER_MAGIC):
        body = _verified_header_layout(data, source)
    elif data.startswith(_ZIP_MAGIC):
        _verify_archive(data, source)
        body = data
    else:
        raise ArtifactError(f"{source} is not an fxinit init graph (not a torch.save archive)",
                            hint=_NOT_A_GRAPH_HINT)
    try:
        return torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling or zip failure, including refused globals
        raise ArtifactError(f"{source}: unreadable payload ({type(exc).__name__}: {short_message(exc)})",
                            hint="only plain data is accepted in an init graph file") from exc


def _verify_archive(data: bytes, source: str) -> None:
    digest_at, crc_at = _checksum_fields(data, source)
    digest = data[digest_at:digest_at + _DIGEST_BYTES]
    crc = struct.pack("<I", zlib.crc32(digest))
    if (not _HEX_DIGEST.fullmatch(digest) or any(data[p:p + 4] != crc for p in crc_at)
            or _sha256_without(data, digest_at, crc_at).encode() != digest):
        raise ArtifactError(f"{source}: checksum mismatch", hint=_DAMAGED_HINT)


def _verified_header_layout(data: bytes, source: str) -> bytes:
    """The torch.save archive of a file in the older header layout, after its checksum."""
    header_end = data.find(b"\n", len(HEADER_MAGIC))
    header = data[len(HEADER_MAGIC):header_end] if header_end > 0 else b""
    if not re.fullmatch(rb"sha256:[0-9a-f]{64}", header):
        raise ArtifactError(f"{source}: damaged header", hint=_DAMAGED_HINT)
    body = data[header_end + 1:]
    if hashlib.sha256(body).hexdigest().encode() != header[7:]:
        raise ArtifactError(f"{source}: checksum mismatch", hint=_DAMAGED_HINT)
    return body


def _checksum_fields(data: bytes | bytearray, source: str) -> tuple[int, tuple[int, int]]:
    """Where the digest of the checksum record starts, and where its two CRC-32 fields are."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
        central_dir = archive.start_dir  # set by ZipFile's reader (zip64 included)
    except Exception as exc:  # zipfile raises many kinds on damaged input
        raise ArtifactError(f"{source}: damaged archive ({type(exc).__name__}: {short_message(exc)})",
                            hint=_DAMAGED_HINT) from exc
    prefix = infos[0].filename.split("/", 1)[0] if infos else ""
    found = [i for i, info in enumerate(infos) if info.filename == f"{prefix}/{CHECKSUM_RECORD}"]
    if not found:
        raise ArtifactError(f"{source}: no {CHECKSUM_RECORD} record: a torch.save archive but not an fxinit "
                            "init graph, or a damaged one",
                            hint=f"{_NOT_A_GRAPH_HINT}; a graph re-saved with torch.save loses this record: "
                                 "save it with InitGraph.save")
    index = found[0]
    info = infos[index]
    damaged = ArtifactError(f"{source}: damaged checksum record", hint=_DAMAGED_HINT)
    if (len(found) > 1 or info.compress_type != zipfile.ZIP_STORED
            or info.file_size != _DIGEST_BYTES or info.compress_size != _DIGEST_BYTES):
        raise damaged
    local = info.header_offset
    if data[local:local + 4] != _ZIP_MAGIC or local + 30 > len(data):
        raise damaged
    name_len, extra_len = struct.unpack_from("<HH", data, local + 26)
    digest_at = local + 30 + name_len + extra_len
    end = digest_at + _DIGEST_BYTES
    if info.flag_bits & 0x08:  # CRC in a data descriptor after the data, as torch writes it
        local_crc = end + 4 if data[end:end + 4] == _DESCRIPTOR_MAGIC else end
    else:
        local_crc = local + 14
    entry = central_dir
    for _ in range(index):
        if data[entry:entry + 4] != _CENTRAL_MAGIC or entry + 46 > len(data):
            raise damaged
        entry += 46 + sum(struct.unpack_from("<HHH", data, entry + 28))
    if data[entry:entry + 4] != _CENTRAL_MAGIC or max(end, local_crc + 4, entry + 20) > len(data):
        raise damaged
    return digest_at, (local_crc, entry + 16)


def _sha256_without(data: bytes | bytearray, digest_at: int, crc_at: tuple[int, int]) -> str:
    """SHA-256 of ``data`` with the digest and the CRC-32 fields read as zero bytes."""
    blanks = sorted([(digest_at, digest_at + _DIGEST_BYTES), *((p, p + 4) for p in crc_at)])
    view = memoryview(data)
    h = hashlib.sha256()
    pos = 0
    for start, end in blanks:  # they only overlap in a damaged file: hashed some way, then refused
        start = max(start, pos)
        h.update(view[pos:start])
        h.update(bytes(max(end - start, 0)))
        pos = max(pos, end)
    h.update(view[pos:])
    return h.hexdigest()


def short_message(exc: BaseException) -> str:
    """The line of an exception's message that names its cause, shortened."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if "error:" in ln.lower()]  # torch.load puts the cause on its own line
    return (named or lines or [""])[0][:300]
