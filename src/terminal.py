"""Text from outside (file names, most of all) made safe to print on a terminal.

A file name may hold any byte but / and NUL: an escape sequence (ESC [ ...) that recolours,
moves the cursor or clears the screen, a carriage return that sends the rest of the line over
what came before it, a right-to-left override that shows the name backwards, and bytes that are
not UTF-8 (Python reads them as lone surrogates, which a UTF-8 terminal cannot encode: printing
them raises UnicodeEncodeError). shown() writes each such character as a visible escape.
"""
import unicodedata

_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
# Control characters (C0, DEL, C1), format characters (bidi overrides, zero-width joiners), line
# and paragraph separators, and surrogates: nothing a name needs to show as it is.
_ESCAPED = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, as os.fsdecode's surrogateescape holds it
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(text: object) -> str:
    """str(text) with every control, format and separator character, and every byte that was not
    UTF-8, written as a backslash escape (\\x1b, \\r, \\u202e, \\xff): one line, printable on any
    UTF-8 terminal, that cannot move the cursor or hide what comes before it."""
    text = str(text)
    if text.isprintable():  # the usual case, fast: False for every character escaped here (and a few others)
        return text
    return "".join(_escape(char) if unicodedata.category(char) in _ESCAPED else char for char in text)
