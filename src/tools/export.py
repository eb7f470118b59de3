"""Export a trained checkpoint to ONNX, checked against onnxruntime before it is written.

    python -m src.tools.export [CHECKPOINT] [OUTPUT] [--images PATH...] [--check N]
    (defaults: model/best.pth model/best.onnx --images data --check 16)

The graph takes uint8 RGB images (batch, 3, S, S), resized to a square as training resizes them,
and returns the class probabilities (batch, classes); the normalisation is inside it, the batch
is dynamic, the opset is OPSET. Its metadata names the arch, image size, classes and the sha256 of
the best.pth it came from (src/tools/onnx_model.py). Before the file is put in place, onnxruntime runs
it on N real images (decoded as training decodes them) and each probability must be within the
float32 rounding bound of src/tools/rounding.py of torch's; otherwise nothing is written.
`python -m src.tools.predict --onnx OUTPUT PATH...` runs it without torch.
OUTPUT replaces an ONNX file of this tool's (its metadata says so), any other file with
--overwrite only, and never a training run's files (best.pth, last.pth, ...) nor a file in the
folder of a training run in progress (src.outputs.check_tool_output).
Needs `pip install -r requirements-onnx.txt` (onnx, onnxscript, onnx-ir, onnxruntime).
"""
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from src.cli import IMAGE_COUNTS, OneLineParser, between
from src.errors import UserError, exit_on_error
from src.image_files import find_images, try_decode
from src.inference import load_checkpoint, sha256_of
from src.outputs import cannot_write, check_tool_output, temp_prefix, temporaries
from src.terminal import shown
from src.tools.onnx_model import FORMAT, metadata, open_session
from src.tools.rounding import rounding_bound
from src.transforms import normalize

OPSET = 20  # torch 2.14's default; onnxruntime 1.32 runs opsets up to 23
CHECK_BATCH = 3  # onnxruntime runs the check in batches of 3: not the export's example batch of 2
INTERRUPTED = "interrupted: nothing written (an earlier OUTPUT is as it was); run the command again"


class Deployable(nn.Module):
    """uint8 images (N, 3, S, S) -> class probabilities (N, classes), float32: src.transforms.normalize,
    the model and a softmax, the same operations as predict runs in torch."""

    mean: torch.Tensor  # buffers (register_buffer): what nn.Module's __getattr__ hands back
    std: torch.Tensor

    def __init__(self, model: nn.Module, mean: list[float], std: list[float]):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model((images.float() / 255 - self.mean) / self.std).float().softmax(dim=1)


