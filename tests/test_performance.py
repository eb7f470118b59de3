"""The speed options change nothing they should not, and each really takes effect: --cache (also
shared by ranks, several builders, a damaged file), the draft JPEG decode, --channels-last,
--compile, --amp bf16 and fp16; the normalisation on the device, in place, gives what the formula does."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import (
    EXACT,
    ROOT,
    TOLERANCE,
    VAL,
    cache_files,
    distance,
    fails_in_process,
    history,
    in_process,
    last_model,
    mode_run,
    weights,
)
from PIL import Image

import train_single
from src.cache import cache_key, cache_paths, cached
from src.cli import parse_args
from src.datasets import open_rgb
from src.errors import UserError
from src.loaders import labelled_data, labelled_images
from src.tools import prepare
from src.transforms import IMAGENET_MEAN, IMAGENET_STD, image_transform, model_inputs, normalize


def _dataset(data_dir, size):
    return labelled_images(data_dir, size, show_progress=False)


def test_cache_holds_exactly_the_jpeg_path_tensors(small_data, tmp_path, capsys):
    dataset = _dataset(small_data, 32)
    cache = cached(dataset, 32, tmp_path, workers=0, show_progress=False)
    assert len(cache) == len(dataset) == 240
    assert cache.path == cache_paths(tmp_path, 32, cache.key)[0] and cache.path.name.startswith("train_32px.")
    assert cache.path.stat().st_size == 240 * 3 * 32 * 32
    for index in range(len(dataset)):
        image, label = cache[index]
        expected_image, expected_label = dataset[index]
        assert image.dtype == torch.uint8 and label == expected_label
        assert torch.equal(image, expected_image), index


def test_cache_is_reused_and_rebuilt_when_its_inputs_change(small_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    cache_dir = tmp_path / "cache"
    data_path = cached(_dataset(data, 32), 32, cache_dir, workers=0).path
    built = data_path.stat().st_mtime_ns

    cached(_dataset(data, 32), 32, cache_dir, workers=0)
    assert f"reading images from the cache {data_path}" in capsys.readouterr().out
    assert data_path.stat().st_mtime_ns == built

    # An image replaced by another one: built again (under its new key), and holds the new pixels.
    name = _dataset(data, 32).frame["filename"][0]
    Image.new("RGB", (70, 50), (255, 0, 0)).save(data / "train" / name)
    cache = cached(_dataset(data, 32), 32, cache_dir, workers=0)
    assert "reading images" not in capsys.readouterr().out
    assert torch.equal(cache[0][0], _dataset(data, 32)[0][0])
    assert cache[0][0][0].float().mean() > 240 and cache[0][0][1].float().mean() < 15  # red

    # A train.csv that lists fewer images: built again with those alone.
    frame = _dataset(data, 32).frame
    frame.iloc[:100].to_csv(data / "train.csv", index=False)
    cache = cached(_dataset(data, 32), 32, cache_dir, workers=0)
    assert "reading images" not in capsys.readouterr().out
    assert len(cache) == 100 and cache.path.stat().st_size == 100 * 3 * 32 * 32 and cache.path != data_path

    # Another size: its own files, the first cache stays valid.
    larger = cached(_dataset(data, 48), 48, cache_dir, workers=0)
    assert "reading images" not in capsys.readouterr().out
    assert larger.path.stat().st_size == 100 * 3 * 48 * 48
    cached(_dataset(data, 32), 32, cache_dir, workers=0)
    assert "reading images from the cache" in capsys.readouterr().out


@pytest.fixture(scope="module")
def ddp_cache(runs):
    """A DDP run that builds --cache: (the cache folder, its output folder, the process)."""
    cache = runs.root / "cache"
    return (cache, *runs.exact("ddp", "--cache", str(cache)))


def test_ddp_ranks_share_one_cache_that_one_process_built_once(ddp_cache, runs):
    """Rank 0 builds it (LOCAL_RANK 0) while rank 1 waits; the run equals the one from JPEGs."""
    cache, out, result = ddp_cache
    assert "reading images from the cache" not in result.stdout
    assert cache_files(cache) == ["train_64px.json", "train_64px.u8"]
    writes = [line.split() for line in (out.parent / "writes.log").read_text().splitlines()]
    assert [rank for rank, path in writes if path.startswith(str(cache))] == ["0", "0"]  # .u8, .json
    assert distance(last_model(out), last_model(mode_run(runs, "ddp")[0])) == 0


def test_training_from_the_cache_gives_the_same_weights(ddp_cache, runs):
    out, result = runs.exact("single", "--cache", str(ddp_cache[0]), "--workers", "2")
    assert "reading images from the cache" in result.stdout
    reference = mode_run(runs, "single")[0]
    assert distance(last_model(out), last_model(reference)) == 0
    assert history(out)[-1]["val_loss"] == history(reference)[-1]["val_loss"]


_BUILDER = """
import os, sys
from pathlib import Path
from src.cache import cached
from src.loaders import labelled_data, labelled_images
os.environ["LOCAL_RANK"] = sys.argv[3]
dataset = labelled_images(Path(sys.argv[1]), 32, show_progress=False)
cache = cached(dataset, 32, Path(sys.argv[2]), workers=0, show_progress=False)
print(sum(int(cache[i][0].sum()) for i in range(len(cache))))
"""


def test_two_nodes_build_one_shared_cache_at_once(small_data, tmp_path):
    """The first process of two nodes (LOCAL_RANK 0 on each) start building the same cache folder
    at the same moment, as on a shared NFS home, while another process waits for it: every
    one ends with the same complete cache and no temporary file is left."""
    starts = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(small_data), str(tmp_path), rank],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for rank in ("0", "0", "1")]
    results = [process.communicate(timeout=300) for process in starts]
    assert [process.returncode for process in starts] == [0, 0, 0], results
    expected = sum(int(image.sum()) for image, _ in labelled_images(small_data, 32, show_progress=False))
    assert [int(out) for out, _ in results] == [expected] * 3
    assert cache_files(tmp_path) == ["train_32px.json", "train_32px.u8"]


def test_the_first_complete_build_wins_and_builders_never_share_a_file(tmp_path, monkeypatch):
    """Builder A starts; while it fills its file, builder B (another node, the same process id and
    host name, as in identical containers) builds the whole cache. A then finds B's complete
    build, keeps it and drops its own; nobody deleted the record B wrote."""
    import src.cache as cache
    monkeypatch.setattr("os.getpid", lambda: 1234)
    monkeypatch.setattr("socket.gethostname", lambda: "node")
    data, meta = tmp_path / "a.u8", tmp_path / "a.json"
    names = []

    def fill_b(array):
        names.append(array.filename)
        array[:] = 2

    def fill_a(array):
        names.append(array.filename)
        array[:] = 1
        cache.ensure_array(data, meta, "key", (4,), np.uint8, fill_b, "--cache", "test")
    cache.ensure_array(data, meta, "key", (4,), np.uint8, fill_a, "--cache", "test")
    assert len(set(names)) == 2, "each builder writes its own temporary file"
    assert data.read_bytes() == b"\x02" * 4 and json.loads(meta.read_text())["key"] == "key"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.u8"]


def test_a_process_waiting_for_a_cache_that_never_comes_stops_with_one_line(tmp_path, monkeypatch):
    """A process other than its node's first never builds the cache (the DDP test above cannot
    tell: a second builder that finishes last keeps the first one's file): it waits, and gives up
    in one line."""
    import src.cache as cache
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cache, "WAIT_SECONDS", 1)
    built = []
    with pytest.raises(UserError, match="waited 0 min for .*a.u8, which the first process of this node builds"):
        cache.ensure_array(tmp_path / "a.u8", tmp_path / "a.json", "key", (4,), np.uint8, built.append, "--cache", "x")
    assert built == [] and list(tmp_path.iterdir()) == []


def test_a_damaged_cache_is_rebuilt(small_data, tmp_path, capsys):
    dataset = _dataset(small_data, 32)
    data_path = cached(dataset, 32, tmp_path, workers=0, show_progress=False).path
    with open(data_path, "r+b") as f:
        f.truncate(1000)
    cache = cached(dataset, 32, tmp_path, workers=0)
    assert f"{data_path} does not match its {data_path.with_suffix('.json').name} (truncated or deleted): rebuilding it" in \
        capsys.readouterr().out
    assert data_path.stat().st_size == 240 * 3 * 32 * 32 and torch.equal(cache[239][0], dataset[239][0])
    data_path.unlink()
    cached(dataset, 32, tmp_path, workers=0)
    assert "rebuilding it" in capsys.readouterr().out and data_path.exists()


def test_prepare_builds_the_cache_training_reads(exact_data, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    shutil.copytree(exact_data, data)
    code, out, err = in_process(prepare.main, [str(data), "--cache", str(tmp_path / "cache"), "--image-size",
                                               "64"], monkeypatch, capsys)
    assert code == 0, err
    path = cache_paths(tmp_path / "cache", 64, cache_key(_dataset(data, 64), 64))[0]
    assert f"cached 201 images at 64 px in {path}" in out
    args = parse_args("", ["--data-dir", str(data), "--image-size", "64", "--cache", str(tmp_path / "cache")])
    dataset = labelled_data(args).dataset
    assert f"reading images from the cache {path}" in capsys.readouterr().out
    assert len(dataset) == 201


def test_cache_folder_that_cannot_be_made(exact_data, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a folder")
    line = fails_in_process(train_single.main, ["--data-dir", str(exact_data), *EXACT, *VAL,
                                                "--checkpoint", str(tmp_path / "out" / "best.pth"),
                                                "--cache", str(tmp_path / "file" / "cache")],
                            monkeypatch, capsys, "cannot create it")
    assert line == f"error: --cache {tmp_path / 'file' / 'cache'}: cannot create it (Not a directory)"


def _smooth_photo(path, seed):
    """A 500x375 JPEG (the Kaggle photos' usual size) of smooth colour gradients."""
    yy, xx = np.mgrid[0:375, 0:500]
    pixels = np.stack([128 + 100 * np.sin(xx / 40 + seed), 128 + 100 * np.cos(yy / 30 + seed),
                       128 + 80 * np.sin((xx + yy) / 55)], -1)
    Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)


