"""Which stored values ``kvblend clear`` may delete: only chunk objects of ours, read first.

A shared Redis or bucket prefix may hold values kvblend never wrote (under keys that merely
look like ``<a>/seg/<b>``) and, during an upgrade, chunk objects of a *newer* format written by
the upgraded deployment sharing it. ``clear`` reads each candidate's first
:data:`~tiers.format.PREFIX_BYTES` bytes (magic and format version) and classifies it
(:func:`classify`) before deleting anything:

* ``current``: our magic, this process's :data:`~tiers.keys.FORMAT_VERSION`;
* ``older``: our magic, an older version (never read again: its namespaces differ too);
* ``newer``: our magic, a newer version (another deployment's: never deleted here);
* ``foreign``: anything else (another magic, shorter than the prefix, unreadable);
* ``other_key``: with an object key set, a current-version object whose header tag does not
  check under it (signed under a key since rotated, or unsigned): never read again, a counted
  miss. ``clear --stale`` reads the first :data:`KEY_CHECK_BYTES` of each value for this
  (:func:`check_bytes`); a header longer than that stays ``current``.

A plain clear deletes ``current``, ``other_key`` and ``older`` objects; ``--stale`` only
``older`` and ``other_key`` ones (:func:`deletable`): after a key rotation ``clear --stale``
reclaims the old key's objects and keeps the new key's. :class:`Cleared` is the count deleted, with what was skipped and why.
"""

from __future__ import annotations

import struct

from tiers import auth
from tiers.format import MAGIC, PREFIX_BYTES, AuthError, FormatError, parse_header
from tiers.keys import FORMAT_VERSION

CURRENT, OLDER, NEWER, FOREIGN, OTHER_KEY = "current", "older", "newer", "foreign", "other_key"
#: bytes of each value ``clear --stale`` reads when a key is set: prefix and header (the header
#: of an object of a few hundred layers is a few KiB)
KEY_CHECK_BYTES = 64 << 10


def check_bytes(stale: bool) -> int:
    """How many leading bytes of each value a ``clear`` reads: :data:`KEY_CHECK_BYTES` for
    ``clear --stale`` while this process has an object key, else the prefix's."""
    return KEY_CHECK_BYTES if stale and auth.current() is not None else PREFIX_BYTES
_MAGIC_VERSION = struct.Struct("<4sH")


def classify(head: bytes | memoryview | None) -> str:
    """The kind of a stored value whose first bytes are ``head`` (at least
    :data:`~tiers.format.PREFIX_BYTES` of them for a chunk object; None or fewer: ``foreign``;
    more, with an object key set: its header tag is checked, ``other_key`` when it fails)."""
    if head is None or len(head) < PREFIX_BYTES:
        return FOREIGN
    magic, version = _MAGIC_VERSION.unpack_from(head, 0)
    if magic != MAGIC or version == 0:
        return FOREIGN
    if version < FORMAT_VERSION:
        return OLDER
    if version > FORMAT_VERSION:
        return NEWER
    if len(head) > PREFIX_BYTES and auth.current() is not None:
        try:
            parse_header(head)
        except AuthError:  # another key's tag, or none
            return OTHER_KEY
        except FormatError:  # a header longer than what was read, or a corrupt one: kept
            return CURRENT
    return CURRENT


def deletable(kind: str, stale: bool) -> bool:
    """Whether ``clear`` (``stale``: ``clear --stale``) deletes a value of this kind."""
    return kind in (OLDER, OTHER_KEY) if stale else kind in (CURRENT, OLDER, OTHER_KEY)


class Cleared(int):
    """The number of chunk objects a ``clear`` deleted (an ``int``), with ``skipped``: how many
    values under a chunk key it read and kept, by kind (``newer``, ``foreign``, and with
    ``stale`` also ``current``)."""

    skipped: dict[str, int]

    def __new__(cls, deleted: int, skipped: dict[str, int] | None = None) -> Cleared:
        self = super().__new__(cls, deleted)
        self.skipped = {k: v for k, v in (skipped or {}).items() if v}
        return self

    def describe_skipped(self) -> str:
        """``''`` when nothing was kept, else e.g. ``'; kept 2 newer-format object(s), 1 foreign
        value(s)'``."""
        names = {NEWER: "newer-format object(s)", FOREIGN: "foreign value(s)",
                 CURRENT: "current object(s)", OLDER: "older-format object(s)"}
        parts = [f"{n} {names.get(k, k)}" for k, n in sorted(self.skipped.items())]
        return f"; kept {', '.join(parts)}" if parts else ""
