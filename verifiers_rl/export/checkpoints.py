"""Checkpoints that are whole or absent, and resumes that say what is wrong with a bad one.

A checkpoint is written into a staging folder and renamed into place once every file is on disk, with a
manifest (`vf_rl_checkpoint.json`: the step, every file and its size) written last. A kill during a save
leaves a staging folder, never a `checkpoint-N` that looks complete. Before resuming, a checkpoint is checked
against its manifest and for what this run needs; when the newest is unusable the previous one is used, with
one line that says why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path

RUN_INFO = "vf_rl_run.json"  # in checkpoints and exports: base model, environment, config

MANIFEST = "vf_rl_checkpoint.json"
ORCHESTRATOR_STATE = "orchestrator.pt"
STAGING = ".staging"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def write_manifest(folder: str | os.PathLike, step: int, name: str = MANIFEST, **extra) -> None:
    folder = Path(folder)
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    tmp = folder / (name + ".tmp")
    tmp.write_text(json.dumps({"step": step, **extra, "files": files}, indent=1, default=str))
    os.replace(tmp, folder / name)


def publish(staged: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move a fully written checkpoint folder into place (same filesystem: an atomic rename)."""
    final = Path(final)
    if final.exists():  # the same step saved again (e.g. over an incomplete one a resume skipped)
        # moved aside into the staging folder, never deleted in place: a kill mid-delete would leave a
        # checkpoint-N that is neither the old one nor the new one (a resume clears the staging folder)
        aside = Path(staged).parent / f"replaced-{final.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(staged, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(staged, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged(final: str | os.PathLike):
    """`with staged(folder) as tmp:` write into `tmp`, beside `folder`; it replaces `folder` only once the block
    finished, so a kill midway leaves no half-written model that a later run would take as done."""
    final = Path(final)
    tmp = final.parent / f".{final.name}.staging-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, final)


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def save_failed(error: OSError, staged: str | os.PathLike, output_dir: str | os.PathLike) -> OSError | None:
    """A save that ran out of disk: its half-written staging folder is removed (it holds space a retry needs) and
    the error names the file, the space problem, and the checkpoint a resume will use. None for other errors."""
    if error.errno not in NO_SPACE:
        return None
    shutil.rmtree(staged, ignore_errors=True)
    where = error.filename or staged
    usable = [p.name for p in checkpoints(output_dir) if (p / MANIFEST).exists()]
    keep = f"{usable[0]} is intact and a resume starts from it" if usable else "no earlier checkpoint exists"
    return OSError(
        error.errno,
        f"no space left on device while saving {Path(staged).name} (writing {where}): "
        f"{os.strerror(error.errno)}; {keep}: free space (or lower save_total_limit) and run the same command again",
    )


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """checkpoint-N folders of output_dir, newest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def recover_staged(output_dir: str | os.PathLike) -> list[str]:
    """Before a resume clears the staging folder, keep what a save killed at its very end left there complete: a
    checkpoint moved aside while the same step was saved again goes back, and a staged checkpoint whose manifest
    is whole (killed between the manifest and the rename) is published. Returns a note per recovery."""
    root = Path(output_dir)
    staging = root / STAGING
    notes = []
    for folder in sorted(staging.glob("replaced-checkpoint-*")) + sorted(staging.glob("checkpoint-*")):
        final = root / folder.name.removeprefix("replaced-")
        if not final.exists() and _incomplete(folder) is None:
            os.replace(folder, final)
            notes.append(f"recovered {final.name} from an interrupted save")
    return notes


def has_checkpoint(output_dir: str | os.PathLike) -> bool:
    """A checkpoint to resume from, published or left whole in the staging folder by a killed save."""
    root = Path(output_dir)
    return bool(checkpoints(root)) or any(_incomplete(p) is None for p in (root / STAGING).glob("*checkpoint-*"))


def _incomplete(folder: Path) -> str | None:
    """Why `folder` is not a whole save (its manifest, written last, is missing or disagrees with the files)."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return f"{manifest} is missing: the save was interrupted"
    try:
        listed = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{manifest} is corrupt"
    for name, size in listed.items():
        path = folder / name
        if not path.exists():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} is truncated or changed ({path.stat().st_size} of {size} bytes)"
    return None


