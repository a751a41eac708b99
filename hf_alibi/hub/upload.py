"""Uploading a saved ALiBi checkpoint folder to the Hugging Face Hub."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .checkpoints import is_alibi


class HubConnectionError(ConnectionError):
    """The Hugging Face Hub could not be reached (offline, no network, HF_HUB_OFFLINE=1)."""


def _is_connection_problem(error: BaseException) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    names = {cls.__name__ for cls in type(error).__mro__}
    return isinstance(error, OfflineModeIsEnabled | ConnectionError | TimeoutError) or bool(
        names & {"ConnectError", "ConnectTimeout", "TransportError", "NetworkError", "TimeoutException"}
    )


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    commit_message: str | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_description: str | None = None,
) -> Any:
    """Upload ``folder`` (a saved ALiBi checkpoint) to the Hub repo ``repo_id``, creating it if needed.

    The token is ``token`` or, as usual in huggingface_hub, ``HF_TOKEN`` or the stored login.
    Raises :class:`HubConnectionError` with what to do when the Hub cannot be reached.
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file() or not is_alibi(json.loads(config_path.read_text())):
        raise ValueError(
            f"{folder} holds no ALiBi checkpoint (config.json with 'alibi'): save an ALiBi model there first."
        )
    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=commit_message or "Upload ALiBi checkpoint (hf_alibi)",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )
    except Exception as error:
        if _is_connection_problem(error):
            raise HubConnectionError(
                f"Could not reach the Hugging Face Hub to push {repo_id!r} ({type(error).__name__}: {error}). "
                f"Nothing was uploaded; the checkpoint is complete in {folder}. Check the network (and that "
                "HF_HUB_OFFLINE is not set), then push it again, e.g. "
                f"`hf upload {repo_id} {folder}`."
            ) from error
        raise
