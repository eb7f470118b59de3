"""What the test suite's files cost, from the log that `TEST_COST_LOG=path` makes pytest write
(tests/conftest.py: one JSON line per test):

    TEST_COST_LOG=/tmp/cost.jsonl .venv/bin/python -m pytest -q -n 2 tests
    .venv/bin/python checks/suite_cost.py /tmp/cost.jsonl                 # per file, longest first
    .venv/bin/python checks/suite_cost.py /tmp/before.jsonl /tmp/after.jsonl   # two logs side by side

Per file: its tests, their summed seconds, the CPU seconds (user + system) of the test process and
of the processes its tests waited for, and the processes they started by kind (torchrun, accelerate
launch, a script or tool run alone, a spawned rank, a loader workers' fork server). CPU seconds
compare on a busy machine, where seconds do not.
"""
import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

LAUNCHERS = ("torchrun", "accelerate launch")


def per_file(log: Path) -> dict[str, dict]:
    """{file: {"tests", "seconds", "cpu", "started": Counter}} summed over the log's tests; a test
    logged twice (a rerun into the same log) counts once, its last record."""
    records = {}
    for line in log.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[record["test"]] = record
    files: dict[str, dict] = {}
    for record in records.values():
        name = record["test"].split("::")[0].rsplit("/", 1)[-1]
        file = files.setdefault(name, {"tests": 0, "seconds": 0.0, "cpu": 0.0, "started": collections.Counter()})
        file["tests"] += 1
        file["seconds"] += record["seconds"]
        file["cpu"] += record["cpu"] + record["children_cpu"]
        file["started"].update(record["started"])
    return files


def launches(started: collections.Counter) -> tuple[int, int]:
    """(launcher runs, other processes started), a loader workers' fork server not counted."""
    ours = sum(n for kind, n in started.items() if kind in LAUNCHERS)
    others = sum(n for kind, n in started.items() if kind not in LAUNCHERS and kind not in ("fork server",
                                                                                              "resource tracker"))
    return ours, others


def table(files: dict[str, dict]) -> list[str]:
    rows = ["| file | tests | seconds | CPU s | launcher runs | other processes |", "|---|---|---|---|---|---|"]
    total: dict[str, Any] = {"tests": 0, "seconds": 0.0, "cpu": 0.0, "started": collections.Counter()}
    for name, file in sorted(files.items(), key=lambda item: -item[1]["cpu"]):
        rows.append(f"| {name} | {file['tests']} | {file['seconds']:.0f} | {file['cpu']:.0f} | "
                    + " | ".join(map(str, launches(file["started"]))) + " |")
        for key in ("tests", "seconds", "cpu"):
            total[key] += file[key]
        total["started"].update(file["started"])
    rows.append(f"| all | {total['tests']} | {total['seconds']:.0f} | {total['cpu']:.0f} | "
                + " | ".join(map(str, launches(total["started"]))) + " |")
    kinds = ", ".join(f"{n} {kind}" for kind, n in total["started"].most_common())
    return [*rows, "", f"started: {kinds or 'nothing'}"]


def compared(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    rows = ["| file | tests | CPU s | launcher runs | other processes |", "|---|---|---|---|---|"]
    empty = {"tests": 0, "seconds": 0.0, "cpu": 0.0, "started": collections.Counter()}
    sums: list[list[float]] = [[0, 0], [0.0, 0.0], [0, 0], [0, 0]]
    for name in sorted(set(before) | set(after), key=lambda n: -before.get(n, empty)["cpu"]):
        a, b = before.get(name, empty), after.get(name, empty)
        la, lb = launches(a["started"]), launches(b["started"])
        rows.append(f"| {name} | {a['tests']} → {b['tests']} | {a['cpu']:.0f} → {b['cpu']:.0f} | {la[0]} → {lb[0]} | "
                    f"{la[1]} → {lb[1]} |")
        for i, pair in enumerate(((a["tests"], b["tests"]), (a["cpu"], b["cpu"]), (la[0], lb[0]), (la[1], lb[1]))):
            sums[i][0] += pair[0]
            sums[i][1] += pair[1]
    rows.append(f"| all | {sums[0][0]} → {sums[0][1]} | {sums[1][0]:.0f} → {sums[1][1]:.0f} | {sums[2][0]} → "
                f"{sums[2][1]} | {sums[3][0]} → {sums[3][1]} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="one log (per file), or two (before, after)")
    args = parser.parse_args(argv)
    if len(args.logs) > 2:
        parser.error("one log, or two to compare")
    for log in args.logs:
        if not log.is_file():
            print(f"error: no log at {log}: run pytest with TEST_COST_LOG={log} first", file=sys.stderr)
            return 2
    files = [per_file(log) for log in args.logs]
    print("\n".join(table(files[0]) if len(files) == 1 else compared(*files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
