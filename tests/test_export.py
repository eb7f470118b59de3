"""python -m src.tools.export: best.pth -> ONNX (uint8 images in, probabilities out, dynamic batch,
the normalisation inside), checked against onnxruntime at export time; onnxruntime's
probabilities on real decoded images match torch's within the float32 bound of src/tools/rounding.py;
`predict --onnx` runs it without torch; an ONNX file of another model is refused."""
import json
import math
import os
import shutil
import stat
import sys

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from conftest import (
    FORMATTED,
    MIXED_IMAGES,
    fails_in_process,
    in_process,
    mode_run,
    printed_by,
    python,
    read_predictions,
    validation_pass,
)

from src.datasets import open_rgb
from src.inference import load_checkpoint
from src.tools import export, predict
from src.tools.onnx_model import FORMAT
from src.tools.rounding import depth_sum, rounding_bound
from src.transforms import image_transform, normalize


@pytest.fixture(scope="module")
def exported(checkpoint, exact_data, module_tmp):
    """The shared one-device run's best.pth exported in this process, checked on 8 training images;
    (the .onnx file, what the export printed)."""
    out = module_tmp / "model.onnx"
    printed = printed_by(export.main, [str(checkpoint), str(out), "--images", str(exact_data / "train"),
                                       "--check", "8"])
    return out, printed


def test_the_export_states_its_contract_and_its_check(exported, checkpoint):
    path, printed = exported
    exported_line, checked_line = printed.strip().splitlines()
    assert f"to {path}: " in exported_line and "opset 20" in exported_line
    assert "input images uint8 [batch, 3, 64, 64], output probabilities float32 [batch, 2] (cat, dog)" in exported_line
    assert checked_line.startswith(f"checked with onnxruntime {onnxruntime.__version__} on 8 images: max |p_torch - p_onnx| = ")
    model = onnx.load(str(path), load_external_data=False)
    assert {o.domain or "ai.onnx": o.version for o in model.opset_import}["ai.onnx"] == export.OPSET == 20
    (images,), (probabilities,) = model.graph.input, model.graph.output

    def dims(value):
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    assert (images.name, images.type.tensor_type.elem_type, dims(images)) == ("images", onnx.TensorProto.UINT8,
                                                                             ["batch", 3, 64, 64])
    assert (probabilities.name, dims(probabilities)) == ("probabilities", ["batch", 2])
    meta = {p.key: p.value for p in model.metadata_props}
    info = json.loads(checkpoint.with_suffix(".json").read_text())
    assert meta["format"] == FORMAT and meta["best_pth_sha256"] == info["sha256"]
    assert (meta["arch"], meta["image_size"], json.loads(meta["classes"])) == ("squeezenet1_1", "64", ["cat", "dog"])
    assert json.loads(meta["best_json"]) == info
    assert sorted(p.name for p in path.parent.glob("*model.onnx*")) == ["model.onnx"], "one file, no temporary left"


def test_onnxruntime_matches_torch_on_real_images_within_the_bound(exported, checkpoint, exact_data):
    """Test images the export did not check on, decoded as training decodes them; onnxruntime in
    batches of 1 and of 7 (the export's example batch was 2) against the checkpoint in torch."""
    model, info = load_checkpoint(checkpoint)
    images = torch.stack([image_transform(64)(open_rgb(exact_data / "test" / f"{i}.jpg", draft_size=64))
                          for i in range(1, 15)])
    x = normalize(images)
    p_torch, bound = rounding_bound(model, x)
    session = onnxruntime.InferenceSession(str(exported[0]), providers=["CPUExecutionProvider"])
    for batch in (1, 7):
        p_onnx = np.concatenate([session.run(None, {"images": chunk.numpy()})[0] for chunk in images.split(batch)])
        assert np.all(np.abs(p_onnx - p_torch.numpy()) <= bound.numpy()), (batch, np.abs(p_onnx - p_torch.numpy()).max())
    # The bound is tight enough to see a graph without the normalisation, or a head off by 1 %.
    with torch.no_grad():
        unnormalised = model(images.float() / 255).softmax(dim=1)
        model.classifier[1].weight *= 1.01
        off = model(x).softmax(dim=1)
    for wrong in (unnormalised, off):
        assert np.any(np.abs(wrong.numpy() - p_torch.numpy()) > bound.numpy())


