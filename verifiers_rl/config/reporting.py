"""wandb's login, checked before anything starts: without one, `wandb.init` fails (a long traceback) after the
server is up, or, in a terminal, waits at a login prompt. No network: the places wandb reads credentials from."""

from __future__ import annotations

import configparser
import netrc
import os
from urllib.parse import urlparse

WANDB_LOGIN_FIX = (
    'run `wandb login`, or set [trainer.args.wandb] mode = "offline" (and `wandb sync` later), or report_to = "none"'
)


def reports_to_wandb(args) -> bool:
    report = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    return "wandb" in report or "all" in report


def _netrc_has(host: str) -> bool:
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wandb_settings() -> dict[str, str]:
    """wandb's settings files, as wandb reads them: the workspace's ./wandb/settings over the system's
    ($WANDB_CONFIG_DIR/settings, else ~/.config/wandb/settings), section [default]."""
    system = os.path.join(os.environ.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb"), "settings")
    workspace = os.path.join(os.environ.get("WANDB_DIR") or ".", "wandb", "settings")
    parser = configparser.ConfigParser()
    for path in (system, workspace):  # read in order: a later file's keys win
        try:
            parser.read(path)
        except configparser.Error:
            continue
    return dict(parser["default"]) if parser.has_section("default") else {}


def wandb_login_problem(args) -> str | None:
    """One line when the run reports to wandb online and wandb has no credentials here (its own sources:
    $WANDB_API_KEY, $WANDB_IDENTITY_TOKEN_FILE, an api_key in its settings files, the host's ~/.netrc entry that
    `wandb login` writes); else None."""
    if not reports_to_wandb(args) or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return None
    mode = (args.wandb or {}).get("mode") or os.environ.get("WANDB_MODE") or "online"
    if mode in ("offline", "disabled", "dryrun"):
        return None
    settings = _wandb_settings()
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.get("api_key"):
        return None
    base_url = os.environ.get("WANDB_BASE_URL") or settings.get("base_url") or "https://api.wandb.ai"
    host = urlparse(base_url).hostname or "api.wandb.ai"
    if _netrc_has(host):
        return None
    return (
        f"report_to includes wandb, but wandb has no login on this machine (no WANDB_API_KEY, no {host} entry in "
        f"~/.netrc): {WANDB_LOGIN_FIX}"
    )
