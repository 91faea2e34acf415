"""Property tests: random mutations of a valid config and of a tiny COCO annotation file give
either a result or one clear error naming the file, never an exception from deep inside."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pycocotools.mask as mask_utils
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from rcnn_dropit.config import config_yaml, load_config
from rcnn_dropit.data import CocoDetection, build_transforms
from tests.helpers import FASTER_CFG

CLEAR_ERRORS = (ValueError, FileNotFoundError)
FUZZ = settings(
    # 200 in CI (make test); make test-fast, the inner loop, sets 50 (the first of the same ones)
    max_examples=int(os.environ.get("RCNN_DROPIT_FUZZ_EXAMPLES", "200")),
    # The same examples in every CI run, so that a run passes or fails by the code alone;
    # RCNN_DROPIT_FUZZ=explore draws new ones (how a polygon at 2e8 that needed 23 GB was found).
    derandomize=os.environ.get("RCNN_DROPIT_FUZZ") != "explore",
    deadline=None,
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# ---- random values and edits -----------------------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.integers(min_value=-3, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.sampled_from(["", "1e-3", "mink", "coco", "auto", "fp16", "[", "2001-13-01", "~", "0x10"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
SPECIAL = list(":-[]{}#&*!|>'\"%@`,?\n\t ") + ["\x00", "\u00e9", "\\"]
CHARS = st.one_of(st.sampled_from(SPECIAL), st.characters(max_codepoint=0x2FF))


def tree_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and list indexes) into a nested dict/list, the root included."""
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += tree_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += tree_paths(value, (*prefix, index))
    return out


def _parent(tree: Any, path: tuple) -> Any:
    for part in path[:-1]:
        tree = tree[part]
    return tree


def mutate_tree(data: st.DataObject, tree: Any) -> Any:
    """A copy of tree with a few random replacements, deletions and additions."""
    tree = copy.deepcopy(tree)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        paths = [p for p in tree_paths(tree) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        parent, last = _parent(tree, path), path[-1]
        action = data.draw(st.sampled_from(["replace", "delete", "add"]), label="action")
        if action == "replace":
            parent[last] = data.draw(VALUES, label="value")
        elif action == "delete":
            del parent[last]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8), label="new key")] = data.draw(VALUES)
        else:
            parent.append(data.draw(VALUES, label="new item"))
    return tree


def mutate_text(data: st.DataObject, text: str) -> str:
    """text with a few random character insertions, deletions and replacements."""
    for _ in range(data.draw(st.integers(1, 4), label="char edits")):
        pos = data.draw(st.integers(0, len(text)), label="position")
        action = data.draw(st.sampled_from(["insert", "delete", "replace"]), label="char action")
        char = data.draw(CHARS, label="char")
        if action == "insert":
            text = text[:pos] + char + text[pos:]
        elif action == "delete":
            text = text[:pos] + text[pos + 1 :]
        else:
            text = text[:pos] + char + text[pos + 1 :]
    return text


def assert_clear(err: BaseException, *names: str) -> None:
    """A user error (ValueError/FileNotFoundError) whose message names one of `names`."""
    assert isinstance(err, CLEAR_ERRORS), f"{type(err).__name__}: {err}"
    message = str(err)
    assert any(name in message for name in names), message


# ---- configs ---------------------------------------------------------------------------------

VALID_CONFIG = load_config(FASTER_CFG).to_dict()


def _write_config(tmp: Path, content: str | bytes) -> Path:
    path = tmp / "fuzz.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "replace"))
    return path


def _load(path: Path, overrides: list[str] = (), names: tuple[str, ...] = ()) -> None:
    """Load a mutated config: a clear error naming the file (or `names`), or a valid config."""
    try:
        cfg = load_config(path, overrides)
    except Exception as err:  # noqa: BLE001 - the property is about the exception's kind
        assert_clear(err, str(path), *names)
        return
    assert_round_trips(cfg, path)


def assert_round_trips(cfg, path: Path) -> None:
    """What loads is a complete, valid config: dumped and loaded again it is the same (compared
    as YAML text, where a NaN equals itself)."""
    again = path.parent / "round-trip" / path.name  # same stem: the same default name
    again.parent.mkdir(parents=True, exist_ok=True)
    again.write_text(config_yaml(cfg))
    dumped = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    assert yaml.safe_dump(load_config(again).to_dict(), sort_keys=False) == dumped


def test_the_unmutated_config_loads(tmp_path) -> None:
    cfg = load_config(_write_config(tmp_path, yaml.safe_dump(VALID_CONFIG)))
    assert cfg.to_dict() == VALID_CONFIG


