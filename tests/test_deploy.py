"""The Kubernetes manifests in deploy/ (docs/multi-node.md): valid YAML of the kinds their
operators take, each running a command that docs/modes.md's table of the six scripts and
docs/multi-node.md document, with flags its script takes, and asking for the GPUs its workers use:
one per Ray Train worker, one per torchrun process."""
import shlex

import yaml
from conftest import ROOT

from src.cli import build_parser

MODES = (ROOT / "docs" / "modes.md").read_text()
MULTI_NODE = (ROOT / "docs" / "multi-node.md").read_text()


def modes_row(script: str) -> str:
    """The row for `script` of docs/modes.md's table of the six scripts."""
    table = MODES[MODES.index("## The six scripts"):MODES.index("## What each script calls")]
    (row,) = [line for line in table.splitlines() if line.startswith("|") and f" {script}" in line]
    return row


def check_command(words: list[str], launcher: str) -> list[str]:
    """`words` start with `launcher` and a training script whose row names that launcher;
    docs/multi-node.md shows the command whole; the script's parser takes its flags. Returns them."""
    assert words[0] == launcher, words
    script, flags = words[1], words[2:]
    assert f"`{launcher} " in modes_row(script) and script in modes_row(script), (script, modes_row(script))
    assert shlex.join(words) in MULTI_NODE, shlex.join(words)
    build_parser("", distributed=True, ray=script == "train_ray.py").parse_args(flags)
    return flags


def test_the_rayjob_runs_train_ray_with_a_gpu_per_worker():
    (job,) = list(yaml.safe_load_all((ROOT / "deploy" / "kuberay" / "rayjob.yaml").read_text()))
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    flags = check_command(shlex.split(job["spec"]["entrypoint"]), "python")
    args = build_parser("", distributed=True, ray=True).parse_args(flags)
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.60.0" == (ROOT / "requirements-ray.txt").read_text().split("ray[train]==")[1].strip()
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no training worker on the head
    assert all("nvidia.com/gpu" not in container["resources"]["limits"] for container in head["template"]["spec"]["containers"])
    (workers,) = cluster["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == args.num_workers
    mounted = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert {"/data", "/runs"} <= mounted and args.storage_path.startswith("/runs/") and args.checkpoint.startswith("/runs/")


def test_the_trainjobs_run_train_ddp_and_train_fsdp_with_torchrun_a_gpu_per_process():
    jobs = list(yaml.safe_load_all((ROOT / "deploy" / "kubeflow" / "trainjob.yaml").read_text()))
    assert [job["kind"] for job in jobs] == ["TrainJob", "TrainJob"]
    scripts = []
    for job in jobs:
        assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
        assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
        trainer = job["spec"]["trainer"]
        check_command(trainer["command"], "torchrun")
        scripts.append(trainer["command"][1])
        assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == str(trainer["numProcPerNode"])
        assert trainer["numNodes"] >= 2
    assert scripts == ["train_ddp.py", "train_fsdp.py"]
