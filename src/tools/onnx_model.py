"""The ONNX file that `python -m src.tools.export` writes, and opening it with onnxruntime alone
(no torch): its contract, the metadata that names the best.pth it came from, and the checks that
refuse another model's file.

The contract (FORMAT): input `images`, uint8 (batch, 3, S, S), RGB 0-255, each image resized to a
square as training resizes it (src.image_files.decode); output `probabilities`, float32
(batch, classes), softmax. The normalisation (ImageNet mean and std) is inside the graph.
"""
import json
import os
from pathlib import Path

from src.errors import UserError
from src.outputs import input_problem

FORMAT = "dogscats-onnx/1"  # bump when the input or output above changes


def metadata(info: dict) -> dict[str, str]:
    """The metadata_props of an export of the best.pth that `info` (its best.json) describes."""
    return {"format": FORMAT, "arch": info["arch"], "image_size": str(info["image_size"]),
            "classes": json.dumps(info["classes"]), "mean": json.dumps(info["mean"]),
            "std": json.dumps(info["std"]), "best_pth_sha256": info["sha256"],
            "best_json": json.dumps(info, sort_keys=True),
            "input": "images: uint8 (batch, 3, image_size, image_size), RGB 0-255, resized to a square",
            "output": "probabilities: float32 (batch, len(classes)), softmax; the normalisation is in the graph"}


def open_session(path: Path, best_json: Path | None = None, threads: int | None = None):
    """An onnxruntime session of an ONNX file from src.tools.export and its metadata; with
    best_json, the file must come from the best.pth that best_json describes. Anything else is a
    UserError naming the file."""
    import onnxruntime as ort
    problem = input_problem(path)
    if problem is not None:
        raise UserError(f"--onnx {path}: {problem}; write it with `python -m src.tools.export`")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    options.log_severity_level = 3  # errors only: they become our one line
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # InvalidProtobuf, InvalidGraph, a missing .onnx.data file, ...
        raise UserError(f"--onnx {path} is not an ONNX model that onnxruntime can load "
                        f"({str(error).strip().splitlines()[0][:200]})") from None
    meta = session.get_modelmeta().custom_metadata_map
    if meta.get("format") != FORMAT:
        raise UserError(f"--onnx {path} was not written by src.tools.export (no '{FORMAT}' metadata): "
                        "export best.pth with `python -m src.tools.export`")
    size, classes = int(meta["image_size"]), json.loads(meta["classes"])
    (images,), (probabilities,) = session.get_inputs(), session.get_outputs()
    if (images.type != "tensor(uint8)" or list(images.shape[1:]) != [3, size, size]
            or probabilities.shape[1:] != [len(classes)]):
        raise UserError(f"--onnx {path}: its graph ({images.type} {images.shape} -> {probabilities.shape}) "
                        f"does not match its metadata (uint8 [batch, 3, {size}, {size}] -> "
                        f"{len(classes)} classes); export it again")
    if best_json is not None:
        check_same_model(path, meta, best_json)
    return session, meta


def check_same_model(path: Path, meta: dict[str, str], best_json: Path) -> None:
    """Refuse an ONNX file exported from another best.pth than best_json describes."""
    try:
        info = json.loads(Path(best_json).read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {best_json} ({error}) to check --onnx {path} against it") from None
    exported = json.loads(meta["best_json"])
    if info.get("sha256") != meta["best_pth_sha256"]:
        raise UserError(f"--onnx {path} was exported from another best.pth ({exported['arch']}, "
                        f"sha256 {meta['best_pth_sha256'][:12]}) than {best_json} describes "
                        f"({info.get('arch')}, sha256 {str(info.get('sha256'))[:12]}): export that "
                        "one again, or pass the --checkpoint it came from")
