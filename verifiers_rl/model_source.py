"""Where a model comes from — a local directory or a Hugging Face hub id — decided without importing torch.

A wrong model path used to surface only when a process loaded the weights (the server or the trainer), seconds
into a run, and an unknown hub id only after huggingface_hub's retries (about a minute without a network).
`resolve_model_path` answers from the file system and the local hub cache; only an id that is neither costs one
request to the hub, without retries.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local directory nor reachable on the hub (or in its cache)."""


def looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else (absolute, ./, ~, several slashes) means a local path.
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1"


def resolve_model_path(name_or_path: str) -> str:
    """The local directory or hub id to load, or one clear error: a missing or incomplete local folder, a hub id
    that is neither cached nor on the hub."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"model must be a hub id or a local directory, got {name_or_path!r}")
    name = os.path.expanduser(str(name_or_path))
    if os.path.exists(name):
        path = Path(name)
        if not path.is_dir():
            raise NotADirectoryError(f"model path {name!r} is a file; pass the directory that holds config.json")
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model directory {name!r} has no config.json; is it a saved model "
                "(model.save_pretrained) or, for a LoRA adapter, its base model?"
            )
        return name
    if looks_like_path(name):
        raise ModelNotFoundError(f"model path {name!r} does not exist")
    problem = hub_problem(name)
    if problem:
        raise ModelNotFoundError(problem)
    return name


@functools.lru_cache(maxsize=32)
def hub_problem(repo_id: str) -> str | None:
    """Why `repo_id` cannot be loaded from the hub (None: it is cached, exists, or only the hub can tell)."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:  # transformers brings huggingface_hub; without it, let the loader say what is wrong
        return None
    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return None
    except ValueError as e:  # not a valid repo id at all
        return f"model {repo_id!r} is neither a local directory nor a valid hub id ({e})"
    if hub_offline():
        return (
            f"could not load model {repo_id!r} from the Hugging Face hub (HF_HUB_OFFLINE is set: the model must "
            "already be in the local cache); it is not there, and no local directory has that name"
        )
    return _ask_hub(repo_id, constants.ENDPOINT)


def _ask_hub(repo_id: str, endpoint: str) -> str | None:
    """One HEAD request for the model's config.json, no retries: 404 means no such model (or no access)."""
    import httpx
    from huggingface_hub import get_token

    token = get_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{endpoint.rstrip('/')}/{repo_id}/resolve/main/config.json"
    try:
        status = httpx.head(url, headers=headers, timeout=10.0, follow_redirects=False).status_code
    except httpx.HTTPError as e:
        return (
            f"model {repo_id!r} is not a local directory, not in the Hugging Face cache, and the hub is unreachable "
            f"({type(e).__name__}: {e}): download it where the network is, or pass a local directory"
        )
    if status in (401, 404):
        gated = "" if token else "; for a gated or private model set HF_TOKEN"
        return f"could not load model {repo_id!r}: the Hugging Face hub has no such model (HTTP {status}){gated}"
    return None