def check_images(paths: list[Path], size: int, count: int) -> tuple[list[Path], np.ndarray]:
    """Up to `count` decodable images spread over those under `paths`, decoded as training does."""
    files = find_images(paths)[0]
    step = max(1, len(files) // count)  # spread: a Kaggle folder starts with 12,500 cats
    chosen, images = [], []
    for file in files[::step]:
        image, _ = try_decode(file, size)
        if image is not None:
            chosen.append(file)
            images.append(image)
        if len(images) == count:
            break
    if not images:
        raise UserError(f"--images {' '.join(map(str, paths))}: none of the images can be decoded")
    return chosen, np.stack(images)


def export_program(wrapper: Deployable, example: torch.Tensor, info: dict):
    """torch.onnx.export with a dynamic batch (torch.export, the default exporter since torch 2.9)."""
    example = example if len(example) >= 2 else example.repeat(2, 1, 1, 1)  # a batch of 1 may be fixed
    program = torch.onnx.export(
        wrapper, (example[:2],), dynamo=True, opset_version=OPSET, verbose=False,
        input_names=["images"], output_names=["probabilities"],
        dynamic_shapes={"images": {0: torch.export.Dim("batch")}})
    if program is None:  # dynamo=True returns the program
        raise RuntimeError("torch.onnx.export returned no ONNXProgram")
    program.model.metadata_props.update(metadata(info))
    return program


def checked(path: Path, wrapper: Deployable, images: np.ndarray, files: list[Path], info: dict) -> str:
    """Run the ONNX file with onnxruntime on the images and compare with torch; the line that says
    how close they are, or a UserError if any probability is further than the rounding bound."""
    session, _ = open_session(path, threads=torch.get_num_threads())
    batch_axis = session.get_inputs()[0].shape[0]
    if not isinstance(batch_axis, str):  # a "dynamic" batch the exporter fixed after all
        raise UserError(f"the exported graph takes batches of {batch_axis} images only (torch "
                        f"{torch.__version__}): nothing written")
    p_onnx = np.concatenate([session.run(None, {"images": images[i:i + CHECK_BATCH]})[0]
                             for i in range(0, len(images), CHECK_BATCH)])
    x = normalize(torch.from_numpy(images), mean=info["mean"], std=info["std"])
    p_torch, bound = (t.numpy() for t in rounding_bound(wrapper.model, x))
    diff = np.abs(p_torch - p_onnx)
    ratio = diff / bound
    worst = np.unravel_index(ratio.argmax(), ratio.shape)
    if ratio[worst] > 1:
        raise UserError(f"onnxruntime's probabilities differ from torch's by {diff[worst]:.2e} on "
                        f"{files[worst[0]]}, more than the float32 rounding bound {bound[worst]:.2e}: "
                        "the export is wrong, nothing written")
    import onnxruntime
    return (f"checked with onnxruntime {onnxruntime.__version__} on {len(images)} images: "
            f"max |p_torch - p_onnx| = {diff.max():.2e}, within the float32 rounding bound "
            f"({bound.min():.1e} to {bound.max():.1e} per image; largest difference/bound {ratio[worst]:.2g})")


def put_in_place(folder: Path, output: Path) -> None:
    """Move the checked file (and the .data file of weights over 1.5 GB) from the temporary folder
    beside output into place, weights first, with the usual file mode (mkdtemp's is private)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in sorted(os.listdir(folder), key=lambda name: name == output.name):
        os.chmod(folder / name, 0o666 & ~umask)
        os.replace(folder / name, output.parent / name)


def opset_of(path: Path) -> int:
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    return {entry.domain or "ai.onnx": entry.version for entry in model.opset_import}["ai.onnx"]


def is_export(path: Path) -> bool:
    """Whether the file is an ONNX file this tool wrote (its metadata's format)."""
    import onnx
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX at all: protobuf's DecodeError, and others
        return False
    return any(entry.key == "format" and entry.value == FORMAT for entry in model.metadata_props)


def check_output(checkpoint: Path, output: Path, image_paths: list[Path], overwrite: bool = False) -> None:
    """Before the export: OUTPUT (and the .data file of large weights beside it) is a file this
    tool may write (src.outputs.check_tool_output: an export of its own or --overwrite, never a
    run's files), none of the files the export reads; the temporary folders of exports that were
    killed are removed."""
    inputs = [("CHECKPOINT", checkpoint), ("its best.json", checkpoint.with_suffix(".json")),
              *(("an image it checks on", file) for file in find_images(image_paths)[0])]
    check_tool_output("OUTPUT", output, is_export, "an ONNX file of src.tools.export", overwrite, inputs=inputs)
    data = Path(f"{output}.data")
    # The weights of an export of ours are ours; beside another file, or none, they may be anyone's.
    check_tool_output("OUTPUT's weights file", data, lambda _: output.exists() and is_export(output),
                      f"the weights of an export of ours ({output.name} is not one)", overwrite, inputs=inputs)
    for stale in temporaries(output):  # an export killed before its clean-up
        shutil.rmtree(stale, ignore_errors=True)


def export(checkpoint: Path, output: Path, image_paths: list[Path], count: int, overwrite: bool = False) -> None:
    start = time.time()
    model, info = load_checkpoint(checkpoint)
    if "sha256" not in info:  # a best.json written by hand
        info["sha256"] = sha256_of(checkpoint)
    files, images = check_images(image_paths, info["image_size"], count)
    check_output(checkpoint, output, image_paths, overwrite)
    wrapper = Deployable(model, info["mean"], info["std"]).eval()
    program = export_program(wrapper, torch.from_numpy(images), info)
    try:
        folder = Path(tempfile.mkdtemp(dir=output.parent, prefix=temp_prefix(output), suffix=".tmp"))
    except OSError as error:
        raise UserError(cannot_write(output, error)) from None
    try:
        program.save(str(folder / output.name))  # one file; a .data file beside it above 1.5 GB of weights
        line = checked(folder / output.name, wrapper, images, files, info)
        put_in_place(folder, output)
    except OSError as error:  # a full disk: the old file stays
        raise UserError(cannot_write(output, error)) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    size = info["image_size"]
    print(f"exported {shown(checkpoint)} ({info['arch']}, epoch {info.get('epoch')}) to {shown(output)}: "
          f"{output.stat().st_size / 1e6:.1f} MB, opset {opset_of(output)}, input images uint8 "
          f"[batch, 3, {size}, {size}], output probabilities float32 [batch, {len(info['classes'])}] "
          f"({', '.join(info['classes'])}), normalisation inside ({time.time() - start:.1f} s)")
    print(line)


@dataclasses.dataclass(kw_only=True)
class Options:
    """export's flags, as main parses them."""

    checkpoint: Path
    output: Path | None
    images: list[Path]
    check: int
    overwrite: bool


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, nargs="?", default=Path("model/best.pth"),
                        help="best.pth, with its best.json beside it")
    parser.add_argument("output", type=Path, nargs="?", default=None, help="default: CHECKPOINT with .onnx")
    parser.add_argument("--images", type=Path, nargs="+", default=[Path("data")],
                        help="image files or folders to check the export on")
    parser.add_argument("--check", type=between(*IMAGE_COUNTS), default=16, help="how many images to check it on")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an OUTPUT that this tool did not write (never a training run's files)")
    args = Options(**vars(parser.parse_args(argv)))
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise UserError(f"the export needs {error.name}: pip install -r requirements-onnx.txt") from None
    export(args.checkpoint, args.output or args.checkpoint.with_suffix(".onnx"), args.images, args.check,
           args.overwrite)


if __name__ == "__main__":
    exit_on_error(main, INTERRUPTED)
