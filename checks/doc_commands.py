"""Run the commands of README.md and docs/*.md as a new user would, in a fresh clone of this
repository's HEAD. A check of the docs, not part of `make test` (it trains some twenty small runs
and `make demo`; its time on the machines it was measured on: docs/measurements.md):

    .venv/bin/python checks/doc_commands.py           # the commands that run in minutes
    .venv/bin/python checks/doc_commands.py --long    # and those that take longer (the benchmark, the suite)
    .venv/bin/python checks/doc_commands.py --list    # what it would run, and why it skips the others
    .venv/bin/python checks/doc_commands.py --page docs/inference.md   # one page's commands

Every indented code block of those pages follows a tag, an HTML comment that a reader of the
rendered page does not see:

    <!-- commands: run -->          each line is a command, run as written
    <!-- commands: small -->        run with `--image-size 32` appended to each command that trains
                                    (train_*.py, src.tools.compare_recipes): VGG16 at 224 px takes
                                    seconds an image on a CPU
    <!-- commands: long -->         run as written, with --long only
    <!-- commands: skip REASON -->  not run here (GPUs, the Kaggle download, two machines)
    <!-- commands: text -->         not commands (a folder listing, a sample of output)

Options after the kind: `exit=1` (the exit code the command ends with, e.g. diff's when the files
differ), `serve=20` (a server: it must still be running after 20 s; then it is stopped).

What the clone gets before the commands run, as a user's machine would have it:
- `.venv`: a link to this checkout's environment (made by `make install`), and requirements*.txt
  dated before it, so that make does not install again;
- `data/`: a small synthetic set in the Kaggle layout (260 labelled images, 20 test images), enough
  for the largest documented global batch (4 processes x 50);
- torchvision's ImageNet weights file for VGG16 where torchvision looks for it (TORCH_HOME), as
  docs/kaggle.md says to do offline: random weights of the right shapes, so `--weights default`
  runs without the internet (the commands are checked to run, not for what they learn);
- no accelerate config file (HF_HOME in the clone's temporary folder).
At the end, `git status` must show no file that the commands wrote and git does not ignore.
Exit 1 if any command failed or left such a file.
"""
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/data.md", "docs/flags.md", "docs/outputs.md", "docs/modes.md", "docs/kaggle.md", "docs/freeze.md",
         "docs/recipe.md", "docs/multi-node.md", "docs/fsdp.md", "docs/performance.md", "docs/watching.md", "docs/reliability.md",
         "docs/gpus.md", "docs/inference.md", "docs/measurements.md", "docs/report.md"]
KINDS = ("run", "small", "long", "skip", "text")
TAG = re.compile(r"<!--\s*commands:\s*(.*?)\s*-->")
TRAINS = re.compile(r"\btrain_\w+\.py\b|\bsrc\.tools\.compare_recipes\b")


@dataclass
class Command:
    page: str
    line: int
    text: str
    kind: str
    reason: str = ""
    exit: int = 0
    serve: int = 0

    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def as_run(self) -> str:
        """The command line that runs: as written, or with --image-size 32 for `small`."""
        if self.kind != "small" or not TRAINS.search(self.text):
            return self.text
        words = shlex.split(self.text, comments=True)
        assert not {"&&", "||", ";", "|"} & set(words), f"{self.where()}: a shell pipeline cannot be shrunk"
        return shlex.join(words + ["--image-size", "32"])


def pages(root: Path) -> list[Path]:
    """The pages in reading order: README, then the docs (any not listed in PAGES at the end)."""
    listed = [root / page for page in PAGES if (root / page).exists()]
    return listed + sorted(set((root / "docs").glob("*.md")) - set(listed))


def parse_tag(text: str, where: str) -> dict:
    words = text.split()
    if not words or words[0] not in KINDS:
        raise ValueError(f"{where}: the tag <!-- commands: {text} --> does not start with one of {', '.join(KINDS)}")
    tag: dict[str, str | int] = {"kind": words[0]}
    rest = words[1:]
    while rest and re.fullmatch(r"(exit|serve)=\d+", rest[0]):
        key, value = rest.pop(0).split("=")
        tag[key] = int(value)
    tag["reason"] = " ".join(rest)
    return tag


def commands(root: Path) -> list[Command]:
    """Every command of every indented code block, with its block's tag; a block without a tag
    is an error (a new page or block must say how it is checked)."""
    found = []
    for path in pages(root):
        page = str(path.relative_to(root))
        lines = path.read_text().splitlines()
        i, tag = 0, None
        while i < len(lines):
            line = lines[i]
            tagged = TAG.fullmatch(line.strip())
            if tagged:
                tag = parse_tag(tagged.group(1), f"{page}:{i + 1}")
            starts_block = line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip())
            if not starts_block:
                if line.strip() and not TAG.fullmatch(line.strip()):
                    tag = None  # a tag belongs to the block right after it
                i += 1
                continue
            if tag is None:
                raise ValueError(f"{page}:{i + 1}: a code block without a <!-- commands: ... --> tag before it")
            block_start, block = i, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                block.append((i + 1, lines[i][4:]))
                i += 1
            if tag["kind"] != "text":
                pending, first = "", None
                for number, text in block:
                    if not text.strip():
                        continue
                    first = first or number
                    if text.rstrip().endswith("\\"):
                        pending += text.rstrip()[:-1].rstrip() + " "
                        continue
                    found.append(Command(page, first, (pending + text.strip()).strip(), **tag))
                    pending, first = "", None
            tag = None
            assert i > block_start
    return found


