"""What makes a checkpoint's remote code whole: the model folders import the code every policy shares from
`hf_vla.models.common`, while a checkpoint loaded with `trust_remote_code` where hf_vla is not installed (a robot) has
only the files beside its config. transformers copies a model's module and its single-dot relative imports
(`custom_object_save`); after it, `bundle_shared_code` writes each shared module the saved files import beside them and
turns `from hf_vla.models.common.X import` into `from .X import` in the saved copies (recursively). The sources stay
one copy each; a saved checkpoint is self-contained.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

SHARED_IMPORT = re.compile(r"^(\s*)from hf_vla\.models\.common\.(\w+) import", re.MULTILINE)


def bundle_shared_code(folder: str | os.PathLike) -> list[Path]:
    """Make the remote-code files saved in `folder` self-contained: every `from hf_vla.models.common.X import` in
    them becomes `from .X import`, with X's file written beside them (and the shared files it imports, in turn).
    Returns the files written. A folder whose files import nothing shared is left as it is."""
    folder, here = Path(folder), Path(__file__).resolve().parent
    pending, written = sorted(folder.glob("*.py")), []
    while pending:
        path = pending.pop()
        text = path.read_text(encoding="utf-8")
        names = [name for _, name in SHARED_IMPORT.findall(text)]
        if not names:
            continue
        path.write_text(SHARED_IMPORT.sub(r"\1from .\2 import", text), encoding="utf-8")
        for name in dict.fromkeys(names):
            target = folder / f"{name}.py"
            if not target.exists():
                shutil.copyfile(here / f"{name}.py", target)
                pending.append(target)
                written.append(target)
    return written


class SharedCodeMixin:
    """For a model or processor registered for the Auto classes: its `save_pretrained` bundles the shared code its
    remote-code files import (`bundle_shared_code`), before a `push_to_hub=True` save uploads the folder."""

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        if not push_to_hub:
            result = super().save_pretrained(save_directory, *args, **kwargs)
            bundle_shared_code(save_directory)
            return result
        # transformers would upload before the bundle is written: save, bundle, then upload the folder
        repo_id = kwargs.pop("repo_id", str(save_directory).rstrip("/\\").split(os.path.sep)[-1])
        commit_message = kwargs.pop("commit_message", None)
        private = kwargs.pop("private", None)
        token = kwargs.get("token")
        result = super().save_pretrained(save_directory, *args, **kwargs)
        bundle_shared_code(save_directory)
        from huggingface_hub import create_repo, upload_folder

        repo_id = create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        upload_folder(repo_id=repo_id, folder_path=save_directory, commit_message=commit_message or "Upload",
                      token=token)
        return result


__all__ = ["SharedCodeMixin", "bundle_shared_code"]
