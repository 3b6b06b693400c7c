"""What text may hold, in one place: text that leaves a service encodes as UTF-8, and a name
that is shown to people shows what it is.

- A Python str can hold a surrogate code point only unpaired (JSON's "\\ud800" escape, or a byte
  that was not UTF-8 decoded with surrogateescape). It has no UTF-8 form: one in an answer made
  the answer a 500, one in a stored record made it unreadable. `valid_text` shows each as
  U+FFFD; the api refuses request bodies holding one (shared/http_errors.py).
- An identifier (a job name, a base model, a task, a column) is shown in the dashboard, the CLI
  and the logs: control characters (a newline), format characters (bidi overrides, zero-width
  spaces: Unicode category Cf), surrogates and line or paragraph separators would change how it
  or the text around it displays. `invisible_chars` finds them.
"""

from __future__ import annotations

import re
import unicodedata

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"
# Cc control, Cf format, Cs surrogate, Zl line separator, Zp paragraph separator.
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def valid_text(text: str) -> tuple[str, int]:
    """`text` with each lone surrogate replaced by U+FFFD, and how many there were."""
    return LONE_SURROGATE.subn(REPLACEMENT, text)


def invisible_chars(text: str) -> list[str]:
    """The characters of `text` that an identifier may not hold, as U+XXXX (in order, distinct)."""
    found = dict.fromkeys(f"U+{ord(c):04X}" for c in text if unicodedata.category(c) in HIDDEN_CATEGORIES)
    return list(found)
