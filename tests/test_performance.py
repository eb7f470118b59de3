"""The speed options change nothing they should not: --cache, the draft JPEG decode,
--channels-last, --amp and --compile."""
import csv
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import EXACT, LEARN, history, max_relative_difference, outputs, python, run, weights
from src.cache import cache_paths, cached
from src.datasets import open_rgb
from src.loaders import labelled_images
from src.transforms import image_transform

VAL = ["--val-fraction", "0.5025", "--epochs", "1", "--batch-size", "20"]


def _dataset(data_dir, size):
    return labelled_images(data_dir, size, show_progress=False)


def _train(data_dir, out, *extra, script="train_single.py"):
    result = python(script, "--data-dir", str(data_dir), *EXACT, *VAL, *outputs(out), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def reference(exact_data, module_tmp):
    """train_single.py from the JPEGs, no speed option."""
    out = module_tmp / "reference"
    _train(exact_data, out)
    return out


def test_cache_holds_exactly_the_jpeg_path_tensors(small_data, tmp_path, capsys):
    dataset = _dataset(small_data, 32)
    cache = cached(dataset, 32, tmp_path, workers=0, show_progress=False)
    assert len(cache) == len(dataset) == 240
    data_path, _ = cache_paths(tmp_path, 32)
    assert data_path.stat().st_size == 240 * 3 * 32 * 32
    for index in range(len(dataset)):
        image, label = cache[index]
        expected_image, expected_label = dataset[index]
        assert image.dtype == torch.uint8 and label == expected_label
        assert torch.equal(image, expected_image), index


def test_cache_is_reused_and_rebuilt_when_its_inputs_change(small_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    cache_dir = tmp_path / "cache"
    data_path, _ = cache_paths(cache_dir, 32)
    cached(_dataset(data, 32), 32, cache_dir, workers=0)
    built = data_path.stat().st_mtime_ns

    cached(_dataset(data, 32), 32, cache_dir, workers=0)
    assert f"reading images from the cache {data_path}" in capsys.readouterr().out
    assert data_path.stat().st_mtime_ns == built

    # An image replaced by another one: rebuilt, and holds the new pixels.
    name = _dataset(data, 32).frame["filename"][0]
    Image.new("RGB", (70, 50), (255, 0, 0)).save(data / "train" / name)
    cache = cached(_dataset(data, 32), 32, cache_dir, workers=0)
    assert "reading images" not in capsys.readouterr().out
    assert torch.equal(cache[0][0], _dataset(data, 32)[0][0])
    assert cache[0][0][0].float().mean() > 240 and cache[0][0][1].float().mean() < 15  # red

    # A train.csv that lists fewer images: rebuilt with those alone.
    frame = _dataset(data, 32).frame
    frame.iloc[:100].to_csv(data / "train.csv", index=False)
    cache = cached(_dataset(data, 32), 32, cache_dir, workers=0)
    assert "reading images" not in capsys.readouterr().out
    assert len(cache) == 100 and data_path.stat().st_size == 100 * 3 * 32 * 32

    # Another size: its own files, the first cache stays valid.
    cached(_dataset(data, 48), 48, cache_dir, workers=0)
    assert "reading images" not in capsys.readouterr().out
    assert cache_paths(cache_dir, 48)[0].stat().st_size == 100 * 3 * 48 * 48
    cached(_dataset(data, 32), 32, cache_dir, workers=0)
    assert "reading images from the cache" in capsys.readouterr().out


def test_training_from_the_cache_gives_the_same_weights(exact_data, reference, tmp_path):
    cache = tmp_path / "cache"
    first = _train(exact_data, tmp_path / "build", "--cache", str(cache))
    assert "reading images from the cache" not in first.stdout
    second = _train(exact_data, tmp_path / "reuse", "--cache", str(cache))
    assert "reading images from the cache" in second.stdout
    for out in ("build", "reuse"):
        assert max_relative_difference(weights(tmp_path / out), weights(reference)) == 0
        assert history(tmp_path / out)[0]["val_loss"] == history(reference)[0]["val_loss"]


def test_ddp_ranks_share_one_cache(exact_data, reference, tmp_path):
    """Rank 0 builds the cache while rank 1 waits for it; the run equals the single one."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "train_ddp.py",
                  "--data-dir", str(exact_data), *EXACT, "--val-fraction", "0.5025", "--epochs", "1",
                  "--batch-size", "10", *outputs(tmp_path / "out"), "--cache", str(tmp_path / "cache")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["train_64px.json", "train_64px.u8"]
    assert max_relative_difference(weights(tmp_path / "out"), weights(reference)) < 1e-5
    assert history(tmp_path / "out")[0]["val_samples"] == 101


def test_prepare_builds_the_cache_training_reads(exact_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(exact_data, data)
    result = python("-m", "src.prepare", str(data), "--cache", str(tmp_path / "cache"),
                    "--image-size", "64")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"cached 201 images at 64 px in {tmp_path / 'cache' / 'train_64px.u8'}" in result.stdout
    training = _train(data, tmp_path / "out", "--cache", str(tmp_path / "cache"))
    assert f"reading images from the cache {tmp_path / 'cache' / 'train_64px.u8'}" in training.stdout


def test_cache_folder_that_cannot_be_made(exact_data, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    result = python("train_single.py", "--data-dir", str(exact_data), *EXACT, *VAL,
                    *outputs(tmp_path / "out"), "--cache", str(tmp_path / "file" / "cache"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --cache {tmp_path / 'file' / 'cache'}: cannot create it (Not a directory)")


def _smooth_photo(path, seed):
    """A 500x375 JPEG (the Kaggle photos' usual size) of smooth colour gradients."""
    yy, xx = np.mgrid[0:375, 0:500]
    pixels = np.stack([128 + 100 * np.sin(xx / 40 + seed), 128 + 100 * np.cos(yy / 30 + seed),
                       128 + 80 * np.sin((xx + yy) / 55)], -1)
    Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)


@pytest.mark.parametrize("size, mean, largest", [(32, 2.5, 12), (64, 1.0, 5), (112, 1.0, 5),
                                                 (224, 0, 0)])
def test_draft_decode_stays_close_to_a_full_decode(tmp_path, size, mean, largest):
    """README states this tolerance: mean and largest |difference| in uint8 pixel levels."""
    for seed in range(3):
        _smooth_photo(tmp_path / f"{seed}.jpg", seed)
        full = image_transform(size)(open_rgb(tmp_path / f"{seed}.jpg")).int()
        draft = image_transform(size)(open_rgb(tmp_path / f"{seed}.jpg", draft_size=size)).int()
        difference = (full - draft).abs().float()
        assert difference.mean() <= mean and difference.max() <= largest, (seed, difference.mean())
        if size <= 112:  # the draft did decode at a smaller scale
            assert not torch.equal(full, draft)


def test_channels_last_changes_nothing(exact_data, reference, tmp_path):
    """Other convolution kernels sum in another order. Measured after 5 steps: weights within 1e-6
    relative, the small biases 2.7e-5; another global batch gives over 1e-2 (tests/test_modes.py)."""
    _train(exact_data, tmp_path, "--channels-last")
    assert max_relative_difference(weights(tmp_path), weights(reference)) < 1e-4


def test_compile_changes_nothing(exact_data, reference, tmp_path):
    """Measured as for channels-last: 2.7e-5 relative on the biases."""
    _train(exact_data, tmp_path, "--compile")
    assert max_relative_difference(weights(tmp_path), weights(reference)) < 1e-4
    assert not any(key.startswith("_orig_mod.") for key in weights(tmp_path))
    assert not any(key.startswith("_orig_mod.") for key in weights(tmp_path, "last.pth")["model"])


def test_bf16_with_channels_last_learns(small_data, tmp_path):
    """Measured best val acc over 3 epochs: 0.94 (fp32: 0.98; lr 0.01 makes these runs noisy)."""
    result = python("train_single.py", "--data-dir", str(small_data), *LEARN, "--epochs", "3",
                    "--batch-size", "16", "--amp", "bf16", "--channels-last", "--workers", "0",
                    *outputs(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max(record["val_acc"] for record in history(tmp_path)) >= 0.85, history(tmp_path)
    assert all(tensor.dtype == torch.float32 for tensor in weights(tmp_path).values()
               if tensor.is_floating_point())


def test_fp16_scales_the_loss_and_stays_near_float32(exact_data, reference, tmp_path):
    """fp16 autocast is slow on CPUs (7 s a step here) but runs; measured 1.3e-4 from float32."""
    _train(exact_data, tmp_path, "--amp", "fp16", script="train_dp.py")
    scaler = weights(tmp_path, "last.pth")["scaler"]
    assert scaler["scale"] == 65536.0 and scaler["_growth_tracker"] == 5  # 5 steps, none skipped
    assert 1e-6 < max_relative_difference(weights(tmp_path), weights(reference)) < 1e-2


def test_benchmark_writes_the_table_chart_and_checks(small_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    out = tmp_path / "bench"
    result = python("-m", "src.benchmark", "--data-dir", str(data), "--out-dir", str(out),
                    "--processes", "2", "--arch", "resnet18", "--image-size", "32",
                    "--batch-size", "8", "--epochs", "1", "--steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out / "benchmark.csv") as f:
        rows = {row["row"]: row for row in csv.DictReader(f)}
    assert list(rows) == ["single-jpeg", "single", "dp", "ddp", "accelerate", "bare step",
                          "loader, JPEG", "loader, cache", "decode full 32 px", "decode draft 32 px",
                          "decode full 224 px", "decode draft 224 px"]
    assert [rows[m]["processes"] for m in ("single", "dp", "ddp", "accelerate")] == ["1", "1", "2", "2"]
    assert all(float(row["train_images_per_s"]) > 0 for row in rows.values())
    assert float(rows["single"]["speedup"]) == 1.0
    for mode in ("single-jpeg", "single", "dp", "ddp", "accelerate"):
        record = history(out / "runs" / mode)[-1]
        assert record["train_samples"] == 192 // 16 * 16  # global batch 16 in every mode
        assert float(rows[mode]["epoch_seconds"]) == pytest.approx(record["seconds"], abs=1e-3)
    markdown = (out / "benchmark.md").read_text()
    assert "| ddp | 2 |" in markdown and "Checks:" in markdown and "of the bare step" in markdown
    assert markdown in result.stdout
    assert (out / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "cache").iterdir()) == ["train_32px.json", "train_32px.u8"]


def test_benchmark_bad_out_dir_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "file").write_text("")
    result = python("-m", "src.benchmark", "--out-dir", str(tmp_path / "file" / "bench"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --out-dir {tmp_path / 'file' / 'bench'}: cannot create it (Not a directory)"
