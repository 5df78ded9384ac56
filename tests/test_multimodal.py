"""Multimodal prefixes: the multimodal Qwen3.5 models over forests of rollouts with screenshots.

Every trajectory's logits, log-probs and gradients (the vision tower's included) equal the stock
``*ForConditionalGeneration`` forward of that trajectory alone, with its own images, at the design's
fp32 bounds (``tests/reference.py``): logits within 1e-4 of the fp64 truth (the stock model in fp64
with its delta-rule kernels exact), gradients within 1e-4 relative, or, for a parameter the stock
fp32 computation itself misses that by, within twice stock's own error. Through
:func:`harts.forward`, through :func:`harts.rollout_step` under budgets that cut inside and between
images, and through :func:`harts.forest_logprobs`.

The forest: a GUI agent's rollouts, a screenshot per turn, branches at turn boundaries, two
trajectories with the same token ids in front of different screenshots (which must not share
past the first image token), a duplicate, a text-only one. Then prefix identity, the vision tower
running once per step, and every refusal with its message.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import harts
from harts.runtime.forward_only import forest_and_masks
from harts.runtime.image_forest import image_forest, refuse_sharded
from harts.tiny import FAMILIES, VISION_LANGUAGE_FAMILIES, tiny_model, tiny_vision_language_model
from tests.reference import (
    GRAD_RTOL,
    LOGIT_ATOL,
    assert_gradients,
    exact_linear_kernels,
    functional_weights,
    grad_relative_errors,
    param_grads,
)

START, END, IMAGE, VIDEO = 122, 123, 124, 125  # the tiny configs' special tokens
ROW = 24  # values per pixel row: 3 channels x 2 frames x 2 x 2 pixels
SUM = harts.Normalizers(torch.tensor(1.0), torch.tensor(1.0))  # token mean over 1: the plain sum
FAMILY_PARAMS = [pytest.param(f, marks=pytest.mark.skipif(f not in FAMILIES, reason=f"{f} not installed"))
                 for f in VISION_LANGUAGE_FAMILIES]  # fmt: skip


@functools.cache
def vlm(family: str):
    return tiny_vision_language_model(family, seed=7)


def screenshot(seed: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
    """Random pixel rows of one image of grid (1, h, w), in the processor's row layout."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(h * w, ROW, generator=gen), [1, h, w]


def rollout(*parts, **annotations) -> harts.Rollout:
    """A rollout from text (lists of ids) and images (``screenshot``), each image wrapped in the
    vision start and end tokens with one image token per 2 x 2 patches, as the processor writes it."""
    tokens, pixels, grids = [], [], []
    for part in parts:
        if isinstance(part, tuple):
            rows, grid = part
            tokens += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END]
            pixels.append(rows)
            grids.append(grid)
        else:
            tokens += part
    if not pixels:
        return harts.Rollout(tokens, **annotations)
    return harts.Rollout(tokens, pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids),
                         **annotations)  # fmt: skip


A, B, B2, C = screenshot(1, 4, 6), screenshot(2, 4, 4), screenshot(3, 4, 4), screenshot(4, 6, 2)
SYSTEM, ASK = [3, 4, 5, 6, 7], [10, 11]


def gui_rollouts() -> list[harts.Rollout]:
    """One task's rollouts: screenshot A, an action, screenshot B (B2 on another branch: the same
    ids), branches at turn boundaries; a duplicate; a text-only trajectory beside them."""
    turn1 = [SYSTEM, A, ASK, [20, 21, 22]]
    return [
        rollout(*turn1, B, [12], [23, 24]),
        rollout(*turn1, B, [12], [25, 26, 27]),
        rollout(*turn1, B2, [12], [23, 24]),  # the ids of the first, another screenshot
        rollout(*turn1[:3], [30, 31], C, [13], B, [14, 15]),  # two images in one turn
        rollout(*turn1, B, [12], [23, 24]),  # a duplicate of the first
        rollout(SYSTEM, [40, 41, 42]),
    ]


