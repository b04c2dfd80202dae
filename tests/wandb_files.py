"""Reading back what an offline wandb run wrote: its transaction log (`run-<id>.wandb`) and media files.

wandb 0.31 no longer ships a Python reader for the log; its format is LevelDB's log format (32 KiB blocks, each
record chunk with a 7-byte header: crc32, length, type) after a 7-byte W&B header, holding protobuf `Record`s.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def offline_run(wandb_dir: Path) -> Path:
    [run] = sorted((Path(wandb_dir) / "wandb").glob("offline-run-*"))
    return run


def history(run_dir: Path) -> list[dict]:
    """Every `wandb.log` row of the run, in order (keys as logged, values decoded)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [log] = run_dir.glob("run-*.wandb")
    rows = []
    for raw in _records(log):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def tables(run_dir: Path, name: str) -> list[dict]:
    """The tables logged under `name`, as written to the run's media folder."""
    return [json.loads(p.read_text()) for p in sorted((run_dir / "files" / "media" / "table").glob(f"{name}_*.json"))]
