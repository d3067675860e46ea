"""Ray token authentication for the head ``kvblend server`` starts (issue 19).

Ray 2.60 turns token authentication on for ``ray start --head`` only when ``RAY_AUTH_MODE=token``
or a token already exists (``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``);
on a fresh machine it starts an open cluster — the GCS, Ray Client and dashboard ports then run
any code anyone sends — and says so in a warning that ``kvblend server`` used to swallow. So
:func:`head_env` makes sure a token exists (``ray get-auth-token --generate`` writes one, mode
0600; its stdout, the token, is discarded) and starts the head with ``RAY_AUTH_MODE=token``;
:func:`announce` says where the token is and how another node joins. ``kvblend server
--no-auth`` starts the head with ``RAY_AUTH_MODE=disabled`` and a warning that anyone who
reaches its ports can run code on the cluster.

Processes on the same machine (vLLM's connectors, ``kvblend ingest``, the demo) find the token
file themselves (Ray turns auth on in every process that sees a token); another machine needs
the same token (the file, ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``) and
``RAY_AUTH_MODE=token``. The token never reaches a log line, argv or a metric.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger("kvblend.server")

#: Ray's switch: ``token`` or ``disabled``
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def token_path() -> str:
    """Where Ray reads the token: ``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def has_token() -> bool:
    """Whether Ray would find a token here (the environment or the token file)."""
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(token_path())


def ensure_token(ray_exe: str) -> str:
    """Create the token file with ``ray get-auth-token --generate`` unless a token exists;
    returns where Ray reads it (``$RAY_AUTH_TOKEN`` when that is what holds it).

    Raises:
        RuntimeError: Ray could not create it (its stderr, which never holds the token).
    """
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    path = token_path()
    if not os.path.isfile(path):
        done = subprocess.run([ray_exe, "get-auth-token", "--generate"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0 or not os.path.isfile(path):
            raise RuntimeError(f"`ray get-auth-token --generate` did not create {path}: {done.stderr[-1000:]}")
    os.chmod(path, 0o600)
    return path


def head_env(ray_exe: str, *, no_auth: bool) -> tuple[dict[str, str], str | None]:
    """The environment for ``ray start --head`` and the token's location (None: auth off).
    With auth off it also sets ``RAY_AUTH_MODE=disabled`` in this process, which then connects
    to that head without a token."""
    env = dict(os.environ)
    if not no_auth and os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled":
        no_auth = True  # the operator's explicit RAY_AUTH_MODE=disabled: said loudly below
    if no_auth:
        log.warning("kvblend: --no-auth: the Ray head starts WITHOUT token authentication: anyone who "
                    "reaches its GCS, Ray Client or dashboard port can run code on this cluster and read "
                    "its cached KV")
        env[AUTH_MODE_ENV] = os.environ[AUTH_MODE_ENV] = "disabled"
        return env, None
    where = ensure_token(ray_exe)
    # The head only: this process finds the token file when it connects and turns auth on
    # itself (setting RAY_AUTH_MODE here, after Ray's config was read, would leave it off).
    env[AUTH_MODE_ENV] = "token"
    try:  # a token file created just now: Ray caches whether it found one (best effort)
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()
    except Exception:  # noqa: BLE001 - another Ray version: it reads the file when asked
        pass
    return env, where


def announce(where: str | None, address: str) -> None:
    """Tell the operator where the token is and how another node joins (stderr; never the token)."""
    if where is None:
        return
    print(f"kvblend: Ray token authentication is on; the token is in {where} (`ray get-auth-token` prints "
          f"it; the dashboard asks for it). Another node joins with the same token (that file, "
          f"RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) and RAY_AUTH_MODE=token: "
          f"`ray start --address {address}`", file=sys.stderr)