# ---- the stock references: each trajectory alone, with its own images -------------------------
def stock_inputs(r: harts.Rollout) -> dict:
    ids = torch.as_tensor(r.tokens)[None]
    if r.pixel_values is None:
        return {"input_ids": ids}
    return {"input_ids": ids, "pixel_values": r.pixel_values, "image_grid_thw": r.image_grid_thw,
            "mm_token_type_ids": (ids == IMAGE).int()}  # fmt: skip


def stock_logits(model, r: harts.Rollout) -> torch.Tensor:
    inputs = stock_inputs(r)
    if next(model.parameters()).dtype == torch.float64 and "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].double()
    return model(**inputs).logits[0]


@functools.cache
def fp64_vlm(family: str):
    model = vlm(family)
    copy = tiny_vision_language_model(family, seed=7, dtype=torch.float64).double()
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def stock_grads(model, rollouts, loss_of) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each trajectory's logits and the gradients of ``sum_i loss_of(i, logits_i)``, one stock
    forward per trajectory (fp64 with exact kernels for the fp64 copy)."""
    model.zero_grad(set_to_none=True)
    exact = next(model.parameters()).dtype == torch.float64
    context = exact_linear_kernels(model) if exact else torch.enable_grad()
    logits = []
    with context:
        for i, r in enumerate(rollouts):
            out = stock_logits(model, r)
            loss_of(i, out).backward()
            logits.append(out.detach())
    return logits, param_grads(model)


def sft_loss(rollouts):
    def loss(i, logits):
        ids = torch.as_tensor(rollouts[i].tokens)
        return -torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).sum()

    return loss


@functools.cache
def sft_truth(family: str) -> tuple[float, dict, dict]:
    """(fp64 SFT sum, its fp64 gradients, stock fp32's) of the GUI rollouts, each trajectory alone."""
    rollouts = gui_rollouts()
    logits, exact = stock_grads(fp64_vlm(family), rollouts, sft_loss(rollouts))
    _, stock32 = stock_grads(vlm(family), rollouts, sft_loss(rollouts))
    return sum(float(sft_loss(rollouts)(i, lg)) for i, lg in enumerate(logits)), exact, stock32


# ---- equivalence ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_forward_logits_and_gradients_equal_stock(family):
    model, rollouts = vlm(family), gui_rollouts()
    weights = functional_weights([r.tokens for r in rollouts], model.config.text_config.vocab_size)

    def functional(i, logits):
        return (logits * weights[i].to(logits.dtype)).sum()

    exact_logits, exact = stock_grads(fp64_vlm(family), rollouts, functional)
    with torch.no_grad():
        stock32 = [stock_logits(model, r) for r in rollouts]
    model.zero_grad(set_to_none=True)
    out = harts.forward(model, image_forest(model, rollouts))
    loss, worst = 0.0, 0.0
    for i in range(len(rollouts)):
        logits = out.trajectory_logits(i)
        worst = max(worst, (logits.detach() - exact_logits[i]).abs().max().item(),
                    (logits.detach() - stock32[i]).abs().max().item())  # fmt: skip
        loss = loss + functional(i, logits)
    assert worst <= LOGIT_ATOL, f"max |logit diff| {worst:.3g}"
    loss.backward()
    got = param_grads(model)
    assert any(n.startswith("model.visual") and g.abs().sum() > 0 for n, g in got.items())
    assert_gradients(got, exact, lambda: stock_grads(model, rollouts, functional)[1])


@pytest.mark.parametrize("budget", [None, 3, 9])
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_rollout_step_under_budgets_equals_stock(family, budget):
    """The SFT sum through the one step: a budget of 3 tokens cuts inside the 6- and 4-token images,
    9 between them; the vision tower runs once per step whatever the cut."""
    model, rollouts = vlm(family), gui_rollouts()
    calls = []
    handle = model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    model.zero_grad(set_to_none=True)
    try:
        result = harts.rollout_step(model, rollouts, harts.PolicyLossConfig(kind="sft"), normalizers=SUM,
                                    budget_tokens=budget)  # fmt: skip
    finally:
        handle.remove()
    assert len(calls) == 1
    if budget is not None:
        assert max(result.tokens_per_micro_batch) <= budget
    ref, exact, stock32 = sft_truth(family)
    assert abs(float(result.loss) - ref) <= 1e-5 * max(1.0, abs(ref))
    assert_gradients(param_grads(model), exact, lambda: stock32)


@pytest.mark.parametrize("budget", [None, 4])
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_forest_logprobs_equal_stock(family, budget):
    model, rollouts = vlm(family), gui_rollouts()
    calls = []
    handle = model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    try:
        out = harts.forest_logprobs(model, rollouts, budget_tokens=budget)
    finally:
        handle.remove()
    assert len(calls) == 1
    exact = fp64_vlm(family)
    with torch.no_grad(), exact_linear_kernels(exact):
        for i, r in enumerate(rollouts):
            ids = torch.as_tensor(r.tokens)
            logp = torch.log_softmax(stock_logits(exact, r)[:-1], -1).gather(1, ids[1:, None])[:, 0]
            assert (out.logprobs[i][1:] - logp).abs().max().item() <= LOGIT_ATOL


# ---- prefix identity and positions --------------------------------------------------------------
def test_same_ids_with_another_screenshot_never_share():
    """Equal ids share a node only up to the first image token whose image differs; equal images
    share the whole path, and each distinct image is kept (and runs through the tower) once."""
    model = vlm("qwen3_5")
    same = [rollout(SYSTEM, B, [12, 13]), rollout(SYSTEM, B, [12, 14])]
    other = [rollout(SYSTEM, B, [12, 13]), rollout(SYSTEM, B2, [12, 13])]
    assert same[0].tokens[:-1] == other[1].tokens[:-1] and other[0].tokens == other[1].tokens
    merged, split = image_forest(model, same), image_forest(model, other)
    length = len(other[0].tokens)
    assert merged.num_tokens == length + 1 and merged.images.num_images == 1
    assert split.num_tokens == 2 * length - (len(SYSTEM) + 1) and split.images.num_images == 2
    assert harts.build_forest([r.tokens for r in other]).num_tokens == length  # ids alone would merge them
    for forest, rollouts in ((merged, same), (split, other)):
        for i, r in enumerate(rollouts):
            assert forest.trajectory(i).tolist() == list(r.tokens)
        logprobs = harts.forest_logprobs(model, forest).logprobs
        with torch.no_grad():
            for i, r in enumerate(rollouts):
                ids = torch.as_tensor(r.tokens)
                stock = torch.log_softmax(stock_logits(model, r)[:-1], -1).gather(1, ids[1:, None])[:, 0]
                assert (logprobs[i][1:] - stock).abs().max() <= LOGIT_ATOL


def test_distinct_images_and_the_flat_layout():
    model, rollouts = vlm("qwen3_5"), gui_rollouts()
    tree, flat = image_forest(model, rollouts), image_forest(model, rollouts, share_prefixes=False)
    occurrences = sum(len(r.image_grid_thw) for r in rollouts if r.image_grid_thw is not None)
    assert tree.images.num_images == 4 and flat.images.num_images == occurrences  # A, B, B2, C
    assert flat.num_tokens == flat.num_flat_tokens
    a = harts.forest_logprobs(model, tree).logprobs
    b = harts.forest_logprobs(model, flat).logprobs
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() <= 1e-5


def test_positions_are_the_stock_mrope_positions():
    """Text after an image continues from the image's grid extent, not from its token count; every
    token's three axes are what the stock get_rope_index gives its trajectory."""
    model, rollouts = vlm("qwen3_5"), gui_rollouts()
    forest = image_forest(model, rollouts)
    for i, r in enumerate(rollouts):
        ids = torch.as_tensor(r.tokens)[None]
        stock, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(),
                                              image_grid_thw=r.image_grid_thw)  # fmt: skip
        here = forest.images.token_positions[:, forest.trajectory_token_indices(i)]
        assert torch.equal(here, stock[:, 0])
    last = forest.trajectory_token_indices(0)[-1]
    assert int(forest.images.token_positions[0, last]) < int(forest.token_position[last])


