"""--evaluate: validate a checkpoint once on this run's validation split, in any mode, and print
its record; nothing trains and nothing is written. best.pth is checked against its best.json (the
model and split it was trained on), --weights FILE is any state_dict of --arch. The scripts
return before their epoch loop once it is done.
"""
import json
from pathlib import Path

import torch

from src.checkpoint import flag_of
from src.errors import UserError
from src.history import evaluation_record, format_evaluation
from src.inference import load_state, read_info
from src.models import read_state_dict
from src.ranks import from_rank_0, is_first


def load_evaluated(args, info: dict, model: torch.nn.Module) -> str:
    """--evaluate: load the file to validate (args.evaluate_file, see src.cli) into `model`;
    returns how the record names it.

    --checkpoint (best.pth) must be the file its best.json describes, and best.json must describe
    this run's model and validation split (--arch, --image-size, --seed, --val-fraction and the
    images of --data-dir); --weights FILE is any 2-class state_dict of --arch, or a last.pth.
    Rank 0 reads and checks the file and sends it to every rank: on nodes without a shared disk
    only rank 0's node has it.
    """
    path = Path(args.evaluate_file)

    def read() -> tuple[dict, str]:
        if path != Path(args.checkpoint):
            return read_state_dict(path), str(path)
        saved = read_info(path)
        for key in ("arch", "num_classes", "image_size", "seed", "val_fraction", "data"):
            if saved.get(key) != info[key]:
                raise UserError(f"{path.with_suffix('.json')} says {path} was trained with {flag_of(key)} "
                                f"{saved.get(key)}, not {info[key]}: pass the flags it was trained "
                                f"with to validate it on its split, or --weights {path} to validate "
                                "it on this one")
        return read_state_dict(path, "--checkpoint"), f"{path} (epoch {saved.get('epoch')})"

    state, named = from_rank_0(read)
    load_state(model, state, path,
               f"a {info['num_classes']}-class {info['arch']} state_dict (--arch {info['arch']})")
    return named


def show_evaluation(named: str, val_sums: torch.Tensor, seconds: float) -> None:
    """Print --evaluate's result on rank 0: a line as an epoch's, then the record as JSON."""
    if is_first():
        record = evaluation_record(val_sums, seconds)
        print(format_evaluation(named, record))
        print(json.dumps(record))