@pytest.mark.parametrize("size, mean, largest", [(32, 2.5, 12), (64, 1.0, 5), (112, 1.0, 5),
                                                 (224, 0, 0)])
def test_draft_decode_stays_close_to_a_full_decode(tmp_path, size, mean, largest):
    """docs/performance.md states this tolerance: mean and largest |difference| in uint8 pixel levels."""
    for seed in range(3):
        _smooth_photo(tmp_path / f"{seed}.jpg", seed)
        full = image_transform(size)(open_rgb(tmp_path / f"{seed}.jpg")).int()
        draft = image_transform(size)(open_rgb(tmp_path / f"{seed}.jpg", draft_size=size)).int()
        difference = (full - draft).abs().float()
        assert difference.mean() <= mean and difference.max() <= largest, (seed, difference.mean())
        if size <= 112:  # the draft did decode at a smaller scale
            assert not torch.equal(full, draft)


def test_channels_last_and_compile_take_effect_and_change_nothing(runs, far, tmp_path):
    """Other convolution kernels sum in another order: measured 7e-5 of `far` (the rounding floor
    of the modes). The weights were trained channels-last (best.pth keeps their strides), the
    batches are channels-last, and torch.compile compiled graphs."""
    log = runs.root / "compiled"
    out, _ = runs.exact("single", "--channels-last", "--compile", env={"COMPILE_LOG": str(log)})
    assert distance(last_model(out), last_model(mode_run(runs, "single")[0])) / far < TOLERANCE
    assert int(log.read_text()) >= 1, "torch.compile compiled nothing"
    for state in (weights(out), last_model(out)):
        assert not any(key.startswith("_orig_mod.") for key in state)
        assert state["features.0.weight"].is_contiguous(memory_format=torch.channels_last)
    batch = model_inputs(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.device("cpu"), channels_last=True)
    assert batch.is_contiguous(memory_format=torch.channels_last) and not batch.is_contiguous()


