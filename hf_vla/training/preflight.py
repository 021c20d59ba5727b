"""Start-up checks of the services a training run will need at its end or its first step: the Hub for
`push_to_hub`, wandb for `report_to`. Run before the data scan and the model build, each failure one line that says
what to do (left alone, both fail with a long traceback after training has started or finished)."""

from __future__ import annotations

import importlib.util
import netrc
import os
from urllib.parse import urlparse

from hf_vla.errors import ConfigError

HUB_ANSWER_S = 10.0  # a compute node without internet may drop packets silently: no answer within this is an answer


def check_hub_push(args) -> None:
    """`push_to_hub`: a token, the Hub reachable (an answer within `HUB_ANSWER_S`), and the token accepted."""
    if not args.push_to_hub:
        return
    from huggingface_hub import constants, get_token, whoami

    target = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"push_to_hub=true (to {target!r}) but the Hub is offline (HF_HUB_OFFLINE=1): unset it, or "
                          "drop push_to_hub and upload output_dir later (`hf upload`)")
    token = args.hub_token or get_token()
    if not token:
        raise ConfigError(f"push_to_hub=true (to {target!r}) but no Hugging Face token is set: log in with "
                          "`hf auth login` (or set HF_TOKEN, or pass --hub_token) before training")
    import threading

    answer: dict = {}

    def ask():
        try:
            answer["user"] = whoami(token=token)
        except Exception as error:  # noqa: BLE001  (reported below)
            answer["error"] = error

    # huggingface_hub's whoami has no timeout of its own: where packets are dropped it waits minutes in silence
    asking = threading.Thread(target=ask, name="hf_vla-hub-check", daemon=True)
    asking.start()
    asking.join(HUB_ANSWER_S)
    if asking.is_alive():
        raise ConfigError(f"push_to_hub=true (to {target!r}) but the Hub did not answer within {HUB_ANSWER_S:g} s "
                          f"({constants.ENDPOINT}): no internet here? Drop push_to_hub and upload output_dir later "
                          f"(`hf upload {target} {args.output_dir}` where the Hub is reachable)")
    error = answer.get("error")  # HTTP 401, no network, DNS, proxy: all mean the push would fail
    if error is not None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        status = getattr(getattr(error, "response", None), "status_code", None)
        cause = "the token was rejected (log in again: `hf auth login`)" if status == 401 else \
            f"the Hub cannot be reached ({first[:200]})"
        raise ConfigError(f"push_to_hub=true (to {target!r}) but {cause}; fix it, or drop push_to_hub and upload "
                          "output_dir later") from error


def _wandb_key() -> str | None:
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return None
    return entry[2] if entry else None


def check_wandb(args) -> None:
    """`report_to` wandb: installed, and logged in unless it runs offline or disabled."""
    report_to = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    installed = importlib.util.find_spec("wandb") is not None
    if "wandb" not in report_to and not ("all" in report_to and installed):
        return
    if not installed:
        raise ConfigError("report_to includes 'wandb' but wandb is not installed: pip install wandb, or drop it from "
                          "report_to")
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get(
            "WANDB_DISABLED", "").lower() in ("true", "1"):
        return
    if not _wandb_key():
        raise ConfigError("report_to includes 'wandb' but no wandb API key is set: run `wandb login` (or set "
                          "WANDB_API_KEY), or set WANDB_MODE=offline to log locally and `wandb sync` later")


def check_services(args) -> None:
    check_hub_push(args)
    check_wandb(args)


__all__ = ["check_hub_push", "check_services", "check_wandb"]
