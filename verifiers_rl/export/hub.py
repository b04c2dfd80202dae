"""Pushing an exported folder to the Hugging Face hub (huggingface_hub's create_repo + upload_folder)."""

from __future__ import annotations

import os
from pathlib import Path

from verifiers_rl.errors import TrainingError


def repo_name(hub_model_id: str | None, output_dir: str | os.PathLike) -> str:
    """The repository to push to: hub_model_id, or (as transformers does) the output folder's name under the
    token's own namespace."""
    return hub_model_id or Path(output_dir).absolute().name


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = "Upload model trained with verifiers-rl",
):
    """Create the model repository if needed and upload `folder` as its contents; returns the commit info.
    A failure is a one-line TrainingError that says the folder is still there and how to push it by hand."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=repo.repo_id,
            folder_path=str(folder),
            commit_message=commit_message,
            revision=revision,
            repo_type="model",
        )
    except Exception as e:  # noqa: BLE001 - network, auth and hub errors all end the same way for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingError(
            f"pushing {folder} to the hub as {repo_id!r} failed ({first}); the model is saved there: push it "
            f"later with `hf upload {repo_id} {folder}`"
        ) from e
