"""Secrets out of everything evalpipe stores, with one function applied where samples are
made (`tasks.run.sampling`) and where endpoint errors are worded (`tasks.agents.openai_client`).

The secrets are the values of `OPENAI_API_KEY` and of every environment variable whose
name looks like a secret (`*_KEY`, `*_TOKEN`, `*_SECRET`, `*PASSWORD*`). They are read at
each call, so a key set after start-up is covered too. Values shorter than
`MIN_SECRET_CHARS` are not treated as secrets: masking every "1" or "true" in the stored
text would destroy it and protect nothing.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence

MIN_SECRET_CHARS = 8
MASK = "***"
_SECRET_NAME = re.compile(r"(_KEY|_TOKEN|_SECRET)$|PASSWORD", re.IGNORECASE)


def secret_values(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The configured secrets, longest first (a secret containing another is masked whole)."""
    env = os.environ if environ is None else environ
    values = {value for name, value in env.items() if _secret_name(name) and len(value) >= MIN_SECRET_CHARS}
    return tuple(sorted(values, key=len, reverse=True))


@functools.lru_cache(maxsize=1024)
def _secret_name(name: str) -> bool:
    return name == "OPENAI_API_KEY" or _SECRET_NAME.search(name) is not None


def redact(text: str, also: Iterable[str | None] = (), secrets: Sequence[str] | None = None) -> str:
    """`text` with every configured secret (and each of `also`) replaced by `***`. `secrets`:
    `secret_values()` read once by a caller masking many strings (a sample's trace)."""
    known = secret_values() if secrets is None else secrets
    extra = [s for s in also if s]
    for secret in sorted({*known, *extra}, key=len, reverse=True) if extra else known:
        if secret in text:
            text = text.replace(secret, MASK)
    return text