def test_positions_that_disagree_on_a_shared_token_are_caught(monkeypatch):
    """The build checks that every trajectory through a token gives it the same position: a rotary
    index that depended on more than the prefix would fail there, not run."""
    from harts.adapters.qwen3_5_vision import Qwen3_5VisionLanguage

    stock = Qwen3_5VisionLanguage.rope_index
    calls = iter(range(100))
    monkeypatch.setattr(Qwen3_5VisionLanguage, "rope_index",
                        lambda self, *args: stock(self, *args) + next(calls))  # fmt: skip
    with pytest.raises(AssertionError, match="trajectory 0: a shared token's M-RoPE position differs"):
        image_forest(vlm("qwen3_5"), gui_rollouts())


# ---- checks before any compute -------------------------------------------------------------------
def _with(r: harts.Rollout, **changes) -> harts.Rollout:
    return dataclasses.replace(r, **changes)


BAD = {
    "one image token short": (lambda r: _with(r, tokens=[t for k, t in enumerate(r.tokens) if k != 7]),
                              "image tokens"),
    "pixel rows": (lambda r: _with(r, pixel_values=r.pixel_values[:-1]), "pixel_values has shape"),
    "row width": (lambda r: _with(r, pixel_values=r.pixel_values[:, :-1]), "patches of 24 values"),
    "grid shape": (lambda r: _with(r, image_grid_thw=r.image_grid_thw[:, :2]), "shape \\[n_images, 3\\]"),
    "grid merge": (lambda r: _with(r, image_grid_thw=torch.tensor([[1, 3, 8], [1, 4, 4]])), "merge size"),
    "grid alone": (lambda r: _with(r, pixel_values=None), "image_grid_thw without pixel_values"),
    "pixels alone": (lambda r: _with(r, image_grid_thw=None), "pixel_values without image_grid_thw"),
    "video": (lambda r: _with(r, tokens=[*r.tokens, VIDEO]), "video token"),
    "nan": (lambda r: _with(r, pixel_values=r.pixel_values.clone().fill_(float("nan"))), "NaN"),
    "integer pixels": (lambda r: _with(r, pixel_values=r.pixel_values.long()), "2-D float tensor"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_refused_naming_the_trajectory(case):
    change, message = BAD[case]
    rollouts = [rollout(SYSTEM, [40]), change(rollout(SYSTEM, A, ASK, B, [12]))]
    with pytest.raises(ValueError, match=f"trajectory 1.*{message}"):
        harts.rollout_step(vlm("qwen3_5"), rollouts, harts.PolicyLossConfig(kind="sft"))


def test_adjacent_images_and_mixed_dtypes_are_refused():
    model = vlm("qwen3_5")
    rows = torch.cat([A[0], B[0]])
    adjacent = harts.Rollout([*SYSTEM, START, *[IMAGE] * 10, END], pixel_values=rows,
                             image_grid_thw=torch.tensor([A[1], B[1]]))  # fmt: skip
    with pytest.raises(ValueError, match="trajectory 0, image 0: the run of image tokens at position 6"):
        image_forest(model, [adjacent])
    mixed = [rollout(SYSTEM, A), _with(rollout(SYSTEM, B), pixel_values=B[0].double())]
    with pytest.raises(ValueError, match="trajectory 1: pixel_values are torch.float64"):
        image_forest(model, mixed)


def test_images_without_their_model_are_refused():
    model, rollouts = vlm("qwen3_5"), gui_rollouts()
    text_model = tiny_model("qwen3_5")
    with pytest.raises(ValueError, match="has no vision tower"):
        harts.rollout_step(text_model, rollouts, harts.PolicyLossConfig(kind="sft"))
    with pytest.raises(ValueError, match="has no vision tower"):
        harts.forward(text_model, image_forest(model, rollouts))
    ids_alone = harts.build_forest([r.tokens for r in rollouts])
    with pytest.raises(ValueError, match="trajectory 0, position 6: token 124 is the model's image token"):
        harts.forward(model, ids_alone)
    with pytest.raises(ValueError, match="rollouts with images"):
        forest_and_masks(rollouts, True)  # the critic's and reward model's passes


def test_a_sharded_multimodal_model_is_refused():
    """FSDP2 shards parameters into DTensors; the sharded step gathers decoder units only."""

    class DTensor(torch.nn.Parameter):
        pass

    sharded = torch.nn.Module()
    sharded.weight = DTensor(torch.zeros(2))
    with pytest.raises(ValueError, match="sharded by FSDP2 is not supported"):
        refuse_sharded(sharded)


def test_text_rollouts_on_the_multimodal_model_equal_stock():
    model = vlm("qwen3_5")
    rollouts = [rollout(SYSTEM, [40, 41, 42]), rollout(SYSTEM, [40, 43])]
    forest = image_forest(model, rollouts)  # no images: path positions, no feature rows
    assert forest.images.num_images == 0 and bool((forest.images.token_feature_row == -1).all())
    for inputs in (rollouts, forest):
        out = harts.forest_logprobs(model, inputs, budget_tokens=3)
        with torch.no_grad():
            for i, r in enumerate(rollouts):
                ids = torch.as_tensor(r.tokens)
                stock = torch.log_softmax(stock_logits(model, r)[:-1], -1).gather(1, ids[1:, None])[:, 0]
                assert (out.logprobs[i][1:] - stock).abs().max() <= LOGIT_ATOL


@pytest.mark.skipif("qwen3_5_moe" not in FAMILIES, reason="qwen3_5_moe not installed")
def test_moe_statistics_with_images_equal_the_flat_batch():
    """Expert counts over image and text tokens equal the stock routers' over every trajectory
    alone; the load-balancing loss needs the whole step's statistics first (three passes), and the
    step with it cut inside images gives the unbudgeted step's loss and gradients."""
    model, rollouts = vlm("qwen3_5_moe"), gui_rollouts()
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3_5MoeTopKRouter"]
    chosen: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda m, a, out, k=k: chosen[k].append(out[2].reshape(-1)))
             for k, r in enumerate(routers)]  # fmt: skip
    with torch.no_grad():
        for r in rollouts:
            stock_logits(model, r)
    for h in hooks:
        h.remove()
    experts = model.config.text_config.num_experts
    stock = torch.stack([torch.bincount(torch.cat(c), minlength=experts) for c in chosen])
    config, grads, results = harts.PolicyLossConfig(kind="sft"), [], []
    for budget in (None, 3):
        model.zero_grad(set_to_none=True)
        results.append(
            harts.rollout_step(model, rollouts, config, budget_tokens=budget, moe=harts.MoEConfig())
        )
        grads.append(param_grads(model))
    for result in results:
        assert torch.equal(result.moe.expert_counts, stock)
        assert result.moe.aux_loss is not None
    assert abs(float(results[0].loss) - float(results[1].loss)) <= 1e-6
    assert abs(float(results[0].moe.aux_loss) - float(results[1].moe.aux_loss)) <= 1e-6
    errors = grad_relative_errors(grads[1], grads[0])
    assert max(errors.values()) <= GRAD_RTOL, max(errors, key=errors.get)


