"""Every image in the data folder is used, or named as not used, and read as it is meant to be
seen: files that no label rule covers and images added after `prepare` wrote train.csv are named
in one line (src.datasets.not_used_line); Kaggle's test/ names what is not an N.jpg image and
refuses two images of one id; predict names the files that are not images; under torchrun rank 0
lists the files and every rank predicts its share of that list; EXIF orientation and 16-bit
grayscale are decoded as a viewer shows them, in the one decode that training and predict share
(src.image_files.to_rgb)."""
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    FORMATTED,
    HOOKS,
    TINY,
    fails_in_process,
    in_process,
    outputs,
    read_predictions,
    run,
    run_main,
    validation_pass,
)
from PIL import Image

import train_single
from src.datasets import load_labels, open_rgb
from src.image_files import decode, find_images
from src.metrics import EPS
from src.tools import predict, prepare
from src.transforms import image_transform


def _copy_data(source: Path, folder: Path) -> Path:
    shutil.copytree(source / "train", folder / "train")
    shutil.copytree(source / "test", folder / "test")
    return folder


def test_images_added_after_prepare_are_named_as_not_used(tiny_data, tmp_path, monkeypatch, capsys):
    """"32 train / 8 val images" of 44 files, no word: train.csv, written before 4 images were
    added, is still what trains (a table of the user's choosing), and one line names what it
    leaves out and how to take it in."""
    data = _copy_data(tiny_data, tmp_path / "data")
    assert in_process(prepare.main, [str(data)], monkeypatch, capsys)[0] == 0
    for new, source in (("cat.100.jpg", "cat.0.jpg"), ("cat.101.jpg", "cat.1.jpg"), ("dog.100.jpg", "dog.0.jpg"),
                        ("dog.101.jpg", "dog.1.jpg")):
        shutil.copy(data / "train" / source, data / "train" / new)
    code, out, err = in_process(train_single.main, [*TINY, "--data-dir", str(data), *outputs(tmp_path / "out")],
                                monkeypatch, capsys)
    assert code == 0, err
    assert (f"not used: 4 file(s) in {data / 'train'} that {data / 'train.csv'} does not list (cat.100.jpg, "
            f"cat.101.jpg, dog.100.jpg and 1 more); to train on them too, rerun `python -m src.tools.prepare "
            f"{data}`, which rewrites it") in out.splitlines(), out
    assert "32 train / 8 val images" in out
    assert in_process(prepare.main, [str(data)], monkeypatch, capsys)[0] == 0
    assert len(load_labels(data)) == 44 and "not used" not in capsys.readouterr().out


def test_files_no_label_rule_covers_are_named_and_a_labelled_tiff_is_used(tiny_data, tmp_path, monkeypatch, capsys):
    """horse.1.jpg, cat.jpg, notes.txt and a folder that is no class were dropped without a word
    by prepare and by the scan of a training run; a cat.N.tif was dropped too (TIFF is an image
    to predict, and now to train on)."""
    data = _copy_data(tiny_data, tmp_path / "data")
    train = data / "train"
    for name in ("horse.1.jpg", "cat.jpg", "extra/cat.5.jpg"):
        (train / name).parent.mkdir(exist_ok=True)
        shutil.copy(train / "cat.0.jpg", train / name)
    (train / "notes.txt").write_text("not an image\n")
    with Image.open(train / "cat.2.jpg") as image:
        image.save(train / "cat.50.tif")
    line = (f"not used: 4 file(s) in {train} that no label rule covers (cat.N / dog.N images, or images at any "
            "depth under a cat(s)/ or dog(s)/ folder; .bmp, .gif, .jpeg, .jpg, .png, .tif, .tiff, .webp): cat.jpg, "
            "extra/cat.5.jpg, horse.1.jpg and 1 more")
    table = load_labels(data)
    assert line in capsys.readouterr().out.splitlines()
    assert "cat.50.tif" in set(table["filename"]) and len(table) == 41
    code, out, err = in_process(prepare.main, [str(data)], monkeypatch, capsys)
    assert code == 0 and line in out.splitlines(), (out, err)
    assert (data / "train.csv").read_text().count("\n") == 1 + 41


