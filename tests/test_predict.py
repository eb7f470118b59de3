"""python -m src.tools.predict PATH...: a folder of mixed files (JPEG, PNG, grayscale, CMYK, odd
names, nested folders, a text file, broken images) gives, for each image, the p(dog) of the
validation pass; two processes under torchrun give the one-process CSV row for row; bad input
ends in one line before any work."""
import csv
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    FORMATTED,
    MIXED_BROKEN,
    MIXED_IMAGES,
    MIXED_OTHERS,
    fails_in_process,
    in_process,
    printed_by,
    read_predictions,
    run,
    validation_pass,
)

from src import inference
from src.datasets import open_rgb
from src.image_files import decode, find_images
from src.tools import predict
from src.transforms import image_transform


@pytest.fixture(scope="module")
def one_process(mixed, checkpoint, module_tmp):
    """predict on the folder in this process, with one loader worker; (CSV, what it printed)."""
    out = module_tmp / "one.csv"
    printed = printed_by(predict.main, [str(mixed), "--checkpoint", str(checkpoint), "--output", str(out),
                                        "--workers", "1", "--batch-size", "4"])
    return read_predictions(out), printed


def test_a_mixed_folder_gives_the_validation_pass_p_dog(mixed, checkpoint, one_process):
    rows, printed = one_process
    assert list(rows["path"]) == [str(mixed / name) for name in MIXED_IMAGES]
    p, bound = validation_pass(checkpoint, [mixed / name for name in MIXED_IMAGES])
    assert np.all(np.abs(rows["p_dog"].to_numpy() - p) <= bound + FORMATTED), (rows["p_dog"], p, bound)
    assert not np.all(np.abs(np.roll(p, 1) - p) <= bound + FORMATTED), "rows out of order would show"
    assert list(rows["label"]) == ["dog" if q > 0.5 else "cat" for q in p]
    left_out = [line for line in printed.splitlines() if line.startswith("left out ")]
    assert len(left_out) == 2
    for line, (name, why) in zip(left_out, sorted(MIXED_BROKEN.items())):
        assert line.startswith(f"left out {mixed / name}: cannot decode it (") and why in line, line
    assert f"predicted {len(MIXED_IMAGES)} images" in printed
    named = ", ".join(str(mixed / name) for name in sorted(MIXED_OTHERS))  # in the order they were found
    assert f"skipped {len(MIXED_OTHERS)} file(s) that are not images ({named}); left out 2 that cannot be decoded" \
        in printed


def test_the_rows_of_files_that_cannot_be_decoded_are_nan(mixed, checkpoint):
    """predict_files' rows (as predict --onnx's): NaN for each file it cannot decode, which no
    reader can then take for a probability, in a batch that also holds images; the others numbers."""
    model, info = inference.load_checkpoint(checkpoint)
    files = [mixed / name for name in [MIXED_IMAGES[0], *sorted(MIXED_BROKEN), MIXED_IMAGES[1]]]
    probabilities, broken = inference.predict_files(model, info, files, torch.device("cpu"), batch_size=4)
    assert sorted(broken) == [1, 2]
    assert torch.isnan(probabilities[1:3]).all()
    assert torch.isfinite(probabilities[[0, 3]]).all()


def test_the_csv_quotes_odd_names_and_the_table_is_short(mixed, one_process, module_tmp):
    rows, printed = one_process
    text = (module_tmp / "one.csv").read_text()
    assert f'"{mixed}/Cat 7, ""quoted"" é.JPG"' in text  # a comma and quotes in a name
    assert next(csv.reader(text.splitlines())) == ["path", "p_dog", "label"]
    table = printed.splitlines()[2:]
    assert table[0].split() == ["path", "p(dog)", "label"]
    assert len(table) == 1 + predict.SHOWN + 2 and table[-2] == f"... {len(MIXED_IMAGES) - predict.SHOWN} more rows"
    assert table[1].split()[-2:] == [f"{rows['p_dog'][0]:.4f}", rows["label"][0]]


def test_decode_is_the_training_decode_byte_for_byte(mixed):
    """The Pillow-only decode (predict, and predict --onnx without torch) against training's
    open_rgb + image_transform, at the shared run's size and at one where draft decoding shrinks
    the JPEGs first (the x3 BMP, and the 64-ish px JPEGs at 16 px)."""
    for size in (64, 16, 224):
        for name in MIXED_IMAGES:
            want = image_transform(size)(open_rgb(mixed / name, draft_size=size)).numpy()
            assert np.array_equal(decode(mixed / name, size), want), (name, size)


