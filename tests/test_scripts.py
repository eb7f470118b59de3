"""Each script teaches its mode: the mode's own torch or accelerate calls stand in its code (read
from the syntax tree, so a comment naming them does not count), written as their documentation
writes them, and none of the other modes' calls; the saving and stopping are in its loop; it is a
top-to-bottom recipe of at most 200 lines. (`diff train_single.py train_ddp.py` shows DDP: the
diffs may grow, as long as what they show is the mode, and each line there that calls what guards
the mode, not the mode itself, is marked `# guard:`.)"""
import ast
import difflib

import pytest
import torch.nn as nn
from conftest import ROOT

SCRIPTS = ["train_single.py", "train_dp.py", "train_ddp.py", "train_fsdp.py", "train_accelerate.py", "train_ray.py"]
MOST_LINES = 200

# The calls each mode is known by, as the script writes them (the callee's dotted name).
PROCESS_GROUP = {"dist.init_process_group", "DistributedSampler", "set_epoch", "dist.all_reduce",
                 "dist.destroy_process_group"}
OWN = {
    "train_single.py": {"RandomSampler"},
    "train_dp.py": {"RandomSampler", "AutocastDataParallel"},
    "train_ddp.py": PROCESS_GROUP | {"torch.cuda.set_device", "DDP", "model.no_sync"},
    "train_fsdp.py": PROCESS_GROUP | {"torch.cuda.set_device", "fully_shard", "init_device_mesh",
                                      "model.set_requires_gradient_sync", "get_model_state_dict", "StateDictOptions",
                                      "state.save_step", "state.save_epoch"},
    "train_accelerate.py": {"Accelerator", "accelerator.prepare", "accelerator.accumulate", "accelerator.backward",
                            "accelerator.clip_grad_norm_", "accelerator.reduce", "accelerator.gather_for_metrics",
                            "accelerator.get_state_dict", "accelerator.skip_first_batches", "accelerator.end_training",
                            "accelerator.init_trackers", "accelerator.get_tracker"},
    # Ray Train starts the workers and their process group; each runs DDP's loop.
    "train_ray.py": {"DistributedSampler", "set_epoch", "dist.all_reduce", "DDP", "model.no_sync", "ray.init",
                     "ray.train.torch.TorchTrainer", "ray.train.ScalingConfig", "ray.train.RunConfig",
                     "ray.train.FailureConfig", "ray.train.torch.TorchConfig", "trainer.fit", "ray.train.get_context",
                     "ray.train.get_checkpoint", "checkpoint.as_directory", "ray.train.report",
                     "ray.train.Checkpoint.from_directory"},
}
# Calls that belong to one mode alone (DDP's to the two scripts that run its loop): no other script may make them.
DDP_LOOP = "train_ddp.py train_ray.py"
MODE_ONLY = {
    "AutocastDataParallel": "train_dp.py", "DDP": DDP_LOOP, "model.no_sync": DDP_LOOP,
    "fully_shard": "train_fsdp.py", "get_model_state_dict": "train_fsdp.py",
    "model.set_requires_gradient_sync": "train_fsdp.py", "Accelerator": "train_accelerate.py",
    "accelerator.prepare": "train_accelerate.py", "accelerator.gather_for_metrics": "train_accelerate.py",
    "accelerator.init_trackers": "train_accelerate.py", "dist.init_process_group": "train_ddp.py train_fsdp.py",
    "ray.init": "train_ray.py", "ray.train.torch.TorchTrainer": "train_ray.py", "ray.train.report": "train_ray.py",
}
# What guards a mode, in src/ (the restart attempt's store, the same flags on every rank, the heartbeat,
# unpadded validation shards, the launch checks): not the mode's own calls, marked where a script makes them.
GUARDS = ("process_device", "torchrun_store", "check_same_flags", "watch_ranks", "ShardSampler",
          "check_data_parallel", "check_launch", "check_accelerator")