# Where a run in autocast's 16-bit floats ends, as a share of `far` (the float32 reference against a
# run with half the global batch). Below: TOLERANCE, the rounding floor of float32 runs that sum in
# another order (measured 7e-5, test_modes). Autocast rounds every convolution's inputs and output
# to 8 (bf16) or 11 (fp16) significant bits, 2^13 to 2^16 times float32's rounding, at every
# layer of every step: a run that did so cannot end inside float32's floor. Above: half of `far`.
# A run that took the same batches differs from the reference by its roundings only, a few
# percent of each gradient at most through the network's depth, where the other batches change
# each step's gradient altogether; a loss scale left in the update (x 65536) or skipped steps would
# be far beyond it. The window is wide because the rounding inside a kernel is the CPU's: measured
# bf16 0.025 (AMD EPYC and Intel Xeon with AMX), fp16 0.008 (AMD EPYC, fp16 emulated in float32)
# and 0.031 (Intel Xeon with AVX512-FP16, 2026-12-04). What only the feature can do is checked
# beside it: the dtypes inside the model (test_one_step.py), the fp16 scaler's state here.
LOW_PRECISION = (TOLERANCE, 0.5)


def test_bf16_really_runs_in_bf16_in_single_and_accelerate(runs, far):
    """--amp bf16 leaves float32's rounding floor and stays nearer float32 than another batch;
    accelerate's --mixed_precision bf16 ends where --amp bf16 does (the same ops in one process:
    measured 1e-7 to 4e-7 of far, within the modes' tolerance)."""
    reference = last_model(mode_run(runs, "single")[0])
    single = last_model(runs.exact("single", "--amp", "bf16")[0])
    low, high = LOW_PRECISION
    assert low < distance(single, reference) / far < high
    out, result = runs.exact("accelerate-bf16")
    assert "mixed precision bf16)" in result.stdout
    assert distance(last_model(out), single) / far < TOLERANCE
    assert all(t.dtype == torch.float32 for t in weights(out).values() if t.is_floating_point())