def test_rollout_files_with_images_are_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"tokens": [3, 4, 5], "pixel_values": [[0.5]], "image_grid_thw": [[1, 2, 2]]}\n')
    with pytest.raises(ValueError, match="line 1, field 'pixel_values': rollout files hold token ids"):
        harts.read_rollouts(path)


def test_gui_agent_bench_counts_the_vision_tower_once_per_distinct_image():
    """The benchmark's shape shares screenshots up to each branch turn; its FLOP model counts the
    tower per distinct image in the tree and per occurrence in the flat layout."""
    from harts.bench.gui_agent import GuiShape, gui_rollouts, measure

    shape = GuiShape(tasks=1, rollouts_per_task=3, turns=2, system_tokens=8, instruction_tokens=4,
                     action_tokens=3, grid=(4, 4))  # fmt: skip
    rollouts = gui_rollouts(vlm("qwen3_5"), shape)
    assert all(len(r.image_grid_thw) == shape.turns for r in rollouts)
    result = measure("qwen3_5", shape, budget=20, repeats=1, size="tiny")
    per_image = result["tower_flops_flat"] // result["images"]
    assert result["tower_flops_tree"] == per_image * result["distinct_images"]
    assert result["distinct_images"] < result["images"] == shape.rollouts_per_task * shape.turns
    assert result["ideal_speedup"] > 1 and result["redundancy"] > 1
