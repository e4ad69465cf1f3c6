"""What a user may see of a store URL or a backend's error: the same, secrets hidden.

Passwords in a URL's userinfo and the values of secret-named query and fragment
parameters become ``***`` wherever gatherstore shows a URL (``str`` of stores,
messages, logs, the command's output); a backend's error is reduced to one
line of text without its exception chain.
"""

from __future__ import annotations

import re
import urllib.parse

from gatherstore._time import expired

__all__ = ["describe_failure", "hide_password", "hide_secrets", "is_secret"]

#: Query (and fragment) parameters whose values are secrets, by name or by ending.
_SECRET_NAMES = frozenset(
    {"key", "sig", "pwd", "pass", "auth", "sas", "credential", "creds", "connection_string"}
)
_SECRET_ENDINGS = (
    "password",
    "passwd",
    "secret",
    "token",
    "_key",
    "-key",
    "signature",
    "apikey",
    "credentials",
)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def is_secret(name: str) -> bool:
    """Whether a parameter or option called ``name`` holds a secret."""
    name = urllib.parse.unquote_plus(name).strip().lower()
    return name in _SECRET_NAMES or name.endswith(_SECRET_ENDINGS)


def _hide_params(text: str) -> str:
    """A query string with the values of secret-named parameters replaced by ``***``."""
    fields = []
    for field in text.split("&"):
        name, eq, _ = field.partition("=")
        fields.append(f"{name}=***" if eq and is_secret(name) else field)
    return "&".join(fields)


def hide_password(url: str) -> str:
    """``url`` with its secrets replaced by ``***``: the password of its userinfo
    (``redis://user:***@host``) and the values of secret-named query and fragment
    parameters (``?password=***``, ``secret``, ``token``, ``key``, ``sig``, ...).

    Works on malformed URLs too: it parses nothing it does not need.
    """
    head, hash_, fragment = url.partition("#")
    head, question, query = head.partition("?")
    scheme, sep, rest = head.partition("://")
    if sep:
        netloc, slash, path = rest.partition("/")
        userinfo, at, host = netloc.rpartition("@")
        if at and ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
        head = f"{scheme}{sep}{netloc}{slash}{path}"
    return head + question + _hide_params(query) + hash_ + _hide_params(fragment)


def hide_secrets(text: str) -> str:
    """``text`` (e.g. a backend's error message) with every URL in it passed through
    ``hide_password``."""
    return _URL.sub(lambda match: hide_password(match.group(0)), text)


def describe_failure(exc: BaseException) -> str:
    """Why a backend call failed, in one line without secrets: the exception's type and
    message (and those of its cause, where the message alone says little).

    The backend's exception is not chained to ours: its traceback is the HTTP or Redis
    client's frames, which say nothing a user can act on.
    """
    why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) and str(cause) not in why:
        why += f" (from {type(cause).__name__}: {cause})"
    if expired():
        why = f"no answer within the call's timeout ({why})"
    return hide_secrets(" ".join(why.split()))
