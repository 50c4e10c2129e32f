"""Credentials never leave the process in a file or a line: :func:`redact`, the one function every
config, URI, path or message goes through before the pipeline writes or prints it
(docs/storage.md#credentials).

What is replaced by :data:`MASK`:

* in a mapping (a config, ``spark.conf``): the value of every key that names a secret
  (:data:`SECRET_NAME`: Spark's default ``spark.redaction.regex``, ``secret|password|token|
  access[.]?key``, plus ``passwd``, ``credential`` and ``signature``), whatever the value;
* in a string: the password of a URI's ``user:password@`` (the whole user part when it has no
  password: a token), the value of a secret-named query or ``;key=value`` parameter
  (``?X-Amz-Signature=``, Spark Connect's ``;token=``), and the value of every environment
  variable with a secret's name (``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ...) wherever
  it occurs.

:func:`expand_path` expands ``~`` and ``$VARS`` in a user's path, except the variables with a
secret's name: those stay as written, so a path never carries a credential into a line or a
report.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
#: names (config keys, query parameters, environment variables) whose values are credentials
SECRET_NAME = re.compile(r"secret|password|passwd|token|credential|signature|access[._-]?key", re.I)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s'\"]*)(?::(?P<pw>[^/@\s'\"]*))?@")
_PARAM = re.compile(r"(?P<key>[?&;](?P<name>[A-Za-z0-9_.-]+)=)(?P<value>[^&;#\s'\"]*)")
_VAR = re.compile(r"\$(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\})")
#: an environment value shorter than this is not searched for in text (it would match by chance)
_MIN_SECRET = 6


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def _secret_values() -> list[str]:
    vals = {v for k, v in os.environ.items() if is_secret_name(k) and len(v) >= _MIN_SECRET}
    return sorted(vals, key=len, reverse=True)


def _text(s: str) -> str:
    def userinfo(m: re.Match) -> str:
        if m.group("pw") is not None:
            return f"{m.group('scheme')}{m.group('user')}:{MASK}@"
        return f"{m.group('scheme')}{MASK}@"

    s = _USERINFO.sub(userinfo, s)
    s = _PARAM.sub(lambda m: m.group("key") + MASK if is_secret_name(m.group("name")) and m.group("value")
                   else m.group(0), s)
    for v in _secret_values():
        s = s.replace(v, MASK)
    return s


def redact(value: Any) -> Any:
    """``value`` (a string, or a mapping / list / tuple of them, nested) with its credentials
    replaced by :data:`MASK` (see the module); other values as they are. The input is not changed."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, Mapping):
        return {k: (MASK if is_secret_name(k) and v not in (None, "") and not isinstance(v, (bool, Mapping))
                    else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def expand_path(p: str) -> str:
    """``~`` and ``$VAR`` / ``${VAR}`` expanded in a user's path, as ``os.path.expandvars`` does
    (an unset variable stays as written), except a variable with a secret's name, which is never
    expanded."""
    p = os.path.expanduser(p)

    def one(m: re.Match) -> str:
        name = m.group("name") or m.group("braced")
        if is_secret_name(name) or name not in os.environ:
            return m.group(0)
        return os.environ[name]

    return _VAR.sub(one, p)