def test_find_images_counts_other_files_and_refuses_an_empty_folder(mixed, tmp_path):
    files, others = find_images([mixed / "nested", mixed / "a" / "cat.2.jpg", mixed / "nested" / "dog.1.jpg"])
    assert [f.relative_to(mixed).as_posix() for f in files] == [
        "nested/dog.1.jpg", "nested/dog.3.JPEG", "nested/dog.20.jpg", "a/cat.2.jpg"]  # each once
    assert others == [mixed / "nested" / "README"]
    (tmp_path / "notes.txt").write_text("text")
    with pytest.raises(Exception, match="no images in .* \\(1 other file"):
        find_images([tmp_path])


def test_a_file_named_twice_is_listed_once(exact_data, tmp_path, monkeypatch):
    """The same image as an absolute and a relative path, through a link to it, and inside a link
    to its folder, in either order: predicted once, under the name it was first given."""
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(exact_data / "train" / "cat.1.jpg", folder / "a.jpg")
    shutil.copy(exact_data / "train" / "dog.1.jpg", folder / "b.jpg")
    (tmp_path / "link.jpg").symlink_to(folder / "a.jpg")
    (tmp_path / "folder").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    relative = Path("images") / "a.jpg"
    assert find_images([folder / "a.jpg", relative, tmp_path / "link.jpg", tmp_path / "folder"]) == \
        ([folder / "a.jpg", tmp_path / "folder" / "b.jpg"], [])
    assert find_images([tmp_path / "link.jpg", tmp_path / "folder", relative]) == \
        ([tmp_path / "link.jpg", tmp_path / "folder" / "b.jpg"], [])
    assert find_images([tmp_path / "folder", folder])[0] == [tmp_path / "folder" / "a.jpg", tmp_path / "folder" / "b.jpg"]


def test_two_processes_under_torchrun_write_the_one_process_csv(mixed, checkpoint, one_process, module_tmp):
    """The real torchrun, 2 processes on the CPU, one thread each: the same rows in the same
    order, each p(dog) within the float32 bound of the one-process run's; rank 0 alone prints,
    draws a progress bar and writes."""
    out = module_tmp / "two.csv"
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "src.tools.predict", str(mixed),
                  "--checkpoint", str(checkpoint), "--output", str(out), "--workers", "0", "--batch-size", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = one_process[0], read_predictions(out)
    assert list(two["path"]) == list(one["path"]) and list(two["label"]) == list(one["label"])
    _, bound = validation_pass(checkpoint, [mixed / name for name in MIXED_IMAGES])
    assert np.all(np.abs(two["p_dog"].to_numpy() - one["p_dog"].to_numpy()) <= 2 * FORMATTED + bound)
    lines = result.stdout.splitlines()
    assert sum(line.startswith("predicted ") for line in lines) == 1
    assert sum(line.startswith("left out ") for line in lines) == 2
    # Each rank decodes and runs its share only: rank 0's bar counts the batches of 7 of the 15 images.
    assert re.findall(r"predicting: +0%\|[^|]*\| 0/(\d+) ", result.stderr) == ["3"], result.stderr[-2000:]


def test_tta_amp_and_channels_last_are_applied(mixed, checkpoint, module_tmp, monkeypatch, capsys):
    """--tta: each p(dog) is the mean of the image's and its mirror's (computed here); --amp bf16
    and --channels-last: the model runs in bfloat16 on channels-last batches and weights;
    --workers 0: no default number of loader workers is asked for."""
    seen, load = [], inference.load_checkpoint

    def watched(path):
        model, info = load(path)
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
        first.register_forward_hook(lambda m, args, output: seen.append(
            (output.dtype, args[0].is_contiguous(memory_format=torch.channels_last),
             m.weight.is_contiguous(memory_format=torch.channels_last))))
        return model, info
    monkeypatch.setattr(inference, "load_checkpoint", watched)
    import src.devices
    monkeypatch.setattr(src.devices, "default_workers", lambda: pytest.fail("--workers 0 took the default"))
    out = module_tmp / "tta.csv"
    code, _, err = in_process(predict.main, [str(mixed), "--checkpoint", str(checkpoint), "--output", str(out),
                                             "--workers", "0", "--tta", "--amp", "bf16", "--channels-last"],
                              monkeypatch, capsys)
    assert code == 0, err
    assert seen and set(seen) == {(torch.bfloat16, True, True)}
    monkeypatch.setattr(inference, "load_checkpoint", load)
    code, _, err = in_process(predict.main, [str(mixed), "--checkpoint", str(checkpoint), "--output", str(out),
                                             "--workers", "0", "--tta"], monkeypatch, capsys)
    assert code == 0, err
    files = [mixed / name for name in MIXED_IMAGES]
    (p, bound), (mirrored, mirrored_bound) = validation_pass(checkpoint, files), validation_pass(checkpoint, files, True)
    assert not np.allclose(p, mirrored, atol=1e-4)
    tta = read_predictions(out)["p_dog"].to_numpy()
    assert np.all(np.abs(tta - (p + mirrored) / 2) <= (bound + mirrored_bound) / 2 + FORMATTED)