def prepare_clone(source: Path, work: Path) -> tuple[Path, dict]:
    """A fresh clone of source's HEAD in work/clone, with what a user's machine would have (see
    the module's docstring); returns it and the environment to run the commands in."""
    clone = work / "clone"
    subprocess.run(["git", "clone", "--quiet", str(source), str(clone)], check=True)
    venv = (source / ".venv").resolve()
    (clone / ".venv").symlink_to(venv)
    installed = (venv / ".installed").stat().st_mtime
    for requirements in clone.glob("requirements*.txt"):
        os.utime(requirements, (installed - 60, installed - 60))
    env = {**os.environ, "PATH": f"{clone / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "TORCH_HOME": str(work / "torch"), "HF_HOME": str(work / "hf"), "PYTHONUNBUFFERED": "1"}
    python = str(clone / ".venv" / "bin" / "python")
    subprocess.run([python, "-m", "src.tools.synthetic", "data", "--train", "260", "--test", "20", "--size", "64"],
                   cwd=clone, env=env, check=True, capture_output=True)
    weights = work / "torch" / "hub" / "checkpoints"
    weights.mkdir(parents=True)
    subprocess.run([python, "-c", "import sys, torch, torchvision; "
                    "torch.save(torchvision.models.vgg16().state_dict(), sys.argv[1])",
                    str(weights / "vgg16-397923af.pth")], cwd=clone, env=env, check=True)
    return clone, env


def run(command: Command, clone: Path, env: dict, log: Path) -> tuple[bool, str]:
    """Run one command in the clone; (whether it did what its tag says, what happened)."""
    start = time.time()
    with open(log, "w") as out:
        out.write(f"$ {command.as_run()}\n")
        out.flush()
        process = subprocess.Popen(["bash", "-c", command.as_run()], cwd=clone, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=command.serve or 3600)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 15)
            process.wait()
            if command.serve:
                return True, f"still serving after {command.serve} s, stopped"
            return False, "still running after an hour, stopped"
    seconds = time.time() - start
    if command.serve:
        return False, f"exited {code} after {seconds:.0f} s; a server should keep running"
    if code != command.exit:
        return False, f"exit {code}, expected {command.exit} ({seconds:.0f} s)"
    return True, f"exit {code} ({seconds:.0f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="also run the commands tagged long")
    parser.add_argument("--list", action="store_true", help="list the commands and what would happen to each")
    parser.add_argument("--keep", action="store_true", help="keep the clone (it is kept anyway when something failed)")
    parser.add_argument("--page", choices=PAGES, help="only this page's commands")
    args = parser.parse_args()

    try:
        todo = [command for command in commands(ROOT) if args.page in (None, command.page)]
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    runs = {"run", "small"} | ({"long"} if args.long else set())
    if args.list:
        for command in todo:
            how = ("runs" if command.kind in runs else
                   f"skipped ({command.kind}{': ' + command.reason if command.reason else ''})")
            shown = command.as_run() if command.kind == "small" else command.text
            print(f"{command.where():24} {how:60} {shown}")
        return

    work = Path(tempfile.mkdtemp(prefix="doc-commands-"))
    clone, env = prepare_clone(ROOT, work)
    (work / "logs").mkdir()
    print(f"fresh clone of {ROOT} (HEAD) in {clone}; logs in {work / 'logs'}", flush=True)
    failed = 0
    for number, command in enumerate(todo, 1):
        if command.kind not in runs:
            why = command.reason or ("takes long: pass --long" if command.kind == "long" else "")
            print(f"skipped  {command.where():24} {command.text}  [{command.kind}: {why}]", flush=True)
            continue
        ok, what = run(command, clone, env, work / "logs" / f"{number:03d}.txt")
        failed += not ok
        small = "  [+ --image-size 32]" if command.as_run() != command.text else ""
        print(f"{'ran     ' if ok else 'FAILED  '} {command.where():24} {command.text}{small}  {what}"
              + ("" if ok else f"; log {work / 'logs' / f'{number:03d}.txt'}"), flush=True)
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for line in status:
        print(f"not ignored: {line}")
    print(f"{sum(c.kind in runs for c in todo)} commands run, {failed} failed; "
          f"{sum(c.kind not in runs for c in todo)} skipped; {len(status)} path(s) git does not ignore")
    if failed or status:
        print(f"the clone stays for a look: {work}")
        sys.exit(1)
    if args.keep:
        print(f"kept: {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
