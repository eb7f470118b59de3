"""The commands in README.md and docs/: each code block says how it is checked (checks/doc_commands.py
runs them in a fresh clone), and what they write is ignored by git."""
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT
from doc_commands import commands

from src.cli import parse_args
from src.outputs import output_paths

# Flags whose value is a path a command writes (a file, or a folder it fills).
OUTPUT_FLAGS = ("--cache", "--checkpoint", "--plot", "--log-dir", "--out-dir", "--output", "--storage-path", "-d", "-p")
# What the tools write without flags: predict's --output, the benchmark's and the recipe
# comparison's --out-dir, make test-gpu's report, the synthetic set of make demo.
TOOL_DEFAULTS = ["submission.csv", "predictions.csv", "model/best.onnx", "benchmark/", "compare/", "gpu-selftest/", "data/synthetic/"]


def _written(words: list[str]) -> list[str]:
    """The paths a command writes inside the clone (an absolute one, a cluster's volume in
    docs/multi-node.md, is outside it: git never shows it)."""
    paths = [value for flag, value in zip(words, words[1:]) if flag in OUTPUT_FLAGS and not value.startswith("/")]
    if words[:3] == ["python", "-m", "src.tools.synthetic"]:
        paths.append(words[3] + "/")  # its folder argument
    return paths


def test_every_documented_output_is_ignored_by_git(tmp_path):
    """`--cache cache` (docs/freeze.md) left GBs that git showed as untracked. Asked of a new
    repository holding only this .gitignore, so that it runs in a copy of the tree too (the
    mutation check's is not a git repository, where git would answer nothing)."""
    args = parse_args("", [])
    paths = [str(path) for path in output_paths(args).values()] + TOOL_DEFAULTS
    for command in commands(ROOT):
        paths += _written(command.text.split())
    assert "cache" in paths and "runs/vgg16" in paths, paths  # the documented outputs were found
    probes = [path.rstrip("/") + ("/file" if "." not in Path(path).name else "") for path in paths]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")
    result = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *probes],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stderr  # 0: some ignored, 1: none; else an error
    not_ignored = [line.split("\t")[-1] for line in result.stdout.splitlines() if line.startswith("::")]
    assert not not_ignored, f"git would show these outputs as untracked: {not_ignored}"


def test_every_code_block_says_how_it_is_checked():
    """commands() stops at a block without its <!-- commands: ... --> tag; the tags cover both
    kinds of page: what runs here and what needs what is not here."""
    found = commands(ROOT)
    kinds = {command.kind for command in found}
    assert {"run", "small", "long", "skip"} <= kinds, kinds
    assert all(command.reason for command in found if command.kind == "skip")


def test_predicts_sample_output_is_what_the_command_above_it_prints():
    """docs/inference.md showed a sample of photos/holiday/... under `predict data/test`, which
    cannot print it: the sample's rows are of the folder the command predicts, as many as the
    synthetic set's command above writes into it, in predict's natural order."""
    lines = (ROOT / "docs" / "inference.md").read_text().splitlines()
    command = lines.index("    python -m src.tools.predict data/test")
    assert lines[command - 2] == "<!-- commands: run -->" and lines[command + 2] == "<!-- commands: text -->"
    sample = []
    for line in lines[command + 4:]:
        if not line.startswith("    "):
            break
        sample.append(line[4:])
    synthetic = next(line.split() for line in lines if line.startswith("    python -m src.tools.synthetic data "))
    images = int(synthetic[synthetic.index("--test") + 1])
    rows = [line.split()[0] for line in sample[1:] if not line.startswith(("...", "predicted"))]
    assert sample[0].split() == ["path", "p(dog)", "label"]
    assert rows == [f"data/test/{i}.jpg" for i in range(1, len(rows) + 1)] and len(rows) == 10
    assert sample[-2] == f"... {images - len(rows)} more rows"
    assert sample[-1].startswith(f"predicted {images} images (")


# How each training script parses its flags (its own parse_args call).
PARSING = {"train_single.py": {}, "train_dp.py": {}, "train_ddp.py": {"distributed": True},
           "train_fsdp.py": {"distributed": True}, "train_accelerate.py": {"amp": False, "distributed": True},
           "train_ray.py": {"distributed": True, "ray": True}}


def _sbatch_processes() -> int:
    """The training processes of docs/slurm/train.sbatch as submitted: its #SBATCH nodes times GPUs
    per node (its torchrun starts one process per GPU Slurm allocates)."""
    text = (ROOT / "docs" / "slurm" / "train.sbatch").read_text()
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", text, re.MULTILINE)
    gpus = re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.MULTILINE)
    assert nodes and gpus, "the script asks for its nodes and GPUs"
    return int(nodes.group(1)) * int(gpus.group(1))


def _launched(words: list[str]) -> tuple[str, object, int]:
    """A README command that trains (its words after any environment variables): its script, its
    parsed flags and its training processes, as the launcher says: torchrun's --nproc_per_node,
    accelerate's --num_processes, train_ray.py's --num-workers, sbatch's allocation; one for
    train_single.py and train_dp.py (DataParallel splits the batch of its one process)."""
    if words[0] == "sbatch":
        script, flags, processes = "train_ddp.py", words[2:], _sbatch_processes()
    else:
        at = next(i for i, word in enumerate(words) if word.endswith(".py"))
        script, flags, launcher = words[at], words[at + 1:], words[:at]
        given = {"torchrun": r"--nproc_per_node=(\d+)", "accelerate": r"--num_processes (\d+)", "python": r"$^"}
        count = re.search(given[launcher[0]], " ".join(launcher))
        processes = int(count.group(1)) if count else 1
    args = parse_args("", flags, script=script, **PARSING[script])
    if script == "train_ray.py":
        processes = args.num_workers
    return script, args, processes


def test_readmes_commands_keep_their_global_batch_and_learning_rate():
    """README's ladder says which global batch each command keeps (--batch-size x processes x
    --accumulate) so that every rung trains the same model with the same --lr: on photos/, one
    GPU, DataParallel, DDP, FSDP, accelerate and Ray Train on 4 GPUs, and the sbatch script's two
    nodes (its #SBATCH allocation) all make 200 at one --lr; the CPU commands on make demo's set
    50. A changed --batch-size, process count or allocation that breaks the arithmetic fails here.
    README stays a first page: at most 150 lines."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    ladders: dict[str, set] = {}
    scripts: dict[str, set] = {}
    for command in commands(ROOT):
        words = shlex.split(command.text, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]  # an environment variable before the command
        if command.page != "README.md" or not words or words[0] not in ("python", "torchrun", "accelerate", "sbatch"):
            continue  # not a training command: diff, make, a comment line
        if not any(word.startswith("train_") and word.endswith(".py") or word.endswith(".sbatch") for word in words):
            continue  # a tool: predict, the report
        script, args, processes = _launched(words)
        ladders.setdefault(args.data_dir, set()).add((args.batch_size * processes * args.accumulate, args.lr))
        scripts.setdefault(args.data_dir, set()).add(words[0] if words[0] == "sbatch" else script)
    assert ladders == {"photos": {(200, 0.001)}, "data/synthetic": {(50, 0.01)}}, ladders
    assert scripts["photos"] == set(PARSING) | {"sbatch"}, scripts
