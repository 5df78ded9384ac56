"""Images in token-form rollout files: pixel rows under keys of a safetensors file, per line
``"images": [{"key": ..., "grid": [t, h, w]}, ...]``; read as the rollouts' ``pixel_values`` and
``image_grid_thw``, each image once per pass, every bad reference refused naming the file, the line
and the image."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import harts
from harts.data.rollout_files import iter_rollouts
from harts.data.rollout_images import ImageStore

START, END, IMAGE = 122, 123, 124  # the tiny multimodal configs' vision tokens
ROW = 24  # values per pixel row of the tiny vision tower


def pixels(seed: int, h: int, w: int) -> torch.Tensor:
    return torch.randn(h * w, ROW, generator=torch.Generator().manual_seed(seed))


def image_tokens(grid) -> list[int]:
    return [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END]


IMAGES = {"a": pixels(1, 4, 6), "b": pixels(2, 4, 4), "c": pixels(3, 6, 2)}
GRIDS = {"a": [1, 4, 6], "b": [1, 4, 4], "c": [1, 6, 2]}


def line(*parts, **fields) -> dict:
    """A token-form line from text (lists of ids) and image keys, with one image token per 2 x 2 patches."""
    tokens, images = [], []
    for part in parts:
        if isinstance(part, str):
            tokens += image_tokens(GRIDS[part])
            images.append({"key": part, "grid": GRIDS[part]})
        else:
            tokens += part
    record = {"tokens": tokens, "loss_mask": [0] + [1] * (len(tokens) - 1), **fields}
    return {**record, "images": images} if images else record


LINES = [
    line([3, 4, 5], "a", [10, 11, 20], group_id="g", reward=1.0),
    line([3, 4, 5], "a", [10, 11], "b", [12, 23], group_id="g", reward=0.0),
    line([3, 4, 5], "a", [10, 11], "c", [12, 25], group_id="g", reward=0.5),
    line([3, 4, 5, 40, 41], group_id="h", reward=1.0),  # text only
]


def write(tmp_path, lines=LINES, images=IMAGES, name="r") -> tuple:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    if images is not None:
        save_file(images, str(tmp_path / f"{name}.images.safetensors"))
    return path


def test_lines_read_with_their_images_in_order(tmp_path):
    rollouts = harts.read_rollouts(write(tmp_path))
    assert torch.equal(rollouts[0].pixel_values, IMAGES["a"])
    assert rollouts[0].image_grid_thw.tolist() == [GRIDS["a"]]
    assert torch.equal(rollouts[1].pixel_values, torch.cat([IMAGES["a"], IMAGES["b"]]))
    assert rollouts[1].image_grid_thw.tolist() == [GRIDS["a"], GRIDS["b"]]
    assert rollouts[1].image_grid_thw.dtype == torch.long
    assert rollouts[3].pixel_values is None and rollouts[3].image_grid_thw is None
    assert [r.tokens for r in rollouts] == [r["tokens"] for r in LINES]
    steps = list(harts.iter_rollout_steps(write(tmp_path), 2))
    assert [len(s) for s in steps] == [3, 1]  # the group kept whole
    assert torch.equal(steps[0][2].pixel_values, torch.cat([IMAGES["a"], IMAGES["c"]]))


def test_an_image_named_by_several_lines_is_read_once(tmp_path, monkeypatch):
    loads = []
    load = ImageStore._load
    monkeypatch.setattr(
        ImageStore, "_load", lambda self, at, file, key: loads.append(key) or load(self, at, file, key)
    )
    path = write(tmp_path, [line([3], "a", [5]), line([3], "a", [6]), line([3], "b", [7], "a", [8])])
    rollouts = harts.read_rollouts(path)
    assert loads == ["a", "b"]
    assert rollouts[0].pixel_values is rollouts[1].pixel_values  # the same tensor
    assert harts.read_rollouts(path)[0].pixel_values is not rollouts[0].pixel_values  # a new pass reads anew


def test_image_file_per_line_and_metadata(tmp_path):
    save_file({"x": IMAGES["b"]}, str(tmp_path / "shots.safetensors"))
    record = line([3], "b", [5], agent="v1")
    record["images"][0]["key"] = "x"
    path = write(tmp_path, [{**record, "image_file": "shots.safetensors"}], images=None)
    items = list(iter_rollouts(path))
    assert torch.equal(items[0].rollout.pixel_values, IMAGES["b"])
    assert items[0].metadata == {"agent": "v1"}  # the image fields are no metadata


def test_parquet_with_images(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_pylist(LINES[:3]), path)
    save_file(IMAGES, str(tmp_path / "r.images.safetensors"))
    rollouts = harts.read_rollouts(path)
    assert torch.equal(rollouts[2].pixel_values, torch.cat([IMAGES["a"], IMAGES["c"]]))


SECOND = r"r.jsonl, line 2, field 'images', image 1 \(key 'b'\): "
BAD = [
    ("no tensor file", None, {}, r"r.jsonl, line 1, field 'images', image 0 \(key 'a'\): no tensor file"),
    ("missing key", None, {"a": IMAGES["a"]}, SECOND + r"r.images.safetensors holds no tensor 'b'"),
    ("grid vs rows", [1, 4, 2], None, SECOND + r"grid \[1, 4, 2\] needs t \* h \* w = 8 pixel rows, but "
                                               r"r.images.safetensors holds 16"),
    ("bad grid", [1, 4], None, SECOND + r"'grid' must be \[t, h, w\]"),
    ("1-D rows", None, {**IMAGES, "b": torch.zeros(16)}, SECOND + r"the pixel rows must be a 2-D"),
    ("NaN", None, {**IMAGES, "b": torch.full((16, ROW), float("nan"))}, r"image 1 \(key 'b'\): .* NaN"),
    ("dtypes", None, {**IMAGES, "b": IMAGES["b"].double()}, r"image 1 \(key 'b'\): dtype torch.float64, but"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_images_are_refused_naming_file_line_and_image(tmp_path, case):
    _, grid, images, match = case
    second = line([3], "a", [4], "b", [5])
    if grid is not None:
        second["images"][1]["grid"] = grid
    path = write(tmp_path, [line([3], "a", [5]), second], images=IMAGES if images is None else images or None)
    with pytest.raises(ValueError, match=match):
        harts.read_rollouts(path)


def test_image_fields_out_of_place_are_refused(tmp_path):
    for record, match in [
        ({"tokens": [3, 4], "image_file": "x.safetensors"}, "field 'image_file': given, but the line has no"),
        ({"tokens": [3, 4], "images": []}, "field 'images': expected a non-empty list"),
        ({"tokens": [3, 4], "images": [{"key": "a"}]}, r"image 0: expected \{\"key\""),
        ({"tokens": [3, 4], "image": [{"key": "a", "grid": [1, 2, 2]}]}, "close to 'images'"),
        ({"messages": [{"role": "user", "content": "hi"}], "images": [{"key": "a", "grid": [1, 4, 6]}]},
         "field 'images': images are read in the token form only"),
        ({"tokens": [3, 4], "pixel_values": [[0.5]]}, "field 'pixel_values': rollout files hold token ids"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            harts.read_rollouts(write(tmp_path, [record]), tokenizer=None)


# ---- harts train on a multimodal checkpoint ---------------------------------------------------
def saved_vlm(tmp_path):
    from harts.tiny import VISION_LANGUAGE_FAMILIES, tiny_vision_language_model

    if "qwen3_5" not in VISION_LANGUAGE_FAMILIES:
        pytest.skip("qwen3_5 not installed")
    tiny_vision_language_model("qwen3_5", seed=7).save_pretrained(tmp_path / "vlm")
    return tmp_path / "vlm"


def image_run_config(tmp_path, model: dict, top: dict | None = None, **sections):
    from tests.helpers import write_config

    data = {"path": str(write(tmp_path)), "rollouts_per_step": 2}
    top = {"steps": 2, "max_grad_norm": 0.0, **(top or {})}
    return write_config(tmp_path / "run.toml", top, model=model, data=data,
                        optimizer={"lr": 1e-3, "weight_decay": 0.0}, **sections)  # fmt: skip


def test_harts_train_on_rollouts_with_images_equals_rollout_step(tmp_path):
    from transformers import AutoModelForImageTextToText

    from harts.trainer.inputs import own_memory
    from tests.helpers import run_train

    path = saved_vlm(tmp_path)
    assert run_train(image_run_config(tmp_path, {"path": str(path), "tiny": None}), tmp_path / "out") == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]

    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).train()
    own_memory(model)  # as harts train holds the weights it loads
    first = next(harts.iter_rollout_steps(write(tmp_path), 2))
    assert len(first) == 3 and first[1].pixel_values is not None
    result = harts.rollout_step(model, first, harts.PolicyLossConfig(kind="sft"))
    assert records[0]["loss"] == float(result.loss)

    trained = AutoModelForImageTextToText.from_pretrained(tmp_path / "out" / "checkpoints" / "step-000002")
    before, after = model.state_dict(), trained.state_dict()
    tower = [k for k in before if ".visual." in f".{k}"]
    assert tower and any(not torch.equal(before[k], after[k]) for k in tower)  # the vision tower trained


REFUSED = [
    ({"tiny": "llama"}, {}, "model.tiny = 'llama': .*line 1 carries images, and llama has no vision tower"),
    ({"tiny": "qwen3_5"}, {"lora": {"r": 4, "alpha": 8.0}}, r"\[lora\]: not with images yet \(.*line 1"),
    ({"tiny": "qwen3_5"}, {"objective": {"kind": "sft", "kl_coef": 0.1}, "reference": {"model": "initial"}},
     r"\[reference\]: not with images yet"),
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=["no tower", "lora", "reference"])
def test_harts_train_refuses_what_images_cannot_run_with(tmp_path, capsys, case):
    from tests.helpers import run_train

    model, sections, match = case
    assert run_train(image_run_config(tmp_path, model, **sections), tmp_path / "out") != 0
    assert re.search(match, capsys.readouterr().err), match
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_images_with_a_text_checkpoint_are_refused_before_it_loads(tmp_path, capsys):
    from harts.tiny import tiny_model
    from tests.helpers import run_train

    tiny_model("qwen3_5").save_pretrained(tmp_path / "text")
    config = image_run_config(tmp_path, {"path": str(tmp_path / "text"), "tiny": None})
    assert run_train(config, tmp_path / "out") != 0
    assert "is no multimodal model harts runs images on" in capsys.readouterr().err


def test_a_resumed_run_on_images_equals_the_uninterrupted_one(tmp_path):
    from safetensors.torch import load_file

    from tests.helpers import run_train

    path = saved_vlm(tmp_path)

    def config(steps: int):
        return image_run_config(tmp_path, {"path": str(path), "tiny": None}, top={"steps": steps},
                                checkpoint={"every": 1})  # fmt: skip

    assert run_train(config(2), tmp_path / "whole") == 0
    assert run_train(config(1), tmp_path / "half") == 0
    assert run_train(config(2), tmp_path / "half", "--resume") == 0  # loads step 1 as the multimodal model
    weights = [load_file(tmp_path / run / "checkpoints" / "step-000002" / "model.safetensors") for run in
               ("whole", "half")]  # fmt: skip
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
