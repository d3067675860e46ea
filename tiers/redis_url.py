"""The Redis tier's URL and password, checked before redis-py sees them (issue 37).

A password can contain anything. It comes either percent-encoded in the URL
(``redis://:p%2Fw%23d%40x%25@host:6379/0``: RFC 3986 userinfo, which redis-py decodes) or
whole, as written, from the ``redis_password`` field (``$KVBLEND_REDIS_PASSWORD``) or the file
``redis_password_file`` names (a mounted Secret; its trailing newline is not part of it), and is
then handed to redis-py as its ``password`` option (``redis.Redis.from_url(url, password=...)``),
never pasted into a URL.

A password written into the URL unencoded used to break it silently (``#``, ``?`` or ``/`` end
the host part, so redis-py connected elsewhere or failed) or leaked its first part through
urllib's error (``Port could not be cast to integer value as 'S3cr3t'``). :func:`connect_options`
refuses such a URL with a message that never quotes the URL's userinfo or urllib's text.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from tiers.redact import redact_url

_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_HINT = ("percent-encode the password in the URL (e.g. urllib.parse.quote(password, safe='')) or give it "
         "whole in redis_password_file or $KVBLEND_REDIS_PASSWORD")


def _raw_userinfo(url: str) -> str | None:
    """What stands between ``scheme://`` and the URL's last ``@`` (None: no ``@``)."""
    _, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return None
    return rest.rpartition("@")[0]


def read_password_file(path: str) -> str:
    """The password in ``path``, whole (one trailing ``\\n`` or ``\\r\\n`` dropped).

    Raises:
        ValueError: the file cannot be read or is empty (naming the path, never its contents).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"redis_password_file {path!r} cannot be read: "
                         f"{getattr(e, 'strerror', None) or type(e).__name__}") from None
    password = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not password:
        raise ValueError(f"redis_password_file {path!r} is empty")
    return password


def connect_options(url: str, password: str = "") -> dict:
    """redis-py's keyword options for ``url`` plus a password given apart from it:
    ``{"password": ...}`` or ``{}`` (the URL's own password, if any, is redis-py's to decode).

    Raises:
        ValueError: a URL whose userinfo is not valid percent-encoding (a ``/``, ``#``, ``?``
            or a lone ``%`` in the password), or a password both in the URL and apart from it.
            The message shows the URL with its userinfo masked, never a part of a password.
    """
    shown = redact_url(url)
    raw = _raw_userinfo(url)
    if raw is not None:
        try:
            parsed = urlsplit(url)
        except ValueError:
            parsed = None
        if parsed is None or parsed.netloc.rpartition("@")[0] != raw or _BAD_ESCAPE.search(raw):
            raise ValueError(f"redis url {shown!r}: its password is not percent-encoded ({_HINT})")
        try:
            parsed.port  # noqa: B018 - urllib checks the port only when asked; its message quotes it
        except ValueError:
            raise ValueError(f"redis url {shown!r} is malformed: its port is not a number from 0 to 65535") from None
    if not password:
        return {}
    if raw is not None and ":" in raw and unquote(raw.partition(":")[2]):
        raise ValueError(f"redis url {shown!r} carries a password and redis_password(_file) gives another: "
                         "give it once")
    return {"password": password}
