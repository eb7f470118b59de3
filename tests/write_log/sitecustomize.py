"""Loaded by every Python process of a test run (on PYTHONPATH): logs which rank renames which file.

All our outputs are written to a temporary name and renamed into place with os.replace, so this
log lists every output file write, with the RANK of the process that made it.
"""
import os

_replace = os.replace


def _logged_replace(src, dst, *args, **kwargs):
    with open(os.environ["WRITE_LOG"], "a") as log:
        log.write(f"{os.environ.get('RANK', '-')} {os.fspath(dst)}\n")
    return _replace(src, dst, *args, **kwargs)


if os.environ.get("WRITE_LOG"):
    os.replace = _logged_replace