# The training state's verbs, which every script calls where the reader sees them (src/state.py).
STATE_VERBS = {"state.resume", "state.epoch_sums", "state.stop_agreed", "state.checkpoint_due", "state.save_step",
               "state.stop", "state.record", "state.save_epoch", "state.stop_signals", "state.track"}


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name or an Attribute chain of Names, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def calls(script: str) -> dict[str, list[ast.Call]]:
    """Every call in a script's code, by the callee's dotted name (and by its last name alone)."""
    found: dict[str, list[ast.Call]] = {}
    for node in ast.walk(ast.parse((ROOT / script).read_text())):
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name:
                found.setdefault(name, []).append(node)
                if "." in name:
                    found.setdefault(name.rsplit(".", 1)[-1], []).append(node)
    return found


def keywords(call: ast.Call) -> dict[str, str]:
    return {keyword.arg: ast.unparse(keyword.value) for keyword in call.keywords}


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_calls_its_modes_api_and_no_other_modes(script):
    made = calls(script)
    missing = sorted(name for name in OWN[script] if name not in made)
    assert not missing, f"{script} does not call {missing}"
    foreign = sorted(name for name, owners in MODE_ONLY.items() if script not in owners.split() and name in made)
    assert not foreign, f"{script} calls {foreign}, another mode's"


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp.py", "train_ray.py"])
def test_the_distributed_sampler_is_written_as_torch_documents_it(script):
    """DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
    drop_last=True), and set_epoch(epoch) on it in the epoch loop; the process group and its end
    (torchrun's scripts: Ray Train makes and ends train_ray.py's)."""
    made = calls(script)
    (sampler,) = made["DistributedSampler"]
    assert keywords(sampler) == {"num_replicas": "world_size", "rank": "rank", "shuffle": "True",
                                 "seed": "args.seed", "drop_last": "True"}
    assert [ast.unparse(call.args[0]) for call in made["set_epoch"]] == ["epoch", "epoch"]  # sampler and split
    if script == "train_ray.py":
        assert len(made["dist.all_reduce"]) == 2 and "dist.destroy_process_group" not in made
        return
    (init,) = made["dist.init_process_group"]
    assert {"store", "rank", "world_size", "timeout"} <= keywords(init).keys()
    assert len(made["dist.destroy_process_group"]) == 1 and len(made["dist.all_reduce"]) == 2


def test_fsdp_shards_each_unit_and_the_root_and_gathers_best_pth_with_torchs_call():
    made = calls("train_fsdp.py")
    assert sorted(ast.unparse(call.args[0]) for call in made["fully_shard"]) == ["model", "unit"]
    (gather,) = made["get_model_state_dict"]
    assert ast.unparse(gather) == ("get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
                                   "cpu_offload=True))")


def test_fsdp_writes_last_with_torchs_distributed_checkpoint():
    """Each rank writes its own shards of `last` with torch.distributed.checkpoint: dcp.async_save
    at a step checkpoint (training goes on while it is written), dcp.save at an epoch's end; the
    training state's verbs take them, and no other script names DCP."""
    made = calls("train_fsdp.py")
    (step,) = made["state.save_step"]
    assert keywords(step) == {"write": "dcp.async_save"}
    (epoch,) = made["state.save_epoch"]
    assert keywords(epoch) == {"write": "dcp.save"}
    imports = [node for node in ast.walk(ast.parse((ROOT / "train_fsdp.py").read_text())) if isinstance(node, ast.Import)]
    assert any(alias.name == "torch.distributed.checkpoint" and alias.asname == "dcp"
               for node in imports for alias in node.names)
    for script in SCRIPTS:
        if script != "train_fsdp.py":
            assert "dcp" not in {name.split(".")[0] for name in calls(script)}, script
            assert "write" not in {key for call in calls(script).get("state.save_step", []) for key in keywords(call)}


