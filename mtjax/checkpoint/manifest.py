"""The manifest: what makes a checkpoint count, and the check that it is still whole.

Into orbax's tmp directory, just before the rename that makes a step visible, the post-
finalization callback writes `mtjax_manifest.json`: the size and CRC-32 of every item file
(state/, config/, meta/). A checkpoint counts only with a manifest whose sizes and CRCs all
match, so a missing manifest, a truncated file or flipped bits make it invalid (`verify`).
"""
from __future__ import annotations

import json
import os
import zlib

MANIFEST = "mtjax_manifest.json"
UNSEALED = "no manifest"


def item_files(step_dir: str) -> list[str]:
    """The item files (state/, config/, meta/). Orbax rewrites its top-level metadata after
    the callback that writes the manifest, so those few bytes are not covered."""
    out = []
    for root, _, names in os.walk(step_dir):
        if root != step_dir:
            out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
    return sorted(out)


def crc(path: str) -> int:
    """CRC-32 of the file at `path`, read in 4 MiB pieces."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return value


def write_manifest(step_dir: str) -> None:
    """Size and CRC-32 of every item file (`item_files`), written atomically (tmp file, fsync, rename)."""
    entries = {rel: [os.path.getsize(os.path.join(step_dir, rel)), crc(os.path.join(step_dir, rel))]
               for rel in item_files(step_dir)}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"files": entries}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def has_manifest(directory: str, step: int) -> bool:
    """Whether step `step` under `directory` is sealed (renamed into place with its manifest);
    not checked against it: that is `verify`'s work."""
    return os.path.isfile(os.path.join(directory, str(step), MANIFEST))


def verify(step_dir: str) -> str | None:
    """None when every file matches the manifest; otherwise what is wrong, in a few words."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return UNSEALED
    try:
        with open(path, encoding="utf-8") as f:
            entries = {str(rel): (int(size), int(c)) for rel, (size, c) in json.load(f)["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "unreadable manifest"
    on_disk = set(item_files(step_dir))
    if not entries or set(entries) != on_disk:    # every item file listed, and only those
        unlisted, missing = sorted(on_disk - set(entries)), sorted(set(entries) - on_disk)
        return (f"missing file {missing[0]}" if missing else
                f"file {unlisted[0]} is not in the manifest" if unlisted else "the manifest lists no files")
    for rel, (size, expected) in entries.items():
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            return f"missing file {rel}"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, expected {size} (truncated)"
        if crc(full) != expected:
            return f"{rel} fails its CRC-32 check (corrupted)"
    return None
