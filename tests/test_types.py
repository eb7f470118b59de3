"""The run's configuration as a type (src/config.py's Config, which src.cli.parse_args returns) and
the type checker that reads it: `make lint`'s mypy fails on a misspelt flag, a wrong call in a
branch only a GPU reaches, and an import of a name that does not exist."""
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from src.checkpoint import RECIPE_FLAGS
from src.cli import build_parser, defaults, parse_args
from src.config import Config
from src.process_group import PER_NODE

ROOT = Path(__file__).resolve().parent.parent
DERIVED = {"command", "mode", "evaluate_file", "flags"}
SCRIPTS = {"train_single.py": {}, "train_dp.py": {}, "train_ddp.py": {"distributed": True},
           "train_fsdp.py": {"distributed": True}, "train_accelerate.py": {"amp": False, "distributed": True},
           "train_ray.py": {"distributed": True, "ray": True}}
# The flags some scripts have not: --amp (train_accelerate.py), --dist-timeout (the one-process
# scripts), train_ray.py's own.
NOT_EVERY_SCRIPTS = {"amp", "dist_timeout", "num_workers", "address", "storage_path", "max_failures"}


def _dests(**options) -> list[str]:
    return list(vars(build_parser("", **options).parse_args([])))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_of_every_script_is_a_field_in_the_parsers_order(script):
    """A flag added to build_parser without its field (or a field left after its flag went) fails
    here; so does one out of order (best.json's flags are listed as the parser lists them)."""
    fields = [field.name for field in dataclasses.fields(Config) if field.name not in DERIVED]
    dests = _dests(**SCRIPTS[script])
    assert [name for name in fields if name in dests] == dests
    assert set(fields) - set(dests) <= NOT_EVERY_SCRIPTS


def test_the_flags_read_by_name_are_fields():
    """best.json's recipe (RECIPE_FLAGS) and the flags each node may give its own value (PER_NODE)
    are read by name, which mypy cannot check: they must be fields."""
    names = {field.name for field in dataclasses.fields(Config)}
    assert set(RECIPE_FLAGS) <= names and set(PER_NODE) <= names


@pytest.mark.parametrize("script, argv", [(script, argv) for script in SCRIPTS
                                           for argv in ([], ["--evaluate", "--weights", "w.pth"])
                                           if not (argv and script == "train_ray.py")])  # it refuses --evaluate
def test_parse_args_records_the_flags_its_parser_has_as_the_namespace_did(script, argv):
    """as_dict(): the parser's flags (train_accelerate.py has no --amp, the one-process scripts no
    --dist-timeout), then command and mode, and evaluate_file with --evaluate alone."""
    argv = ["--arch", "squeezenet1_1", "--workers", "0", *argv]
    config = parse_args("", argv, script=script, **SCRIPTS[script])
    assert isinstance(config, Config)
    flags = config.as_dict()
    assert list(flags) == [*_dests(**SCRIPTS[script]), "command", "mode", *(["evaluate_file"] if argv[4:] else [])]
    assert (flags["command"], flags["mode"]) == ([script, *argv], script.removesuffix(".py").removeprefix("train_"))
    assert flags.get("evaluate_file") == ("w.pth" if argv[4:] else None)
    assert config.weights == ("none" if argv[4:] else "default")


def test_defaults_are_the_parsers_with_the_changes():
    config = defaults(batch_size=7, augment=True)
    assert (config.batch_size, config.augment, config.workers, config.lr) == (7, True, 0, 0.001)
    assert config.as_dict() == {**parse_args("", ["--batch-size", "7", "--augment", "--workers", "0"],
                                             script="train_single.py").as_dict(), "command": ["train_single.py"]}


def _insert(path: Path, after: str, line: str) -> int:
    """`line` into the file below the one line that ends with `after`; its line number."""
    lines = path.read_text().splitlines(keepends=True)
    (index,) = [i for i, text in enumerate(lines) if text.rstrip("\n").endswith(after)]
    lines.insert(index + 1, line + "\n")
    path.write_text("".join(lines))
    return index + 2


def _replace(path: Path, old: str, new: str) -> int:
    """The one line holding `old`, with `new` in its place; its line number."""
    lines = path.read_text().splitlines(keepends=True)
    (index,) = [i for i, text in enumerate(lines) if old in text]
    lines[index] = lines[index].replace(old, new)
    path.write_text("".join(lines))
    return index + 1


@pytest.mark.slow
def test_make_lints_type_checker_finds_a_misspelt_flag_a_wrong_call_in_a_cuda_branch_and_a_missing_import(tmp_path):
    """In a copy of the tree, one mypy run as `make lint` runs it (pyproject.toml's [tool.mypy]):
    a flag read misspelt in src/, a call with a wrong argument count in a branch that only a GPU
    takes, an import of a name that does not exist in checks/gpu_selftest.py: each reported at its
    file and line."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ["pyproject.toml", *(path.name for path in ROOT.glob("train_*.py"))]:
        shutil.copy2(ROOT / name, tree / name)
    for folder in ("src", "checks"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    misspelt = _replace(tree / "src/sharded_checkpoint.py", "return Path(args.checkpoint).parent / NAME",
                        "return Path(args.ema_decya).parent / NAME")
    cuda = _insert(tree / "src/process_group.py", '    if device.type == "cuda":', "        check_gpus()")
    missing = _insert(tree / "checks/gpu_selftest.py", "import torch", "from src.loaders import run_every_loader")
    found = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=tree,
                           capture_output=True, text=True, timeout=600)
    said = found.stdout.splitlines()
    assert found.returncode == 1, found.stdout + found.stderr
    assert f'src/sharded_checkpoint.py:{misspelt}: error: "Config" has no attribute "ema_decya"; maybe "ema_decay"?  ' \
           f'[attr-defined]' in said
    assert f'src/process_group.py:{cuda}: error: Missing positional argument "local_processes" in call to ' \
           f'"check_gpus"  [call-arg]' in said
    assert f'checks/gpu_selftest.py:{missing}: error: Module "src.loaders" has no attribute "run_every_loader"  ' \
           f'[attr-defined]' in said


# A forward hook, whose `args` are the module's inputs; the step hooks and __torch_dispatch__,
# whose (args, kwargs) are a call's, are told by their `kwargs`.
HOOKS = {("src/tools/rounding.py", "magnitude")}


def test_every_function_that_takes_the_flags_annotates_them():
    """A parameter without an annotation is Any to mypy, and nothing read from it is checked:
    every `args` of the scripts and the library is annotated (a Config, or a tool's Options)."""
    import ast
    bare = []
    for path in sorted([*ROOT.glob("train_*.py"), *(ROOT / "src").rglob("*.py")]):
        name = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (name, node.name) not in HOOKS:
                params = node.args.args + node.args.kwonlyargs
                if "kwargs" not in {arg.arg for arg in params}:
                    bare += [f"{name}:{node.lineno} {node.name}" for arg in params
                             if arg.arg == "args" and arg.annotation is None]
    assert bare == []