@FUZZ
@given(data=st.data())
def test_config_tree_mutations(tmp_path, data) -> None:
    tree = mutate_tree(data, VALID_CONFIG)
    _load(_write_config(tmp_path, yaml.safe_dump(tree, allow_unicode=True)))


@FUZZ
@given(data=st.data())
def test_config_text_mutations(tmp_path, data) -> None:
    text = yaml.safe_dump(VALID_CONFIG, sort_keys=False)
    _load(_write_config(tmp_path, mutate_text(data, text)))


@FUZZ
@given(data=st.data(), raw=st.binary(max_size=3))
def test_config_overrides_and_bytes(tmp_path, data, raw) -> None:
    path = _write_config(tmp_path, yaml.safe_dump(VALID_CONFIG))
    keys = [".".join(map(str, p)) for p in tree_paths(VALID_CONFIG) if p]
    key = data.draw(st.one_of(st.sampled_from(keys), st.text(max_size=12)), label="key")
    value = data.draw(st.one_of(st.text(max_size=12), VALUES.map(json.dumps)), label="v")
    _load(path, [f"{key}={value}"], names=("override",))
    # a file that is not text at all
    _load(_write_config(tmp_path, b"name: x\n" + raw + b"\xff\xfe"))


# ---- annotation files ------------------------------------------------------------------------


def _png(path: Path, width: int, height: int) -> None:
    Image.fromarray(np.full((height, width, 3), 120, dtype=np.uint8)).save(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz_images")
    _png(folder / "a.png", 20, 10)
    _png(folder / "b.png", 8, 8)
    return folder


def _tiny_coco() -> dict:
    mask = np.zeros((8, 8), dtype=np.uint8, order="F")
    mask[2:5, 1:6] = 1
    compressed = mask_utils.encode(mask)["counts"].decode()
    return {
        "images": [
            {"id": 1, "file_name": "a.png", "width": 20, "height": 10},
            {"id": 2, "file_name": "b.png", "width": 8, "height": 8},
        ],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 3, "bbox": [2, 1, 6, 5], "area": 30,
             "iscrowd": 0, "segmentation": [[2, 1, 8, 1, 8, 6, 2, 6]]},
            {"id": 2, "image_id": 1, "category_id": 7, "bbox": [10, 2, 5, 4], "iscrowd": 0},
            {"id": 3, "image_id": 2, "category_id": 3, "bbox": [1, 2, 5, 3], "area": 15,
             "iscrowd": 0, "segmentation": {"size": [8, 8], "counts": compressed}},
            {"id": 4, "image_id": 2, "category_id": 7, "bbox": [0, 0, 2, 2], "area": 4,
             "iscrowd": 1, "segmentation": {"size": [8, 8], "counts": [0, 2, 6, 2, 54]}},
        ],
        "categories": [{"id": 3, "name": "circle"}, {"id": 7, "name": "square"}],
    }  # fmt: skip


def _read_all(images: Path, ann: Path, train: bool) -> None:
    """Build the dataset and load every item, as training or evaluation would."""
    try:
        ds = CocoDetection(images, ann, train=train, transforms=build_transforms(train, 0.5))
        for index in range(len(ds)):
            image, target = ds[(index, 1)]
            assert image.shape[0] == 3 and target["boxes"].shape[1] == 4
            assert len(target["masks"]) == len(target["labels"]) == len(target["boxes"])
        if not train:
            assert sorted(ds.coco.getImgIds()) == sorted(ds.image_ids)
    except Exception as err:  # noqa: BLE001
        assert_clear(err, str(ann), str(images))


def test_the_unmutated_annotations_load(tmp_path, images) -> None:
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps(_tiny_coco()))
    ds = CocoDetection(images, ann, train=False)
    assert len(ds) == 2 and [len(ds[i][1]["labels"]) for i in range(2)] == [2, 1]


@FUZZ
@given(data=st.data(), train=st.booleans())
def test_annotation_tree_mutations(tmp_path, images, data, train) -> None:
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps(mutate_tree(data, _tiny_coco())))
    _read_all(images, ann, train)


@FUZZ
@given(data=st.data(), train=st.booleans())
def test_annotation_text_mutations(tmp_path, images, data, train) -> None:
    ann = tmp_path / "instances.json"
    ann.write_text(mutate_text(data, json.dumps(_tiny_coco())), errors="replace")
    _read_all(images, ann, train)