def test_fp16_scales_the_loss_and_stays_near_float32(runs, far):
    """fp16 autocast is slow on CPUs but runs, with every step taken by the gradient scaler: its
    scale stays at the initial 2^16 and its growth tracker counts the 10 steps, none skipped for an
    overflow (a disabled scaler saves no state)."""
    out, _ = runs.exact("dp", "--amp", "fp16")
    scaler = weights(out, "last.pth")["scaler"]
    assert scaler["scale"] == 65536.0 and scaler["_growth_tracker"] == 10  # 10 steps, none skipped
    low, high = LOW_PRECISION
    assert low < distance(last_model(out), last_model(mode_run(runs, "single")[0])) / far < high


@pytest.mark.parametrize("shape, channels_last", [((4, 3, 37, 21), False), ((3, 3, 16, 16), True)])
def test_normalize_in_place_gives_the_formulas_values_and_leaves_its_input(shape, channels_last):
    """normalize() divides, subtracts and divides in place on one float copy: every value is the one
    that (x.float() / 255 - mean) / std gives, bit for bit, in the layout asked for; and a float
    batch given to it (predict's and export's callers could pass one) comes back unchanged."""
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    source = images.contiguous(memory_format=torch.channels_last) if channels_last else images
    expected = (source.float() / 255 - mean) / std
    found = normalize(images, channels_last)
    assert torch.equal(found, expected) and found.stride() == expected.stride()
    floats = images.float()
    kept = floats.clone()
    assert torch.equal(normalize(floats), expected if not channels_last else (images.float() / 255 - mean) / std)
    assert torch.equal(floats, kept)
