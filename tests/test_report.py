"""The HTML report (python -m src.tools.report) opened in a real headless Chromium (Debian's
`chromium`, driven by Playwright): it loads from disk alone, every image decodes, its confusion
matrix and galleries are those of an independent computation, names from the disk show as text;
and the page of the five modes' runs shows their curves and distances within the tolerance."""
import base64
import csv
import json
import re
import shutil
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from browser import MISSING
from browser import find as find_chromium
from conftest import (
    EXACT,
    TOLERANCE,
    VAL,
    B,
    distance,
    fails_in_process,
    history,
    last_model,
    mode_run,
    printed_by,
)
from PIL import Image
from playwright.sync_api import sync_playwright

from src.history import best_record
from src.tools import predict, report

# Headless as root in a container: no sandbox, no GPU; nothing that would call out (QUIC, updates, sync).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDTH = 1280
HOSTILE = "<img src=x onerror=alert(1)>.jpg"
FOLDER = "run <b>&amp;</b>"  # a run folder's name that is markup too
MODES = ["single", "dp", "ddp", "accelerate", "fsdp"]


def chromium_or_skip() -> str:
    """Debian's chromium on PATH (Playwright's own browser download needs the network), which
    `make test` installs as root (checks/browser.py); elsewhere the browser tests are skipped,
    saying what to install."""
    path = find_chromium()
    if path is None:
        pytest.skip(MISSING)
    return path


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module (Playwright starts it with a fresh profile of its own)."""
    path = chromium_or_skip()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=path, args=FLAGS)
        yield chromium
        chromium.close()


def test_without_chromium_the_browser_tests_are_skipped_saying_what_to_install(tmp_path, monkeypatch):
    """Where chromium is not on PATH (and make test could not install it: not root), the tests
    that need the browser are skipped for that reason, never passed nor failed; where it is,
    Playwright gets its path."""
    if find_chromium() is None:
        pytest.skip(MISSING)
    assert chromium_or_skip() == find_chromium()
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match="^Debian's chromium is not installed .* sudo apt-get install "
                                                    "chromium$"):
        chromium_or_skip()


def open_page(browser, html: Path) -> tuple:
    """The page loaded from disk, and what it did: every request's URL, console errors and
    uncaught exceptions, and dialogs (alert())."""
    page = browser.new_context(viewport={"width": WIDTH, "height": 900}).new_page()
    seen = {"requests": [], "errors": [], "dialogs": []}
    page.on("request", lambda request: seen["requests"].append(request.url))
    page.on("console", lambda message: message.type == "error" and seen["errors"].append(message.text))
    page.on("pageerror", lambda error: seen["errors"].append(str(error)))
    page.on("dialog", lambda dialog: (seen["dialogs"].append(dialog.message), dialog.dismiss()))
    page.goto(html.as_uri(), wait_until="load")
    return page, seen


def assert_loaded_alone(page, seen, html: Path) -> list:
    """No request but the file itself and data: URIs, no error, no dialog, every image decoded;
    returns the images' (naturalWidth, alt)."""
    assert [url for url in seen["requests"] if not url.startswith("data:")] == [html.as_uri()], seen["requests"]
    assert seen["errors"] == [] and seen["dialogs"] == [], seen
    images = page.evaluate("[...document.images].map(i => [i.complete, i.naturalWidth, i.getAttribute('src').slice(0, 5)])")
    assert images and all(complete and width > 0 and src == "data:" for complete, width, src in images), images
    return images


@pytest.fixture(scope="module")
def single(browser, runs, module_tmp):
    """The report of the shared one-device run, copied into a folder named with markup, with
    --predictions of the exact set's test images and a copy of one named HOSTILE."""
    run_dir = module_tmp / FOLDER
    shutil.copytree(mode_run(runs, "single")[0], run_dir)
    mine = module_tmp / "mine"
    shutil.copytree(runs.exact_data / "test", mine)
    shutil.copy(mine / "1.jpg", mine / HOSTILE)
    predictions = module_tmp / "predictions.csv"
    printed_by(predict.main, [str(mine), "--checkpoint", str(run_dir / "best.pth"), "--output", str(predictions),
                              "--workers", "0"])
    html = module_tmp / "report.html"
    printed = printed_by(report.main, [str(run_dir), "--output", str(html), "--predictions", str(predictions),
                                       "--workers", "0"])
    page, seen = open_page(browser, html)
    yield {"run": run_dir, "html": html, "page": page, "seen": seen, "printed": printed,
           "predictions": predictions, "mine": mine}
    page.context.close()


