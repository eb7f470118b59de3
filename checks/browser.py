"""The browser that tests/test_report.py opens the HTML report in: Debian's `chromium` (Playwright's
own browser download needs the network). `make test` runs this first:

    .venv/bin/python checks/browser.py

- chromium on PATH: nothing to do;
- missing, as root with apt-get (CI, a container): `apt-get install chromium`, and an error (exit 1)
  if that fails;
- missing otherwise: one line saying what to install; exit 0, so that the rest of the suite runs
  (the report's browser tests are reported skipped, for that reason).
"""
import os
import shutil
import subprocess
import sys

NAME = "chromium"
# The line of a machine where it is missing and cannot be installed here; test_report.py's skip
# reason too.
MISSING = ("Debian's chromium is not installed (the report's browser tests are skipped): "
           "sudo apt-get install chromium")


def find() -> str | None:
    """The path of chromium on PATH, None if it is not there."""
    return shutil.which(NAME)


def plan(found: bool, root: bool, apt: bool) -> str:
    """What `make test` does about the browser: "nothing" (it is there), "install" (missing, as root
    with apt-get) or "advise" (missing, and not ours to install: say what to install)."""
    if found:
        return "nothing"
    return "install" if root and apt else "advise"


def install() -> int:
    """apt-get's install of chromium, quietly (its own errors on stderr); its exit code."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", NAME]):
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL)
        if done.returncode:
            return done.returncode
    return 0


def main() -> int:
    action = plan(find() is not None, os.geteuid() == 0, shutil.which("apt-get") is not None)
    if action == "install":
        print("installing Debian's chromium for tests/test_report.py (apt-get install chromium)", flush=True)
        if install() or find() is None:
            print("error: apt-get could not install chromium, which tests/test_report.py needs; "
                  "install it, then run make test again", file=sys.stderr)
            return 1
    elif action == "advise":
        print(MISSING, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
