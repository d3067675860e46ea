"""Secrets out of logs, messages and printed configs (issue 19).

A Redis URL may carry a password (``redis://:PASSWORD@host:6379/0``, ``redis://user:PASSWORD@...``);
any URL may carry userinfo. :func:`redact_url` masks it, :func:`redact_text` masks a URL's
password wherever it appears in a text (an exception message), :func:`redact_fields` masks the
URL-valued fields (names ending in ``_url``) and the password fields (``*_password``) of a flat
config mapping. Everything that logs,
prints or raises with a configured URL goes through one of these.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

MASK = "***"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")


def _userinfo(url: str) -> tuple[int, int] | None:
    """(start, end) of the userinfo (``user:password`` before the last ``@``), or None.

    The last ``@`` counts (not the first ``/`` after it): a password written with an unescaped
    ``/``, ``?`` or ``#`` is still masked whole; a malformed URL is masked rather than shown.
    """
    at = url.rfind("@")
    if at < 0:
        return None
    m = _SCHEME.match(url)
    start = m.end() if m else (2 if url.startswith("//") else 0)
    return (start, at) if at >= start else None


def redact_url(url: Any) -> Any:
    """``url`` with the password of its userinfo replaced by ``***``.

    ``redis://:pw@h:6379/0`` -> ``redis://:***@h:6379/0``; ``redis://user:pw@h`` ->
    ``redis://user:***@h``; userinfo without a ``:`` (``redis://pw@h``: some clients read it as
    the password) is masked whole: ``redis://***@h``. A URL without userinfo, ``''`` and
    non-strings come back unchanged.
    """
    if not isinstance(url, str):
        return url
    span = _userinfo(url)
    if span is None:
        return url
    start, end = span
    user, colon, _ = url[start:end].partition(":")
    masked = f"{user}:{MASK}" if colon else MASK
    return url[:start] + masked + url[end:]


def url_secrets(url: str) -> list[str]:
    """The password of ``url``'s userinfo as written and percent-decoded (empty: none)."""
    if not isinstance(url, str):
        return []
    span = _userinfo(url)
    if span is None:
        return []
    user, colon, password = url[span[0]:span[1]].partition(":")
    secret = password if colon else user
    return sorted({s for s in (secret, unquote(secret)) if s}, key=len, reverse=True)


def redact_text(text: str, *urls: str) -> str:
    """``text`` (e.g. an exception message) with every given URL, and its password on its
    own, masked."""
    text = str(text)
    for url in urls:
        if not isinstance(url, str) or not url:
            continue
        text = text.replace(url, redact_url(url))
        for secret in url_secrets(url):
            text = text.replace(secret, MASK)
    return text


def redact_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a flat ``{field: value}`` config with every ``*_url`` value redacted and every
    non-empty ``*_password`` value replaced by ``***``."""
    return {k: redact_url(v) if k.endswith("_url") else MASK if k.endswith("_password") and v else v
            for k, v in values.items()}
