"""What every saved ALiBi folder gets, and :class:`AlibiPreTrainedMixin`, the base of every ``Alibi<Class>``.

Small on purpose: ``import hf_alibi`` loads it and gives the mixin to the registry (for every model
class); the remote code, card and upload modules are imported only when a folder is saved or pushed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..core.names import is_alibi


def finish_folder(
    folder: str | os.PathLike, config, base_model: str | None = None, recovery: str | None = None
) -> None:
    """What every saved ALiBi folder gets besides transformers' files: remote code, auto_map, card."""
    from .card import write_model_card
    from .remote_code import add_remote_code

    add_remote_code(folder, config)
    write_model_card(folder, config, base_model=base_model, recovery=recovery)


class AlibiPreTrainedMixin:
    """Base of every ``Alibi<Class>``: saving keeps the ALiBi settings and the remote code.

    ``save_pretrained`` writes transformers' files, then ``modeling_alibi.py``, ``auto_map`` and a
    model card; ``push_to_hub`` saves that same folder and uploads it (transformers' own would
    replace the model card with a generic one).
    """

    def save_pretrained(
        self, save_directory, *args, is_main_process: bool = True, push_to_hub: bool = False, **kwargs
    ):
        push_kwargs = {}
        if push_to_hub:  # transformers would upload before the remote code is written: upload here
            repo_id = kwargs.pop("repo_id", str(save_directory).rstrip("/").split("/")[-1])
            for key in ("private", "commit_message", "commit_description", "token", "revision", "create_pr"):
                if key in kwargs:
                    push_kwargs[key] = kwargs.pop(key)
        # Weights are saved under this model's own parameter names. transformers' "original format"
        # renames some back to the base checkpoint's (GPT-NeoX: lm_head -> embed_out) for models it
        # loaded with a rename, but it looks the renames up by model_type, and "alibi_<type>" has none:
        # such a checkpoint would reload with a freshly initialised lm_head.
        kwargs.setdefault("save_original_format", False)
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process and is_alibi(self.config):
            finish_folder(save_directory, self.config)
            if push_to_hub:
                from .upload import push_folder

                push_folder(save_directory, repo_id, **push_kwargs)
        return result

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | None = None,
    ):
        """Save to a temporary folder (weights, config with ``alibi`` and ``auto_map``, remote code,
        model card) and upload it to ``repo_id``. See :func:`push_folder`."""
        from .card import model_card
        from .upload import push_folder

        with tempfile.TemporaryDirectory() as tmp_dir:
            self.save_pretrained(tmp_dir, max_shard_size=max_shard_size)
            if tags:
                (Path(tmp_dir) / "README.md").write_text(model_card(self.config, tags=tags))
            return push_folder(
                tmp_dir,
                repo_id,
                private=private,
                commit_message=commit_message,
                commit_description=commit_description,
                token=token,
                revision=revision,
                create_pr=create_pr,
            )