def test_kaggle_test_folder_names_what_it_does_not_predict_and_refuses_an_id_twice(untrained, tiny_data, tmp_path,
                                                                                  monkeypatch, capsys):
    """test/ files that are not N.jpg were dropped without a word ("²3.jpg" was a traceback: a
    digit to str.isdigit, not to int); 1.jpg and 01.jpg were one id, one of them silently lost."""
    data = _copy_data(tiny_data, tmp_path / "data")
    test = data / "test"
    shutil.copy(test / "1.jpg", test / "1 (copy).jpg")
    shutil.copy(test / "2.jpg", test / "\u00b23.jpg")
    (test / "notes.txt").write_text("x\n")
    (test / "more").mkdir()
    out = tmp_path / "s.csv"
    argv = ["--data-dir", str(data), "--checkpoint", str(untrained), "--output", str(out), "--workers", "0"]
    code, printed, err = in_process(predict.main, argv, monkeypatch, capsys)
    assert code == 0, err
    assert printed.strip().splitlines()[-1] == (
        f"wrote 6 predictions to {out}; not predicted: 4 entries of {test} that are not N.jpg images "
        "(1 (copy).jpg, more/, notes.txt and 1 more)")
    assert out.read_text().splitlines()[1:] and [row.split(",")[0] for row in out.read_text().splitlines()[1:]] == \
        [str(i) for i in range(1, 7)]
    out.unlink()
    shutil.copy(test / "1.jpg", test / "01.jpg")
    fails_in_process(predict.main, argv, monkeypatch, capsys, f"{test} holds two images of id 1 (")
    assert not out.exists()


def test_a_name_holding_a_digit_that_int_refuses_sorts_as_text(tiny_data, tmp_path):
    """A file named with a superscript ² (a digit to str.isdigit, not to int) was a traceback in
    the natural sort of predict's folders and of train/'s scan."""
    for name in ("\u00b23.jpg", "2.jpg", "10.jpg", "\u0663.jpg"):  # ²3, and an Arabic-Indic 3, which int() takes
        shutil.copy(tiny_data / "test" / "1.jpg", tmp_path / name)
    assert [file.name for file in find_images([tmp_path])[0]] == ["2.jpg", "\u0663.jpg", "10.jpg", "\u00b23.jpg"]