def test_a_wrong_export_is_refused_and_nothing_written(exported, checkpoint, exact_data, tmp_path, monkeypatch,
                                                       capsys):
    """The export of a model whose torch side is 1 % off (its head scaled after the ONNX file was
    made, here: the fixture's file stands in for the exporter's output): one line, exit 2, no
    file and no temporary one left."""
    load = export.load_checkpoint

    def off(path):
        model, info = load(path)
        with torch.no_grad():
            model.classifier[1].weight *= 1.01
        return model, info

    class Program:  # what torch.onnx.export returns: save() writes the file
        def save(self, path):
            shutil.copy(exported[0], path)
    monkeypatch.setattr(export, "load_checkpoint", off)
    monkeypatch.setattr(export, "export_program", lambda *args: Program())
    line = fails_in_process(export.main, [str(checkpoint), str(tmp_path / "m.onnx"), "--images",
                                          str(exact_data / "train"), "--check", "8"], monkeypatch, capsys,
                            "onnxruntime's probabilities differ from torch's by")
    assert "more than the float32 rounding bound" in line and "nothing written" in line
    assert list(tmp_path.iterdir()) == []


def test_predict_onnx_runs_without_torch_and_gives_torchs_p_dog(exported, mixed, checkpoint, tmp_path):
    """predict --onnx in a Python where `import torch` fails, on the mixed folder of
    test_predict: the rows of the torch predict, each p(dog) within the bound of the validation
    pass's."""
    out = tmp_path / "onnx.csv"
    code = ("import runpy, sys; sys.modules['torch'] = None; "
            f"sys.argv = ['predict', '--onnx', {str(exported[0])!r}, {str(mixed)!r}, '--output', {str(out)!r}]; "
            "runpy.run_module('src.tools.predict', run_name='__main__')")
    result = python("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"predicted {len(MIXED_IMAGES)} images" in result.stdout and result.stdout.count("left out /") == 2
    rows = read_predictions(out)
    assert list(rows["path"]) == [str(mixed / name) for name in MIXED_IMAGES]
    p, bound = validation_pass(checkpoint, [mixed / name for name in MIXED_IMAGES])
    assert np.all(np.abs(rows["p_dog"].to_numpy() - p) <= bound + FORMATTED)
    assert list(rows["label"]) == ["dog" if q > 0.5 else "cat" for q in p]


def test_predict_onnx_tta_averages_the_mirror_images(exported, mixed, checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "tta.csv"
    code, _, err = in_process(predict.main, ["--onnx", str(exported[0]), str(mixed), "--output", str(out), "--tta"],
                              monkeypatch, capsys)
    assert code == 0, err
    files = [mixed / name for name in MIXED_IMAGES]
    (p, bound), (mirrored, mirrored_bound) = validation_pass(checkpoint, files), validation_pass(checkpoint, files, True)
    tta = read_predictions(out)["p_dog"].to_numpy()
    assert np.all(np.abs(tta - (p + mirrored) / 2) <= (bound + mirrored_bound) / 2 + FORMATTED)


def test_predict_onnx_in_several_batches_predicts_every_image(exported, mixed, checkpoint, tmp_path, monkeypatch,
                                                              capsys):
    """--batch-size 4 over the mixed folder's 15 files: four batches, each decoded while the one
    before runs; every image's row, the last batch's too, with torch's p(dog) within the bound."""
    out = tmp_path / "batches.csv"
    code, _, err = in_process(predict.main, ["--onnx", str(exported[0]), str(mixed), "--output", str(out),
                                             "--batch-size", "4"], monkeypatch, capsys)
    assert code == 0, err
    rows = read_predictions(out)
    assert list(rows["path"]) == [str(mixed / name) for name in MIXED_IMAGES]
    p, bound = validation_pass(checkpoint, [mixed / name for name in MIXED_IMAGES])
    assert np.all(np.abs(rows["p_dog"].to_numpy() - p) <= bound + FORMATTED)


def test_an_onnx_file_of_another_model_is_refused(exported, mixed, runs, tmp_path, monkeypatch, capsys):
    """Another run's best.json (DDP's: other weights), a file that is not ONNX, an ONNX file that
    is not ours: one line, exit 2."""
    def fails(message, *argv):
        return fails_in_process(predict.main, [str(mixed), "--output", str(tmp_path / "p.csv"), *map(str, argv)],
                                monkeypatch, capsys, message)
    other = mode_run(runs, "ddp")[0] / "best.pth"
    fails("was exported from another best.pth (squeezenet1_1, sha256", "--onnx", exported[0], "--checkpoint", other)
    beside = tmp_path / "best.onnx"  # beside another run's best.json: checked against it by default
    shutil.copy(exported[0], beside)
    shutil.copy(other.with_suffix(".json"), tmp_path / "best.json")
    fails("was exported from another best.pth", "--onnx", beside)
    (tmp_path / "text.onnx").write_text("not a model")
    fails("is not an ONNX model that onnxruntime can load", "--onnx", tmp_path / "text.onnx")
    foreign = onnx.load(str(exported[0]))
    del foreign.metadata_props[:]
    onnx.save(foreign, str(tmp_path / "foreign.onnx"))
    fails("was not written by src.tools.export", "--onnx", tmp_path / "foreign.onnx")
    assert not (tmp_path / "p.csv").exists()


def test_export_bad_input(checkpoint, exact_data, tmp_path, monkeypatch, capsys):
    def fails(message, *argv):
        return fails_in_process(export.main, list(map(str, argv)), monkeypatch, capsys, message)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("x")
    fails("no images in", checkpoint, tmp_path / "m.onnx", "--images", tmp_path / "text")
    fails("OUTPUT /proc/m.onnx: cannot write there", checkpoint, "/proc/m.onnx", "--images", exact_data / "train")
    fails("none.pth not found", tmp_path / "none.pth", tmp_path / "m.onnx", "--images", exact_data / "train")
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    fails("the export needs onnxscript: pip install -r requirements-onnx.txt", checkpoint, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_the_onnx_file_comes_after_its_weights_with_the_usual_mode(exported, checkpoint, exact_data, tmp_path,
                                                                   monkeypatch, capsys):
    """An export whose weights go to a .data file beside it (torch's exporter does that above
    1.5 GB; here the fixture's file saved that way), written privately (0600) as a saver in a
    temporary folder may: the .data file is in place before the .onnx that names it (a reader never
    finds an .onnx without its weights), and both get the mode a new file gets under the umask
    (0640 under 027), not 0600."""
    model = onnx.load(str(exported[0]))

    class Program:
        def save(self, path):
            onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=f"{os.path.basename(path)}.data", size_threshold=1024)
            for name in (path, f"{path}.data"):
                os.chmod(name, 0o600)
    monkeypatch.setattr(export, "export_program", lambda *args: Program())
    out, replaced, rename = tmp_path / "out", [], os.replace

    def replace(source, target, *args, **kwargs):
        replaced.append((os.path.basename(target), sorted(p.name for p in out.iterdir() if not p.name.startswith("."))))
        return rename(source, target, *args, **kwargs)
    out.mkdir()
    monkeypatch.setattr(os, "replace", replace)
    umask = os.umask(0o027)
    try:
        code, _, err = in_process(export.main, [str(checkpoint), str(out / "m.onnx"), "--images",
                                                str(exact_data / "train"), "--check", "3"], monkeypatch, capsys)
    finally:
        os.umask(umask)
    assert code == 0, err
    assert replaced == [("m.onnx.data", []), ("m.onnx", ["m.onnx.data"])]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {"m.onnx": 0o640, "m.onnx.data": 0o640}


@pytest.mark.parametrize("field, value, graph", [("image_size", "32", "3, 32, 32]"),
                                                 ("classes", '["cat", "dog", "fox"]', "3 classes")])
def test_an_onnx_file_whose_graph_is_not_its_metadata_is_refused(field, value, graph, exported, mixed, tmp_path,
                                                                 monkeypatch, capsys):
    """An export's graph takes (batch, 3, 64, 64) images and gives 2 classes; metadata that says
    32 px, or 3 classes, describes another graph: refused in one line before any image is decoded."""
    model = onnx.load(str(exported[0]))
    for prop in model.metadata_props:
        if prop.key == field:
            prop.value = value
    onnx.save(model, str(tmp_path / "other.onnx"))
    line = fails_in_process(predict.main, ["--onnx", str(tmp_path / "other.onnx"), str(mixed), "--output",
                                           str(tmp_path / "p.csv")], monkeypatch, capsys,
                            "does not match its metadata")
    assert graph in line and "export it again" in line
    assert not (tmp_path / "p.csv").exists()


def test_the_rounding_bound_is_the_hand_computed_formula():
    """|p_a - p_b| <= 4 LAMBDA u S M p (1 - p) + 4 u per image and class, computed here from its
    pieces for a model of a grouped convolution and two Linear layers: S = sum of sqrt(fan-in),
    M = max_j (|W| |a| + |b|)_j of the last layer in float64. Equal to the last digits: a bound
    twice or half as wide fails."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, groups=2), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(24, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    x = torch.randn(3, 4, 4, 4)
    p, bound = rounding_bound(model, x)
    with torch.no_grad():
        a = model[:-1](x).double().numpy()
    weight, bias = model[-1].weight.detach().double().numpy(), model[-1].bias.detach().double().numpy()
    m = (np.abs(a) @ np.abs(weight).T + np.abs(bias)).max(axis=1, keepdims=True)
    s = math.sqrt(2 * 3 * 3) + math.sqrt(24) + math.sqrt(5)  # fan-ins: 4 / 2 groups x 3 x 3, 24, 5
    q = p.double().numpy()
    u = 2.0 ** -24
    want = 4 * 3.0 * u * s * m * q * (1 - q) + 4 * u
    np.testing.assert_allclose(bound.numpy(), want, rtol=1e-9, atol=0)
    assert torch.equal(p, model(x).softmax(dim=1))
    # A vision transformer's attention counts its in-projection and its query-key products.
    attention = torch.nn.MultiheadAttention(8, num_heads=2)
    assert depth_sum(attention) == pytest.approx(math.sqrt(8) + math.sqrt(4) + math.sqrt(8))  # + out_proj
