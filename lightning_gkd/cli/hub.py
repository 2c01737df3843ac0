"""Upload an exported model folder to the Hugging Face Hub, with the token taken from the environment only."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

TOKEN_VARIABLE = "HF_TOKEN"


class HubPushError(RuntimeError):
    """The upload could not happen: offline, no or a rejected token, or the hub refused the repo."""


def hub_token() -> str:
    """The token in ``$HF_TOKEN``; raises ``HubPushError`` (naming the fix) when it is unset. Never logged."""
    token = os.environ.get(TOKEN_VARIABLE, "").strip()
    if not token:
        raise HubPushError(
            f"push_to_hub needs a Hugging Face token in the environment variable {TOKEN_VARIABLE} "
            "(a token with write access, from https://huggingface.co/settings/tokens): "
            f"`export {TOKEN_VARIABLE}=...`. It is read from the environment only, never from a "
            "config file or the command line. Or run with push_to_hub=false."
        )
    return token


def check_push_settings(repo_id: str | None) -> None:
    """Fail before training, not after it, when a push could not happen: no repo id, no token, or offline."""
    if not repo_id or "/" not in str(repo_id):
        raise HubPushError(f"push_to_hub=true needs hub_model_id=<user or org>/<name>, got {repo_id!r}.")
    hub_token()
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise HubPushError(
            f"Cannot push to {repo_id!r}: Hugging Face offline mode is on (HF_HUB_OFFLINE or "
            "TRANSFORMERS_OFFLINE is set). Unset it on a machine with network access, or run with "
            "push_to_hub=false and upload the export folder later with "
            f"`hf upload {repo_id} <export folder>`."
        )


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    commit_message: str = "Upload model trained with lightning_gkd",
) -> str:
    """Create ``repo_id`` (a model repo; kept if it exists) and upload ``folder`` to it; returns the repo URL.

    Errors from the hub are re-raised as ``HubPushError`` naming the repo id and the fix (offline, token missing
    or rejected, no write access, network down)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    folder = Path(folder)
    if not folder.is_dir():
        raise HubPushError(f"Cannot push {str(folder)!r} to {repo_id!r}: the folder does not exist (export=false?).")
    api = HfApi(token=hub_token())
    later = f" The export stays in {str(folder)!r}; upload it later with `hf upload {repo_id} {folder}`."
    try:
        url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message=commit_message)
    except OfflineModeIsEnabled:
        raise HubPushError(
            f"Cannot push to {repo_id!r}: Hugging Face offline mode is on (HF_HUB_OFFLINE or "
            "TRANSFORMERS_OFFLINE is set); unset it on a machine with network access." + later
        ) from None
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status in (401, 403):
            fix = (
                f"the hub rejected the token in {TOKEN_VARIABLE} (HTTP {status}): use a token with write "
                f"access to {repo_id.split('/')[0]!r} (https://huggingface.co/settings/tokens)."
            )
        else:
            fix = f"the hub answered HTTP {status}: {str(error).splitlines()[0] if str(error) else ''}"
        raise HubPushError(f"Cannot push to {repo_id!r}: {fix}" + later) from None
    except _network_errors() as error:
        raise HubPushError(
            f"Cannot push to {repo_id!r}: the hub is unreachable ({type(error).__name__}). Check the "
            "network or proxy settings." + later
        ) from None
    return str(url)


def _network_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "the hub could not be reached" (huggingface_hub >= 1 talks through httpx)."""
    errors: tuple[type[BaseException], ...] = (ConnectionError, OSError)
    for name in ("httpx2", "httpx"):  # huggingface_hub 2.x uses httpx2, 1.x httpx
        try:
            errors += (importlib.import_module(name).TransportError,)
        except (ImportError, AttributeError):
            pass
    return errors