def test_data_parallel_is_torchs_data_parallel():
    from src.data_parallel import AutocastDataParallel
    assert issubclass(AutocastDataParallel, nn.DataParallel)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_saves_and_stops_in_its_own_loop(script):
    """The training state's verbs are the script's calls: after an optimizer step (save_step, stop),
    after validation (save_epoch); the progress bar only shows (src/progress.py calls none of them)."""
    made = calls(script)
    missing = sorted(verb for verb in STATE_VERBS if verb not in made)
    assert not missing, f"{script} does not call {missing}"
    progress = calls("src/progress.py")
    assert not [name for name in progress for verb in STATE_VERBS if name.endswith(verb)]


def test_ray_trains_as_ray_documents_it():
    """The driver: ray.init(address=...), TorchTrainer(train_loop_per_worker, scaling_config=
    ScalingConfig(num_workers=N, use_gpu=...), run_config=RunConfig(storage_path=...,
    failure_config=FailureConfig(max_failures=...))), trainer.fit(); the workers: the rank from
    ray.train.get_context(), ray.train.get_checkpoint() read through checkpoint.as_directory() before
    the resume, ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder)) right after
    each of the state's saves, a step's and an epoch's."""
    made = calls("train_ray.py")
    (trainer,) = made["ray.train.torch.TorchTrainer"]
    assert ast.unparse(trainer.args[0]) == "train_loop_per_worker"
    assert keywords(made["ray.train.ScalingConfig"][0]) == {"num_workers": "args.num_workers", "use_gpu": "use_gpu"}
    assert keywords(made["ray.train.FailureConfig"][0]) == {"max_failures": "args.max_failures"}
    assert {"storage_path", "failure_config"} <= keywords(made["ray.train.RunConfig"][0]).keys()
    assert ast.unparse(made["ray.init"][0]) == "ray.init(address=reachable(args.address))"
    assert [ast.unparse(call) for call in made["trainer.fit"]] == ["trainer.fit()"]
    assert {ast.unparse(call.func) for call in made["get_world_rank"]} == {"context.get_world_rank"}
    reports = made["ray.train.report"]
    assert len(reports) == 2
    assert {keywords(call)["checkpoint"] for call in reports} == {"ray.train.Checkpoint.from_directory(folder) if folder else None"}
    saves = sorted(call.lineno for name in ("state.save_step", "state.save_epoch") for call in made[name])
    assert [report.lineno - save for report, save in zip(sorted(reports, key=lambda call: call.lineno), saves)] == [2, 2]
    (restore,) = made["checkpoint.as_directory"]
    (resume,) = made["state.resume"]
    assert restore.lineno < resume.lineno


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_tracks_its_run_from_rank_0_after_the_outputs_are_checked(script):
    """--track: the tracker made in main() right after lock_outputs (rank_0_tracker, whose block
    ends the tracked runs), handed to train(), which starts it after the resume (state.track);
    train_accelerate.py through accelerate's trackers: Accelerator(log_with=...), then
    init_trackers with the tracker's init_kwargs for last.pth's runs, before state.track."""
    tree = ast.parse((ROOT / script).read_text())
    runs = "train_loop_per_worker" if script == "train_ray.py" else "main"  # Ray's workers, not its driver
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == runs)
    (block,) = [node for node in ast.walk(main) if isinstance(node, ast.With)
                and any(ast.unparse(item.context_expr) == "rank_0_tracker(args)" for item in node.items)]
    assert [ast.unparse(item.context_expr).split("(")[0] for item in block.items][-2:] == ["lock_outputs", "rank_0_tracker"]
    assert "tracker" in [ast.unparse(arg) for call in calls(script)["train"] for arg in call.args]
    made = calls(script)
    (track,) = made["state.track"]
    if script != "train_accelerate.py":
        assert ast.unparse(track) == "state.track(tracker)"
        return
    assert ast.unparse(track) == "state.track(tracker, accelerator)"
    (init,) = made["accelerator.init_trackers"]
    assert keywords(init) == {"init_kwargs": "tracker.init_kwargs(state.tracked_ids, info)"}
    assert init.lineno < track.lineno


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_is_a_short_recipe(script):
    """At most MOST_LINES lines; the functions a reader meets in order: its loaders, one epoch's
    training, validation, the run, main."""
    text = (ROOT / script).read_text()
    assert len(text.splitlines()) <= MOST_LINES, f"{script}: {len(text.splitlines())} lines"
    functions = [node.name for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)]
    worker = ["train_loop_per_worker"] if script == "train_ray.py" else []  # what a Ray Train worker runs
    assert functions == ["loaders", "train_epoch", "evaluate", "train", *worker, "main"], functions