@pytest.mark.parametrize("kaggle", [False, True])
def test_under_torchrun_every_rank_predicts_its_share_of_rank_0s_list(kaggle, checkpoint, exact_data, tmp_path):
    """Every rank listed the files and rank 0 gave its own list the others' shares: an image that
    appeared between the ranks' listings (8.jpg, last) shifted rank 1's share by one, and each of
    its rows got its neighbour's p(dog), exit 0. Now rank 0 lists, for both PATH and Kaggle's
    test/; the image that came later is not predicted."""
    folder = tmp_path / "test"
    folder.mkdir()
    files = [folder / f"{i}.jpg" for i in range(1, 8)]
    for file in files:
        shutil.copy(exact_data / "test" / file.name, file)
    out = tmp_path / "p.csv"
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "src.tools.predict",
                  *(["--data-dir", str(tmp_path)] if kaggle else [str(folder)]), "--checkpoint", str(checkpoint),
                  "--output", str(out), "--workers", "0", "--batch-size", "2"],
                 env={"PYTHONPATH": HOOKS, "APPEAR_AFTER_LISTING": f"{folder / '8.jpg'}:{exact_data / 'test' / '9.jpg'}"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (folder / "8.jpg").exists(), "it did appear"
    p, bound = validation_pass(checkpoint, files)
    assert not np.all(np.abs(np.roll(p, 1) - p) <= bound + FORMATTED), "a row in another's place would show"
    if kaggle:
        rows = [line.split(",") for line in out.read_text().splitlines()[1:]]
        assert [int(i) for i, _ in rows] == list(range(1, 8))
        clipped = np.clip(p, EPS, 1 - EPS)
        assert np.all(np.abs(np.array([float(q) for _, q in rows]) - clipped) <= bound + 5e-7), (rows, clipped)
    else:
        rows = read_predictions(out)
        assert list(rows["path"]) == [str(file) for file in files]
        assert np.all(np.abs(rows["p_dog"].to_numpy() - p) <= bound + FORMATTED), (rows, p)


def _rgb(seed: int, height: int = 30, width: int = 44) -> np.ndarray:
    """A smooth image that differs from its own rotations (a gradient and a blob, off-centre)."""
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    channels = [(x * rng.uniform(2, 5) + y * rng.uniform(0, 3) + 60 * (np.hypot(y - 8, x - 30) < 6)) % 256
                for _ in range(3)]
    return np.stack(channels, axis=-1).astype(np.uint8)


def _both_decodes(path: Path, size: int) -> tuple[np.ndarray, np.ndarray]:
    """predict's decode and training's open_rgb + image_transform, as uint8 (3, size, size)."""
    return decode(path, size), image_transform(size)(open_rgb(path, draft_size=size)).numpy()


@pytest.mark.parametrize("orientation, turn", [(3, lambda a: np.rot90(a, 2)), (6, lambda a: np.rot90(a, -1)),
                                               (8, lambda a: np.rot90(a, 1)), (2, lambda a: a[:, ::-1])])
def test_exif_orientation_turns_the_image_as_a_viewer_shows_it(orientation, turn, tmp_path):
    """A phone's portrait photo is stored sideways with an EXIF tag saying how to turn it: training
    and predict fed it sideways. Each decode equals the decode of the turned pixels saved without
    the tag (PNG: lossless, so equal to the byte)."""
    pixels = _rgb(orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(tmp_path / "tagged.png", exif=exif)
    Image.fromarray(np.ascontiguousarray(turn(pixels))).save(tmp_path / "turned.png")
    for size in (32, 40):
        want = _both_decodes(tmp_path / "turned.png", size)[0]
        for got in _both_decodes(tmp_path / "tagged.png", size):
            assert np.array_equal(got, want), (orientation, size)


def test_a_16_bit_grayscale_png_is_its_high_byte_not_white(tmp_path):
    """A 16-bit grayscale PNG decoded nearly white (Pillow's convert("RGB") clips each value at
    255). Each decode equals the decode of the 8-bit image of each value's high byte, computed
    here."""
    y, x = np.mgrid[0:40, 0:50]
    sixteen = ((x * 1300 + y * 50) % 65536).astype(np.uint16)
    Image.fromarray(sixteen).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as image:
        assert image.mode.startswith("I;16")
    Image.fromarray((sixteen >> 8).astype(np.uint8), "L").save(tmp_path / "eight.png")
    want = _both_decodes(tmp_path / "eight.png", 32)[0]
    assert 60 < want.mean() < 200, "a mid-grey image: white would show"
    for got in _both_decodes(tmp_path / "deep.png", 32):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("workers", ["0", "1"])
def test_pillows_warnings_about_an_odd_image_are_not_printed(workers, untrained, tmp_path, capfd):
    """A palette image with its transparency in bytes makes Pillow warn as it is converted to RGB
    (odd EXIF data does too): not printed by predict, in its own process (--workers 0) nor in a
    loader worker, as a plain interpreter would show it (once per place)."""
    import warnings
    image = Image.fromarray(np.arange(32 * 32, dtype=np.uint8).reshape(32, 32) % 200, "P")
    image.putpalette(list(range(256)) * 3)
    image.save(tmp_path / "palette.png", transparency=bytes([0] * 10 + [255] * 246))
    with warnings.catch_warnings(record=True) as plain:  # the warning, as it comes without the filter
        warnings.simplefilter("default")
        Image.open(tmp_path / "palette.png").convert("RGB")
    assert [str(item.message) for item in plain] == [
        "Palette images with Transparency expressed in bytes should be converted to RGBA images"]
    said = []
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, *where: said.append(str(message))
        result = run_main(predict.main, [str(tmp_path / "palette.png"), "--checkpoint", str(untrained), "--output",
                                         str(tmp_path / "p.csv"), "--workers", workers])
    assert result.returncode == 0 and "predicted 1 images" in result.stdout, result.stderr
    assert said == [] and "Palette images" not in capfd.readouterr().err + result.stderr