def independent_validation(run: Path, data: Path) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The validation split's names, labels and logits, without src: the exact set's images in
    Kaggle's natural order, the seeded permutation's first share, decoded with Pillow as
    torchvision's Resize decodes them, through torchvision's model with best.pth."""
    names = sorted((p.name for p in (data / "train").iterdir()),
                   key=lambda name: (name.split(".")[0], int(name.split(".")[1])))
    n_val = round(len(names) * float(VAL[1]))
    val = sorted(torch.randperm(len(names), generator=torch.Generator().manual_seed(42))[:n_val].tolist())
    size = int(EXACT[EXACT.index("--image-size") + 1])
    images = []
    for i in val:
        with Image.open(data / "train" / names[i]) as image:
            image.draft("RGB", (size, size))
            rgb = image.convert("RGB").resize((size, size), Image.BILINEAR)
        images.append(torch.from_numpy(np.asarray(rgb, dtype=np.float32)).permute(2, 0, 1))
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    batch = (torch.stack(images) / 255 - mean) / std
    model = torchvision.models.squeezenet1_1(num_classes=2)
    model.load_state_dict(torch.load(run / "best.pth", weights_only=True))
    with torch.no_grad():
        logits = model.eval()(batch)
    labels = torch.tensor([int(names[i].startswith("dog")) for i in val])
    return [names[i] for i in val], labels, logits


def texts(page, selector: str) -> list[str]:
    return page.eval_on_selector_all(selector, "elements => elements.map(e => e.textContent)")


def test_the_report_loads_from_disk_alone_and_every_image_decodes(single):
    images = assert_loaded_alone(single["page"], single["seen"], single["html"])
    n_val = history(single["run"])[-1]["val_samples"]
    mine = len(list(single["mine"].iterdir()))
    # The curves, the reliability diagram, the two galleries' and the predictions' thumbnails.
    assert len(images) == 2 + 2 * min(report.GALLERY, n_val) + min(report.PREDICTED, mine)
    assert "open file://" in single["printed"]


def test_the_confusion_matrix_and_galleries_are_those_of_an_independent_computation(single, runs):
    page = single["page"]
    names, labels, logits = independent_validation(single["run"], runs.exact_data)
    predicted = logits.argmax(dim=1)
    cells = page.eval_on_selector_all("#run-1 table.confusion td[data-true]",
                                      "cells => cells.map(c => [c.dataset.true, c.dataset.predicted, c.textContent])")
    classes = ["cat", "dog"]
    assert {(t, p): int(count) for t, p, count in cells} == {
        (classes[t], classes[p]): int(((labels == t) & (predicted == p)).sum()) for t in (0, 1) for p in (0, 1)}
    # Training's own count of right answers at the epoch of best.pth.
    best = best_record(history(single["run"]), "val_acc")
    assert sum(int(count) for t, p, count in cells if t == p) == round(best["val_acc"] * best["val_samples"])

    loss = F.cross_entropy(logits, labels, reduction="none")
    uncertainty = (logits.softmax(dim=1)[:, 1] - 0.5).abs()
    for kind, key, sign in (("loss", loss, 1), ("uncertain", uncertainty, -1)):
        shown = [names.index(name) for name in texts(page, f"#run-1 .gallery.{kind} .name")]
        rest = [i for i in range(len(names)) if i not in shown]
        assert len(shown) == min(report.GALLERY, len(names))
        ranked = [sign * float(key[i]) for i in shown]
        slack = 1e-5  # float rounding of the report's batches of 100 against this batch of all
        assert all(a >= b - slack for a, b in pairwise(ranked)), (kind, ranked)
        assert min(ranked) >= max(sign * float(key[i]) for i in rest) - slack, kind


def test_names_from_the_disk_show_as_text_and_predictions_come_most_uncertain_first(single):
    page = single["page"]
    shown = texts(page, "#predictions .name")
    assert sum(name.endswith("/" + HOSTILE) for name in shown) == 1, shown
    assert FOLDER in texts(page, "#run-1 h2")[0]
    assert page.query_selector_all("img[src='x'], #run-1 h2 b") == []
    assert single["seen"]["dialogs"] == []
    with open(single["predictions"], newline="") as file:
        p_dog = {row["path"]: float(row["p_dog"]) for row in csv.DictReader(file)}
    assert len(shown) == len(p_dog) and [abs(p_dog[name] - 0.5) for name in shown] == \
        sorted(abs(p - 0.5) for p in p_dog.values())


def test_a_screenshot_of_the_whole_page(single, tmp_path):
    page = single["page"]
    page.screenshot(path=tmp_path / "report.png", full_page=True)
    height = page.evaluate("document.documentElement.scrollHeight")
    with Image.open(tmp_path / "report.png") as shot:
        assert shot.size == (WIDTH, height) and height > 1500
        assert len(shot.convert("RGB").getcolors(maxcolors=1 << 20)) > 1000  # plots and photos, not a blank page


def test_the_five_modes_page_shows_their_curves_and_distances_within_the_tolerance(browser, runs, module_tmp):
    """The five modes' runs of one job, the yardstick (conftest's far: the same job with half the
    global batch) and test_modes' control, the same flags without the per-epoch reshuffle (the seed's
    DDP bug, 0.065 of far away): the page draws every run's curves, calls every pair of modes within
    the tolerance, and every pair with the control beyond it."""
    folders = [mode_run(runs, mode)[0] for mode in MODES]
    yardstick = runs("single", *EXACT, *VAL, "--epochs", "2", "--batch-size", str(B))[0]
    control = runs.exact("single", env={"NO_RESHUFFLE": "1"})[0]
    html = module_tmp / "modes.html"
    printed_by(report.main, [*map(str, folders + [yardstick, control]), "--output", str(html), "--workers", "0"])
    page, seen = open_page(browser, html)
    try:
        assert_loaded_alone(page, seen, html)
        rows = page.eval_on_selector_all("#runs tr:not(:first-child)",
                                         "rows => rows.map(r => [...r.cells].map(c => c.textContent.trim()))")
        assert [(row[2], row[3]) for row in rows] == [("single", "1"), ("dp", "1"), ("ddp", "2"), ("accelerate", "2"),
                                                      ("fsdp", "2"), ("single", "1"), ("single", "1")]
        svg = base64.b64decode(page.get_attribute("#curves", "src").split(",", 1)[1]).decode()
        for number in range(1, len(rows) + 1):
            for key in ("train_loss", "val_loss", "val_acc", "lr"):
                line = re.search(rf'<g id="run{number}-{key}">\s*<path d="([^"]*)"', svg)
                assert line and len(re.findall(r"[ML] ", line.group(1))) == 2, (number, key)  # two epochs

        far = distance(last_model(folders[0]), last_model(yardstick))
        assert f"far = {far:.4g}" in texts(page, ".agreement")[0]
        pairs = page.eval_on_selector_all(".distances tr.pair", "rows => rows.map(r => [...r.cells].map(c => c.textContent.trim()))")
        compared = len(folders) + 1  # the yardstick has another global batch: not compared
        assert len(pairs) == compared * (compared - 1) // 2
        folder_of = dict(zip([row[0] for row in rows], folders + [yardstick, control]))
        for a, b, shown, _, share, verdict in pairs:
            first, second = folder_of[a], folder_of[b]
            d = distance(last_model(first), last_model(second))
            assert float(shown) == pytest.approx(d, rel=1e-3, abs=1e-12)
            assert float(share) == pytest.approx(d / far, rel=1e-2, abs=1e-12)
            if control in (first, second):
                assert float(share) > 20 * TOLERANCE and verdict == "beyond", (a, b, share)
            else:
                assert float(share) < TOLERANCE and verdict == "within", (a, b, share)
    finally:
        page.context.close()


def test_every_flag_shows_the_recipe_the_run_was_trained_with(reference, tmp_path):
    """The report of the full recipe's run: its flags section holds each flag as best.json records
    it, the modern augmentation's (--auto-augment and its options, --random-erase, --mixup-alpha,
    --cutmix-alpha) among them, with the values the run was given."""
    html = tmp_path / "report.html"
    printed_by(report.main, [str(reference), "--output", str(html), "--workers", "0"])
    page = html.read_text()
    section = page[page.index("every flag ("):page.index("</details>", page.index("every flag ("))]
    shown = dict(re.findall(r'<tr><th>--([a-z0-9-]+)</th><td class="path">([^<]*)</td></tr>', section))
    for flag, value in (("augment", "True"), ("auto-augment", "ta_wide"), ("ra-magnitude", "9"),
                        ("augmix-severity", "3"), ("random-erase", "0.25"), ("mixup-alpha", "0.2"),
                        ("cutmix-alpha", "1.0"), ("label-smoothing", "0.1")):
        assert shown.get(flag) == value, (flag, shown)
    flags = json.loads((reference / "best.json").read_text())["flags"]
    assert len(shown) == len(flags) and f"every flag ({len(flags)})" in page


# Bad input: one line, exit 2, nothing written.

def test_the_report_refuses_other_data_another_file_as_output_and_a_foreign_csv(runs, tmp_path, monkeypatch, capsys):
    run = mode_run(runs, "single")[0]
    fewer = tmp_path / "fewer"
    shutil.copytree(runs.exact_data, fewer)
    (fewer / "train" / "cat.0.jpg").unlink()
    output = tmp_path / "report.html"
    line = fails_in_process(report.main, [str(run), "--data-dir", str(fewer), "--output", str(output)],
                            monkeypatch, capsys, "are not those")
    assert str(fewer) in line and "--data-dir" in line and not output.exists()

    notes = tmp_path / "notes.html"
    notes.write_text("<p>mine</p>")
    fails_in_process(report.main, [str(run), "--output", str(notes)], monkeypatch, capsys,
                     "exists and is not a report of this tool")
    assert notes.read_text() == "<p>mine</p>"

    foreign = tmp_path / "foreign.csv"
    foreign.write_text("id,label\n1,0.5\n")
    fails_in_process(report.main, [str(run), "--output", str(output), "--predictions", str(foreign)],
                     monkeypatch, capsys, "expected predict's CSV")