def unmarked_guards(script: str, against: str = "train_single.py") -> list[str]:
    """The statements of `script` that call a guard and that `diff against script` shows (a line of
    theirs among the script's added or changed ones), without a `# guard:` comment on one of their
    lines or opening the comment lines right above them."""
    text = (ROOT / script).read_text()
    lines, theirs = text.splitlines(), (ROOT / against).read_text().splitlines()
    added = {i for tag, _, _, start, end in difflib.SequenceMatcher(None, theirs, lines, autojunk=False).get_opcodes()
             if tag in ("replace", "insert") for i in range(start, end)}
    tree = ast.parse(text)

    def guarded(node: ast.AST) -> bool:
        return any(isinstance(call, ast.Call) and (dotted(call.func) or "").split(".")[-1] in GUARDS
                   for call in ast.walk(node))
    # Simple statements (a compound one's body is other statements), and the items of a `with`.
    spans = [node for node in ast.walk(tree) if isinstance(node, ast.stmt) and not hasattr(node, "body") and guarded(node)]
    spans += [item.context_expr for node in ast.walk(tree) if isinstance(node, ast.With) for item in node.items
              if guarded(item.context_expr)]
    statements = {(node.lineno - 1, node.end_lineno or node.lineno) for node in spans}

    def comment_above(first: int) -> str:
        top = first
        while top and lines[top - 1].strip().startswith("#"):
            top -= 1
        return lines[top].strip() if top < first else ""

    return [lines[first].strip() for first, end in sorted(statements) if added & set(range(first, end))
            and not any("# guard:" in line for line in lines[first:end]) and not comment_above(first).startswith("# guard:")]


@pytest.mark.parametrize("script, against", [("train_dp.py", "train_single.py"), ("train_ddp.py", "train_single.py"),
                                             ("train_fsdp.py", "train_single.py"), ("train_fsdp.py", "train_ddp.py"),
                                             ("train_accelerate.py", "train_single.py"), ("train_ray.py", "train_ddp.py"),
                                             ("train_ray.py", "train_single.py")])
def test_every_guard_in_a_diff_is_marked_as_one(script, against):
    """`diff train_single.py train_ddp.py` showed the restart attempt's store, the flag check, the
    heartbeat and the validation shards among DDP's calls, nothing telling them apart: each call of
    a guard the diff shows is marked `# guard:` where it stands, and README says what the mark means."""
    found = calls(script)
    assert any(guard in found for guard in GUARDS), "the script calls a guard"
    assert unmarked_guards(script, against) == []
    assert "`# guard:`" in (ROOT / "README.md").read_text()


def test_the_modes_page_names_each_modes_calls():
    """docs/modes.md's "What each script calls" table names the calls the scripts make."""
    page = (ROOT / "docs" / "modes.md").read_text()
    table = page[page.index("## What each script calls"):page.index("## The same batches")]
    for name in ["init_process_group", "set_device", "DistributedSampler", "set_epoch", "DDP(", "no_sync", "all_reduce",
                 "destroy_process_group", "fully_shard", "get_model_state_dict", "set_requires_gradient_sync",
                 "Accelerator(", "prepare", "accumulate", "backward", "gather_for_metrics", "get_state_dict",
                 "skip_first_batches", "RandomSampler", "DataParallel", "save_step", "save_epoch", "stop_agreed",
                 "init_trackers", "state.track", "ray.init", "TorchTrainer", "ScalingConfig", "FailureConfig",
                 "get_checkpoint", "ray.train.report", "Checkpoint.from_directory"]:
        assert name in table, name