def problem(folder: str | os.PathLike, *, use_lora: bool, save_only_model: bool = False) -> str | None:
    """Why `folder` cannot be resumed from (one phrase naming the file), or None when it can."""
    folder = Path(folder)
    whole = _incomplete(folder)
    if whole is not None:
        return whole
    state = folder / "trainer_state.json"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError):
        return f"{state} is missing or not valid JSON"
    deepspeed = _deepspeed_states(folder)
    if not save_only_model and not (folder / "optimizer.pt").exists() and not deepspeed:
        return f"{folder / 'optimizer.pt'} is missing (a resume needs the optimizer state)"
    adapter = (folder / "adapter_model.safetensors").exists() or (folder / "adapter_model.bin").exists()
    full = any(folder.glob("model*.safetensors")) or (folder / "pytorch_model.bin").exists() or bool(deepspeed)
    if use_lora and not adapter:
        return f"{folder} holds full model weights, not a LoRA adapter, but use_lora=True"
    if not use_lora and adapter and not full:
        return f"{folder} holds a LoRA adapter, but use_lora=False (full fine-tuning)"
    return None


def _deepspeed_states(folder: Path) -> list[Path]:
    """DeepSpeed's own checkpoint inside a Trainer checkpoint: `latest` names a folder of per-rank model and
    optimizer states (ZeRO-3 keeps the optimizer state there, not in optimizer.pt)."""
    latest = folder / "latest"
    if not latest.is_file():
        return []
    tag = folder / latest.read_text().strip()
    return sorted(tag.glob("*optim_states.pt")) if tag.is_dir() else []


def resume_point(
    output_dir, requested, *, use_lora: bool, save_only_model: bool = False
) -> tuple[str | None, list[str]]:
    """(checkpoint to resume from, notes). `requested` is True (the newest usable one) or a path. A broken
    newest checkpoint falls back to the previous one with a note; an explicit path that is broken is a
    ValueError whose message names the file and the checkpoint to use instead."""
    candidates = checkpoints(output_dir)
    if requested is True:
        notes = []
        for folder in candidates:
            why = problem(folder, use_lora=use_lora, save_only_model=save_only_model)
            if why is None:
                return str(folder), notes
            notes.append(f"not resuming from {folder.name}: {why}")
        if candidates:
            raise ValueError("no usable checkpoint in " + f"{output_dir}: " + "; ".join(notes))
        raise ValueError(f"resume_from_checkpoint=True but there is no checkpoint in {output_dir}")
    why = problem(requested, use_lora=use_lora, save_only_model=save_only_model)
    if why is None:
        return str(requested), []
    usable = [
        p
        for p in candidates
        if p != Path(requested) and problem(p, use_lora=use_lora, save_only_model=save_only_model) is None
    ]
    instead = f"resume from {usable[0]} instead" if usable else "start without resume_from_checkpoint"
    raise ValueError(f"cannot resume from {requested}: {why}; {instead}")


def resuming(output_dir: str | os.PathLike, resume: str, max_steps: int, how: str = "") -> None:
    """The main process, once the checkpoint to resume from is chosen: say so, and with which settings (`how`; a
    requeued job resumes silently otherwise), drop the metrics rows logged after it and what a killed save left in
    the staging folder."""
    step = int(str(resume).rsplit("-", 1)[1])
    print(f"verifiers-rl: resuming from {resume} (step {step} of {max_steps}) {how}".rstrip(), file=sys.stderr)
    drop_metrics_after(output_dir, step)
    shutil.rmtree(Path(output_dir) / STAGING, ignore_errors=True)


def drop_metrics_after(output_dir: str | os.PathLike, step: int) -> int:
    """Remove metrics.jsonl rows logged after `step` (by a run that went on past the checkpoint it is resumed
    from), so that every step appears once. Returns how many rows were dropped."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except ValueError:  # a line cut by a kill mid-write
            dropped += 1
            continue
        if row_step > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped
