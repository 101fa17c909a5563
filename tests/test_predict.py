"""``python -m normvit_jax.predict`` on a folder of real image files: each image decoded once
(TensorFlow's decoder, evaluation's, for a JPEG or PNG stored as is; PIL, then TensorFlow on the
PNG of its pixels, only for the images prepare re-encodes), one batch of files in memory at a time,
and the predictions those of the model on the eval pipeline's pixels of each file (prepare's RGB
rule, then the eval geometry), unreadable files listed and skipped in file order."""
from __future__ import annotations

import csv
import io
import os

import numpy as np
import pytest
from PIL import Image

from normvit_jax import predict
from normvit_jax.data import images, tf_images
from normvit_jax.train import loop
from tests.conftest import tiny_demo_config


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    wd = str(tmp_path_factory.mktemp("predict") / "run")
    loop.train_and_evaluate(tiny_demo_config(total_steps=3, checkpoint_every=3, eval_every=3,
                                             **{"model.depth": 1}), wd)
    return wd


def _save(path, pixels: np.ndarray, fmt: str, **kw) -> None:
    Image.fromarray(pixels).save(path, fmt, **kw)


def _folder(root) -> list[str]:
    """RGB and gray JPEG/PNG files (stored as is), a palette PNG, a rotated JPEG and a PNG without
    its last chunk (re-encoded by prepare's rule), a truncated JPEG and a text file (unreadable),
    sorted as predict lists."""
    rng = np.random.default_rng(0)
    root.mkdir()
    for k in range(9):  # sizes around the 8x8 eval size: crops and resizes both ways
        h, w = 6 + 3 * k, 20 - k
        _save(root / f"rgb_{k}.jpg", rng.integers(0, 256, (h, w, 3), np.uint8), "JPEG")
        _save(root / f"rgb_{k}.png", rng.integers(0, 256, (h, w, 3), np.uint8), "PNG")
    _save(root / "gray.png", rng.integers(0, 256, (11, 9), np.uint8), "PNG")
    _save(root / "gray.jpg", rng.integers(0, 256, (13, 17), np.uint8), "JPEG")
    Image.fromarray(rng.integers(0, 256, (10, 12, 3), np.uint8)).convert("P").save(
        root / "palette.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: prepare turns the pixels, so it is re-encoded
    _save(root / "rotated.jpg", rng.integers(0, 256, (9, 14, 3), np.uint8), "JPEG", exif=exif)
    whole = (root / "rgb_3.jpg").read_bytes()
    (root / "truncated.jpg").write_bytes(whole[:len(whole) // 2])
    (root / "notes.jpg").write_text("not an image")
    whole = (root / "rgb_4.png").read_bytes()  # PIL reads it, TensorFlow does not: predict
    (root / "cut_end.png").write_bytes(whole[:-12])  # skipped it, prepare stored it as it was
    return predict.list_images(str(root))


def _reference(run: str, files: list[str]) -> tuple[dict, dict, list[str]]:
    """The model on each readable file's eval pixels, written out: prepare's rule on the file
    (images.load_file: the stored bytes), the eval geometry through TensorFlow, the softmax."""
    import jax
    from normvit_jax import checkpoints, models
    from normvit_jax.data import stats
    variables, config = checkpoints.load_variables(run)
    model = models.create(config.model, 10)
    geo, affine = predict.eval_geometry(config.data), predict._spec(config).affine
    pixels, out, bad = {}, {}, []
    for path in files:
        try:
            stored, _ = images.load_file(open(path, "rb").read())
            x, _ = tf_images.BatchDecoder(1)([stored], None, geo)
        except (images.BadImageError, tf_images.BadImageError):
            bad.append(path)
            continue
        pixels[path] = x[0]
        out[path] = np.asarray(jax.nn.softmax(model.apply(
            variables, stats.model_input(x, affine), train=False), -1))[0]
    return pixels, out, bad


def test_predict_decodes_each_image_once_a_batch_at_a_time(run, tmp_path, monkeypatch, capsys):
    files = _folder(tmp_path / "images")
    pixels, ref, bad = _reference(run, files)
    from normvit_jax import checkpoints
    geo = predict.eval_geometry(checkpoints.load_config(run).data)
    kept, x, _ = predict._decode(files, geo, tf_images.BatchDecoder(2))  # the same pixels
    assert kept == list(pixels) and (x == np.stack(list(pixels.values()))).all()
    assert sorted(os.path.basename(p) for p in bad) == ["notes.jpg", "truncated.jpg"]
    pil, tf_calls = [], []
    load_file, call = images.load_file, tf_images.BatchDecoder.__call__
    monkeypatch.setattr(images, "load_file", lambda data: pil.append(data) or load_file(data))
    monkeypatch.setattr(tf_images.BatchDecoder, "__call__",
                        lambda self, enc, *a, **k: tf_calls.append(len(enc)) or call(self, enc, *a,
                                                                                     **k))
    out = tmp_path / "preds.csv"
    rows, skipped = predict.main([f"--workdir={run}", f"--images={tmp_path / 'images'}",
                                  "--top_k=10", "--batch=4", f"--out={out}"])
    # decoded once: PIL decodes the three files prepare re-encodes, nothing else (headers only);
    # TensorFlow every readable file once, 4 per batch
    assert len(pil) == 3 and len(rows) == len(files) - 2 == 23
    assert max(tf_calls) <= 4 and sum(tf_calls) == len(rows), tf_calls
    assert [r["path"] for r in rows] == [p for p in files if p in ref]
    for r in rows:  # all 10 classes, named '0'..'9' (digits); the model ran on batches of 4
        got = dict(r["top"])  # there, of 1 here: the last bit may differ
        np.testing.assert_allclose([got[str(c)] for c in range(10)], ref[r["path"]], rtol=1e-6)
    assert [s.split(" (")[0] for s in skipped] == bad
    assert "not an image format PIL recognises" in skipped[0] and "Truncated" in skipped[1]
    with open(out) as f:
        lines = list(csv.reader(f))
    assert len(lines) == 24 and lines[1][0] == rows[0]["path"]
    assert lines[1][2] == f"{rows[0]['top'][0][1]:.6f}"



def test_list_images_follows_linked_folders_once_and_stops_at_a_loop(tmp_path):
    """--images=FOLDER with a linked sub-folder: its photos were left out silently (os.walk does
    not follow links); a link back up must not list the folder again (a loop)."""
    (tmp_path / "photos" / "trip").mkdir(parents=True)
    (tmp_path / "more").mkdir()
    for p in ("photos/a.jpg", "photos/trip/b.jpg", "more/c.jpg"):
        (tmp_path / p).write_bytes(b"x")
    (tmp_path / "photos" / "linked").symlink_to(tmp_path / "more")
    (tmp_path / "photos" / "trip" / "up").symlink_to("..")
    got = predict.list_images(str(tmp_path / "photos"))
    assert [os.path.relpath(p, tmp_path / "photos") for p in got] == [
        "a.jpg", "linked/c.jpg", "trip/b.jpg"]


def test_a_file_tensorflow_refuses_and_pil_reads_is_named_so():
    """The reason predict gives when TensorFlow refuses a file whose header said it is kept: PIL's
    own error when PIL fails too, else that the file may be cut short (a PNG without its last
    chunk, which the header check no longer keeps, is the known case)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 5, 3), 7, np.uint8)).save(buf, "PNG")
    assert "cut short" in images.undecodable(buf.getvalue()[:-12])
    assert images.undecodable(buf.getvalue()[:40]) == "not an image format PIL recognises"


def test_images_paths_may_hold_commas(tmp_path):
    """--images is comma-separated, and a photo folder named 'Paris, France' was split in two and
    refused ('Paris is neither a file nor a folder'); the longest run of parts that exists is
    one path."""
    (tmp_path / "Paris, France").mkdir()
    (tmp_path / "Paris").mkdir()  # a shorter existing prefix is not taken instead
    for p in ("Paris, France/a.jpg", "Paris/b.jpg", "c.jpg"):
        (tmp_path / p).write_bytes(b"x")
    got = predict.list_images(f"{tmp_path}/Paris, France, {tmp_path}/c.jpg,,{tmp_path}/Paris")
    assert [os.path.relpath(p, tmp_path) for p in got] == ["Paris, France/a.jpg", "c.jpg",
                                                          "Paris/b.jpg"]
    with pytest.raises(FileNotFoundError, match=r"/Nice is neither a file nor a folder \(--images "
                       "is split at commas\\)$"):
        predict.list_images(f"{tmp_path}/c.jpg,{tmp_path}/Nice, France")


def test_a_file_name_that_is_not_utf8_is_printed_and_written_to_the_csv(run, tmp_path, capsys):
    """A photo named in cp1252 bytes (caf\\xe9.jpg from an old Windows zip): the CSV, written
    as UTF-8, stopped with a UnicodeEncodeError after every image was predicted."""
    folder = os.fsencode(tmp_path / "photos")
    os.mkdir(folder)
    Image.fromarray(np.full((9, 9, 3), 90, np.uint8)).save(os.path.join(folder, b"caf\xe9.png"))
    out = tmp_path / "preds.csv"
    predict.main([f"--workdir={run}", f"--images={tmp_path / 'photos'}", f"--out={out}"])
    printed = capsys.readouterr().out
    printed.encode("utf-8")  # printable in a UTF-8 terminal (strict): no lone surrogate
    assert f"{tmp_path}/photos/caf\\xe9.png: " in printed
    row = out.read_bytes().splitlines()[1]  # the file's own bytes: the path that opens it
    assert row.startswith(os.path.join(folder, b"caf\xe9.png") + b",")


def test_a_video_in_images_is_skipped_from_its_first_bytes(tmp_path):
    """--images=CAMERA_ROLL: a video was read whole into memory before being skipped."""
    video = tmp_path / "VID_0001.MP4"
    with open(video, "wb") as f:
        f.write(b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom")
        f.truncate(64 << 20)  # sparse
    with pytest.raises(images.BadImageError, match=r"^a video \(MP4/MOV\), not an image$"):
        predict._encoded(str(video))


def test_a_strip_that_eval_resize_small_would_blow_up_is_skipped_with_its_reason(tmp_path):
    """A 3x10000 PNG with data.eval_resize_small=256 was resized to 256x853,333 (~4 GB, ~20 s);
    serve refused it (413). predict now skips it with serve's reason, and keeps the others."""
    from normvit_jax.data.sources import Geometry  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(3)
    strip, normal = str(tmp_path / "strip.png"), str(tmp_path / "ok.png")
    _save(strip, rng.integers(1, 255, (3, 10000, 3), dtype=np.uint8), "PNG")
    _save(normal, rng.integers(1, 255, (12, 10, 3), dtype=np.uint8), "PNG")
    geo = Geometry(8, False, 1.0, 1.0, resize_small=256)
    kept, x, bad = predict._decode([strip, normal], geo, tf_images.BatchDecoder(1))
    assert kept == [normal] and x.shape == (1, 8, 8, 3)
    assert len(bad) == 1 and bad[0].startswith(f"{strip} (image of 10000x3 is resized to "), bad
    assert "(eval_resize_small=256), over the limit of 50,000,000 pixels" in bad[0], bad
    _, alone, _ = predict._decode([normal], geo, tf_images.BatchDecoder(1))
    np.testing.assert_array_equal(x, alone)  # the kept image's pixels do not depend on the skip


def test_a_photo_over_serves_pixel_limit_as_it_is_is_still_predicted(tmp_path, monkeypatch):
    """Only a resize that explodes is refused: a 61 MP camera photo on disk is the user's own
    file (serve refuses it as a request over --max_pixels; predict skipped it too at first).
    The limit is lowered here so that a 12x10 image stands for the large photo."""
    from normvit_jax import serve  # pylint: disable=import-outside-toplevel
    from normvit_jax.data.sources import Geometry  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(serve, "DEFAULT_MAX_PIXELS", 100)
    photo = str(tmp_path / "photo.png")
    _save(photo, np.random.default_rng(4).integers(1, 255, (12, 10, 3), dtype=np.uint8), "PNG")
    kept, x, bad = predict._decode([photo], Geometry(8, False, 1.0, 1.0),
                                   tf_images.BatchDecoder(1))
    assert kept == [photo] and not bad and x.shape == (1, 8, 8, 3)
    kept, _, bad = predict._decode([photo], Geometry(8, False, 1.0, 1.0, resize_small=16),
                                   tf_images.BatchDecoder(1))  # 12x10 -> 19x16 = 304 > 100
    assert kept == [] and "over the limit of 100 pixels" in bad[0], bad


def test_top_k_out_of_range_and_eval_flags_are_refused_by_the_flag_typed(run, tmp_path, capsys):
    """--top_k=20 of 10 classes silently showed 10 (serve answers 400 'from 1 to 10'); --mode=eval
    refusals named config.data.eval_split / eval_name, keys the user never typed."""
    _save(tmp_path / "a.png", np.zeros((8, 8, 3), np.uint8), "PNG")
    for argv, line in (
            (["--images=" + str(tmp_path / "a.png"), "--top_k=20"],
             "--top_k=20: must be an integer from 1 to 10 (the number of classes)"),
            (["--mode=eval", "--split=tset"], "--split=tset"),
            (["--mode=eval", "--name=tiny"], "--name=tiny")):
        with pytest.raises(SystemExit) as e:
            predict.main([f"--workdir={run}"] + argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"python -m normvit_jax.predict: error: {line}"), err
        assert "config.data" not in err[0].split(";")[0], err


def test_out_in_folders_that_do_not_exist_yet_is_written(tmp_path):
    """--out=new/dir/x.csv passed check_output (missing folders will be made), then every image
    was predicted and the write raised FileNotFoundError: a traceback, exit 1, results lost."""
    out = tmp_path / "new" / "dir" / "x.csv"
    predict.write_csv([{"path": "a.jpg", "top": [("cat", 0.75)]}], str(out), 1)
    assert list(csv.reader(open(out, encoding="utf-8"))) == [["path", "class_1", "prob_1"],
                                                              ["a.jpg", "cat", "0.750000"]]


def test_out_on_a_full_disk_is_one_line_and_leaves_the_old_csv(run, tmp_path, monkeypatch, capsys):
    """--out on a full disk was a traceback, exit 1, and a 0-byte CSV (opened with "w" before the
    write failed). Now the CSV is written to a temporary name and renamed: one line, exit 2, no
    temporary file, a CSV already there untouched."""
    import errno

    class FullWriter:
        def __init__(self, f):
            self.f = f

        def writerow(self, row):
            self.f.write("path,")
            raise OSError(errno.ENOSPC, "No space left on device")

    _folder(tmp_path / "images")
    out = tmp_path / "preds.csv"
    out.write_text("old results\n")
    monkeypatch.setattr(predict.csv, "writer", FullWriter)
    with pytest.raises(SystemExit) as e:
        predict.main([f"--workdir={run}", f"--images={tmp_path / 'images'}", f"--out={out}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(
        "(OSError: [Errno 28] No space left on device); free disk space or pass another --out")
    assert out.read_text() == "old results\n"
    assert sorted(os.listdir(tmp_path)) == ["images", "preds.csv"]


def _digit_folders(root, classes=(3, 7), per_class=4) -> dict[str, str]:
    """Real digits (scikit-learn's 8x8, as PNG) in class folders named as the run's classes, one of
    each class a folder deeper (still its class); {path: true class}."""
    from sklearn.datasets import load_digits
    d = load_digits()
    truth = {}
    for c in classes:
        for k, i in enumerate(np.flatnonzero(d.target == c)[:per_class]):
            folder = root / str(c) / ("2024" if k == 0 else "")
            folder.mkdir(parents=True, exist_ok=True)
            px = (d.images[i] * 255 / 16).astype(np.uint8)
            _save(folder / f"{i}.png", np.stack([px] * 3, -1), "PNG")
            truth[str(folder / f"{i}.png")] = str(c)
    return truth


def test_labels_from_folders_score_each_image_against_its_folder(run, tmp_path, capsys):
    """--labels=folders: new photos sorted into class folders, scored without preparing a
    dataset: each row's true class and whether the top-1 is right (also in the CSV), the top-1
    over them, every wrong image, and the confusion matrix beside --out; all from the model's
    own outputs computed here."""
    truth = _digit_folders(tmp_path / "new")
    _, ref, bad = _reference(run, sorted(truth))
    assert not bad
    top1 = {p: str(int(np.argmax(v))) for p, v in ref.items()}
    right = [p for p in sorted(truth) if top1[p] == truth[p]]
    assert 0 < len(right) < 8, top1  # right and wrong rows both checked
    out = tmp_path / "p.csv"
    rows, _ = predict.main([f"--workdir={run}", f"--images={tmp_path / 'new'}", "--top_k=2",
                            "--labels=folders", f"--out={out}"])
    printed = capsys.readouterr().out.splitlines()
    order = [r["path"] for r in rows]  # as --images lists a folder: its files, then sub-folders
    assert sorted(order) == sorted(truth)
    assert [(r["true"], r["correct"]) for r in rows] == [(truth[p], p in right) for p in order]
    summary = next(line for line in printed if line.startswith("labelled by their folders"))
    assert summary.startswith(f"labelled by their folders: top-1 {len(right) / 8:.2%} "
                              f"({len(right)} of 8), in the top 2 "), summary
    wrong = [line for line in printed if line.startswith("wrong: ")]
    assert [line.split(": ")[1] for line in wrong] == [p for p in order if p not in right]
    for line in wrong:
        path = line.split(": ")[1]
        assert line.endswith(f": {truth[path]}, taken for {top1[path]} "
                             f"{ref[path][int(top1[path])]:.3f}"), line
    table = list(csv.reader(open(out, encoding="utf-8")))
    assert table[0] == ["path", "true_class", "correct", "class_1", "prob_1", "class_2", "prob_2"]
    assert [(r[0], r[1], r[2], r[3]) for r in table[1:]] == [
        (p, truth[p], str(int(p in right)), top1[p]) for p in order]
    picture = tmp_path / "p_confusion.png"
    assert f"wrote the confusion matrix to {picture}" in printed
    assert Image.open(picture).size[0] > 200
    grid = tmp_path / "p_wrong.png"  # the wrong images as the model saw them, a cell each
    assert f"wrote the wrong images to {grid}" in printed
    w, h = Image.open(grid).size
    assert w >= 1.9 * 80 * min(6, 8 - len(right)) - 1 and h > 150, (w, h)
    assert not list(tmp_path.glob("*.tmp"))


def test_the_wrong_images_picture_draws_file_names_as_they_are(run, tmp_path):
    """A photo named 'a$\\foo$.png' (TeX math to matplotlib: 'Unknown symbol' at savefig)."""
    from normvit_jax import checkpoints, labelled
    path = tmp_path / "3" / "a$\\foo$.png"
    path.parent.mkdir()
    _save(path, np.full((8, 8, 3), 200, np.uint8), "PNG")
    row = {"path": str(path), "true": "3", "correct": False, "top": [("$5", 0.5)]}
    geo = predict.eval_geometry(checkpoints.load_config(run).data)
    assert labelled._wrong_picture([row], geo, "run $\\bar$", str(tmp_path / "w.png"))
    assert Image.open(tmp_path / "w.png").size[0] > 100


def test_labels_from_folders_refuse_what_they_cannot_score(run, tmp_path, capsys):
    truth = _digit_folders(tmp_path / "new", classes=(3,), per_class=2)
    (tmp_path / "new" / "cat").mkdir()
    _save(tmp_path / "new" / "cat" / "c.png", np.zeros((8, 8, 3), np.uint8), "PNG")
    loose = tmp_path / "loose"
    loose.mkdir()
    _save(loose / "x.png", np.zeros((8, 8, 3), np.uint8), "PNG")
    for argv, line in (
            ([f"--images={tmp_path / 'new'}"], "--labels=folders: the folder(s) 'cat' are not "
             "classes of the run (its classes: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9); name each class "
             "folder as the class it holds"),
            ([f"--images={loose}"], f"--labels=folders: 1 image(s) are not in a class folder, "
             f"e.g. {loose / 'x.png'}; put each in a folder named as its class"),
            ([f"--images={tmp_path / 'new' / '3'}"], f"--labels=folders: 1 image(s) are not in a "
             f"class folder, e.g. {next(p for p in truth if '2024' not in p)}; "
             f"{tmp_path / 'new' / '3'} is itself the class folder of '3': pass "
             f"--images={tmp_path / 'new'}, the folder that holds the class folders"),
            (["--mode=eval"], "--labels=folders labels --images by their folders; --mode=eval")):
        with pytest.raises(SystemExit) as e:
            predict.main([f"--workdir={run}", "--labels=folders"] + argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"python -m normvit_jax.predict: error: {line}"), err
    # a file named on its own: its folder is its class
    one = next(p for p in truth if "2024" not in p)
    rows, _ = predict.main([f"--workdir={run}", f"--images={one}", "--labels=folders"])
    assert rows[0]["true"] == "3"