def _fails(argv, monkeypatch, capsys, message):
    return fails_in_process(predict.main, [str(a) for a in argv], monkeypatch, capsys, message)


def test_bad_input_ends_in_one_line_before_any_work(mixed, checkpoint, tmp_path, monkeypatch, capsys):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("x")
    _fails([tmp_path / "text", "--checkpoint", checkpoint], monkeypatch, capsys, "no images in")
    _fails([tmp_path / "nowhere", "--checkpoint", checkpoint], monkeypatch, capsys, "nowhere: no such file or folder")
    for output in ("/proc/predictions.csv", tmp_path):  # nothing can be created in /proc; a folder
        line = _fails([mixed, "--checkpoint", checkpoint, "--output", output], monkeypatch, capsys,
                      f"--output {output}: cannot write there")
        assert "predicting" not in line
    _fails([mixed, "--checkpoint", tmp_path / "none.pth"], monkeypatch, capsys, "none.pth not found")
    _fails([mixed, "--onnx", tmp_path / "m.onnx", "--amp", "bf16"], monkeypatch, capsys,
           "--amp and --channels-last set up the torch model")


def test_a_checkpoint_of_another_arch_or_class_count_or_a_torn_pair(mixed, checkpoint, tmp_path, monkeypatch,
                                                                     capsys):
    import torchvision
    shutil.copy(checkpoint.with_suffix(".json"), tmp_path / "best.json")
    for model in (torchvision.models.squeezenet1_1(num_classes=1000), torchvision.models.resnet18(num_classes=2)):
        torch.save(model.state_dict(), tmp_path / "best.pth")
        info = json.loads(checkpoint.with_suffix(".json").read_text())
        del info["sha256"]  # the state_dict check alone
        (tmp_path / "best.json").write_text(json.dumps(info))
        _fails([mixed, "--checkpoint", tmp_path / "best.pth"], monkeypatch, capsys,
               "best.pth is not a 2-class squeezenet1_1 state_dict")
    shutil.copy(checkpoint.with_suffix(".json"), tmp_path / "best.json")  # with the sha256 of another file
    _fails([mixed, "--checkpoint", tmp_path / "best.pth"], monkeypatch, capsys, "is not the file that")


def test_kaggle_test_folder_with_a_broken_image_is_refused(exact_data, checkpoint, tmp_path, monkeypatch, capsys):
    """Without PATH: Kaggle's test/ -> submission.csv, which needs every image."""
    (tmp_path / "test").mkdir()
    for i in (1, 2, 3):
        shutil.copy(exact_data / "test" / f"{i}.jpg", tmp_path / "test")
    code, out, err = in_process(predict.main, ["--data-dir", str(tmp_path), "--checkpoint", str(checkpoint),
                                               "--output", str(tmp_path / "s.csv"), "--workers", "0"],
                                monkeypatch, capsys)
    assert code == 0 and "wrote 3 predictions" in out, err
    assert (tmp_path / "s.csv").read_text().splitlines()[0] == "id,label"
    (tmp_path / "test" / "4.jpg").write_bytes(b"")
    os.remove(tmp_path / "s.csv")
    _fails(["--data-dir", tmp_path, "--checkpoint", checkpoint, "--output", tmp_path / "s.csv", "--workers", "0"],
           monkeypatch, capsys, "a submission needs a prediction for every test image")
    assert not (tmp_path / "s.csv").exists()


def test_help_gives_every_option_a_text_and_its_default(monkeypatch, capsys):
    """`predict --help` showed no default and no text for --batch-size: every option has a text
    and says its default (in its own words, or argparse's "(default: ...)" after it)."""
    code, out, _ = in_process(predict.main, ["--help"], monkeypatch, capsys)
    assert code == 0
    entries = re.split(r"\n(?=  -)", out[out.index("\n  -h, --help"):])[2:]  # after -h's
    assert len(entries) >= 10
    for entry in entries:
        text = entry.strip().partition(" ")[2]
        assert text.strip() and "default" in text, entry
    batch = next(entry for entry in entries if entry.lstrip().startswith("--batch-size"))
    assert " ".join(batch.split()).endswith("(default: 100)")
