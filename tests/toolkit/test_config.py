"""Config loading: inheritance, merging, overrides, typing, validation and error messages."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from dropit_core import REGISTRY, STRATEGIES
from rcnn_dropit.config import Config, config_from_dict, config_yaml, load_config, with_overrides
from rcnn_dropit.config_schema import DropITConfig
from tests.helpers import REPO

CONFIGS = REPO / "configs"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Two bases in a sub-folder, one including a third; a leaf on top of both."""
    write(tmp_path / "base/root.yaml", "model:\n  num_classes: 5\n  min_size: 300\n")
    write(
        tmp_path / "base/model.yaml",
        "_base_: root.yaml\nmodel:\n  arch: fasterrcnn\n  min_size: 400\n"
        "dropit:\n  strategy: parallel_mink\n  options: {chunk: 8, values: int8}\n",
    )
    write(tmp_path / "base/solver.yaml", "solver:\n  lr: 0.01\n  lr_steps: [3, 5, 7]\n")
    return write(
        tmp_path / "leaf.yaml",
        "_base_: [base/model.yaml, base/solver.yaml]\n"
        "model:\n  max_size: 500\nsolver:\n  lr_steps: [2]\ndropit:\n  options: {chunk: 16}\n",
    )


def test_defaults_match_contract():
    cfg = Config()
    assert cfg.model.arch == "maskrcnn" and cfg.model.trainable_layers == 3
    assert cfg.dropit.exclude[0] == "backbone.body.conv1" and cfg.dropit.include == ["*"]
    assert cfg.data.shapes.image_size == 128 and cfg.solver.lr_steps == [16, 22]
    assert cfg.solver.max_iters is None and cfg.test.score_thresh == 0.05


def test_inheritance_multi_base_and_deep_merge(tree: Path):
    cfg = load_config(tree)
    assert cfg.model.arch == "fasterrcnn"  # from base/model.yaml
    assert cfg.model.num_classes == 5  # from base/root.yaml, two levels down
    assert cfg.model.min_size == 400  # the nearer base wins
    assert cfg.model.max_size == 500  # leaf
    assert cfg.model.backbone == "resnet50"  # schema default
    assert cfg.solver.lr == 0.01
    assert cfg.solver.lr_steps == [2]  # lists replace, never concatenate
    assert cfg.dropit.options == {"chunk": 16, "values": "int8"}  # dicts merge
    assert cfg.name == "leaf"  # run name defaults to the file stem


def test_overrides_are_typed(tree: Path):
    cfg = load_config(
        tree,
        [
            "solver.lr=1e-4",  # YAML reads this as text; the schema makes it a float
            "solver.momentum=0",  # int -> float
            "solver.max_iters=100",
            "solver.clip_grad_norm=null",
            "solver.lr_steps=[4, 8]",
            "dropit.enabled=true",
            "dropit.include=backbone.*",  # one pattern -> a list of one
            "dropit.options.values=fp16",  # into the dict, keeping chunk
            "data.shapes.num_train=7",
            "name=2017",  # text key: taken as text
            "train.output_dir=/tmp/run",
        ],
    )
    assert cfg.solver.lr == pytest.approx(1e-4) and isinstance(cfg.solver.lr, float)
    assert cfg.solver.momentum == 0.0 and isinstance(cfg.solver.momentum, float)
    assert cfg.solver.max_iters == 100 and cfg.solver.clip_grad_norm is None
    assert cfg.solver.lr_steps == [4, 8]
    assert cfg.dropit.enabled is True and cfg.dropit.include == ["backbone.*"]
    assert cfg.dropit.options == {"chunk": 16, "values": "fp16"}
    assert cfg.data.shapes.num_train == 7 and cfg.data.shapes.image_size == 128
    assert cfg.name == "2017" and cfg.train.output_dir == "/tmp/run"


def test_scientific_notation_in_file_is_a_float(tmp_path: Path):
    cfg = load_config(write(tmp_path / "c.yaml", "solver:\n  lr: 1e-3\n  weight_decay: 5e-5\n"))
    assert cfg.solver.lr == pytest.approx(1e-3) and cfg.solver.weight_decay == pytest.approx(5e-5)


def test_unknown_key_in_file_suggests(tmp_path: Path):
    path = write(tmp_path / "typo.yaml", "model:\n  backbon: resnet18\n")
    with pytest.raises(ValueError) as err:
        load_config(path)
    msg = str(err.value)
    assert "'model.backbon'" in msg and "did you mean 'model.backbone'" in msg
    assert "typo.yaml" in msg


def test_unknown_key_in_base_names_the_base(tree: Path):
    write(tree.parent / "base/solver.yaml", "solver:\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"base/solver\.yaml.*'solver\.learning_rate'"):
        load_config(tree)


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        (
            "data.shapes.num_trian=3",
            r"'data\.shapes\.num_trian'.*did you mean 'data\.shapes\.num_train'",
        ),
        ("solvr.lr=0.1", r"'solvr'.*did you mean 'solver'"),
        ("solver.lr", r"expected key=value"),
    ],
)
def test_bad_override_keys(override: str, pattern: str):
    with pytest.raises(ValueError, match=pattern):
        load_config(CONFIGS / "maskrcnn_baseline.yaml", [override])
    # a path of the wrong kind is named as what it is, not as missing
    with pytest.raises(ValueError, match="config file '.*configs' is a folder, not a file"):
        load_config(CONFIGS)
    # a string where the list goes is one message, not one "override" per character
    with pytest.raises(ValueError, match="give a list of 'key=value' strings, not the string"):
        load_config(CONFIGS / "maskrcnn_baseline.yaml", "solver.lr=0.1")


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("solver.lr=fast", r"solver\.lr = 'fast'.*expected a finite number"),
        ("dropit.enabled=1", r"dropit\.enabled = 1.*expected true or false"),
        ("model.trainable_layers=2.5", r"model\.trainable_layers = 2\.5.*expected an integer"),
        ("solver.lr_steps=[1, x]", r"solver\.lr_steps\[1\] = 'x'.*expected an integer"),
        ("dropit.options=3", r"dropit\.options = 3.*mapping"),
        ("model=resnet", r"model = 'resnet'.*mapping"),
        # non-finite numbers: inf passed every range check and trained to nan
        ("solver.lr=inf", r"solver\.lr = 'inf'.*expected a finite number"),
        ("solver.weight_decay=.nan", r"solver\.weight_decay = nan.*expected a finite number"),
        ("solver.clip_grad_norm=1e400", r"solver\.clip_grad_norm.*expected a finite number"),
    ],
)
def test_wrong_types(override: str, pattern: str):
    with pytest.raises(ValueError, match=pattern):
        load_config(CONFIGS / "maskrcnn_baseline.yaml", [override])


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        (
            "dropit.gamma=1.0",
            r"dropit\.gamma = 1\.0 is out of range; it must be >= 0\.0 and < 1\.0",
        ),
        ("dropit.gamma=-0.1", r"dropit\.gamma"),
        ("dropit.strategy=topk", r"dropit\.strategy = 'topk' is not one of mink"),
        ("model.arch=retinanet", r"model\.arch = 'retinanet' is not one of maskrcnn, fasterrcnn"),
        ("model.norm=ln", r"model\.norm"),
        ("model.heads=v3", r"model\.heads"),
        ("model.head_norm=frozen_bn", r"model\.head_norm"),
        ("model.trainable_layers=6", r"model\.trainable_layers = 6"),
        ("solver.lr=0", r"solver\.lr = 0\.0 is out of range"),
        ("solver.batch_size=0", r"solver\.batch_size"),
        ("solver.epochs=0", r"solver\.epochs"),
        ("solver.optimizer=adam", r"solver\.optimizer"),
        ("solver.amp=fp8", r"solver\.amp"),
        ("solver.lr_steps=[22, 16]", r"solver\.lr_steps \[22, 16\]: must be positive and strictly"),
        ("train.device=tpu", r"train\.device"),
        ("data.dataset=voc", r"data\.dataset"),
        ("model.max_size=100", r"model\.max_size \(100\) must be >= model\.min_size \(800\)"),
        # outputs/<name> must stay one folder inside outputs/
        ("name=/tmp/elsewhere", r"name '/tmp/elsewhere': must be a folder name"),
        ("name=../up", r"name '\.\./up'"),
        ("name=.hidden", r"name '\.hidden'"),
    ],
)
def test_validation(override: str, pattern: str):
    """Each bad value is rejected with a message naming the key, the value and what is allowed."""
    with pytest.raises(ValueError, match=pattern):
        load_config(CONFIGS / "maskrcnn_baseline.yaml", [override])


def test_shapes_class_count_must_match_the_model():
    demo = CONFIGS / "demo/maskrcnn_shapes_baseline.yaml"
    with pytest.raises(ValueError, match=r"model\.num_classes \(4\) must be data\.shapes"):
        load_config(demo, ["data.shapes.num_classes=2"])
    assert (
        load_config(demo, ["data.shapes.num_classes=2", "model.num_classes=3"]).model.num_classes
        == 3
    )


def test_malformed_yaml_names_file_and_line(tmp_path: Path):
    path = write(tmp_path / "bad.yaml", "model:\n  arch: maskrcnn\n  backbone: [resnet50\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: line 4") as err:
        load_config(path)
    assert "invalid YAML" in str(err.value)


def test_missing_files(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    leaf = write(tmp_path / "leaf.yaml", "_base_: gone.yaml\n")
    with pytest.raises(FileNotFoundError, match=r"leaf\.yaml: _base_ file .*gone\.yaml"):
        load_config(leaf)


def test_base_cycle_is_detected(tmp_path: Path):
    write(tmp_path / "a.yaml", "_base_: b.yaml\n")
    write(tmp_path / "b.yaml", "_base_: a.yaml\n")
    with pytest.raises(ValueError, match="circular _base_"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    "path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS))
)
def test_every_shipped_config_loads(path: Path):
    if path.name == "plan.yaml":  # a study plan, not a training config: its runs' configs load
        from instruments.measure.study_plan import load_plan, plan_runs

        for run in plan_runs(load_plan(path)):
            cfg = load_config(run.config, run.overrides)  # each run's name and seed applied
            name = run.name.split("/")[-1]
            assert cfg.name == name
            if name != "pretrain":
                assert cfg.train.seed == int(name.rpartition("_s")[2])
        return
    cfg = load_config(path)
    # named by the file unless it says otherwise; a run's config.yaml of it loads back to it
    assert cfg.name == (yaml.safe_load(path.read_text()) or {}).get("name", path.stem)
    assert config_from_dict(yaml.safe_load(config_yaml(cfg))) == cfg


def test_published_recipes():
    mask = load_config(CONFIGS / "maskrcnn_g0.8.yaml")
    assert (mask.model.arch, mask.model.backbone, mask.model.norm) == (
        "maskrcnn",
        "resnet50",
        "frozen_bn",
    )
    assert mask.model.pretrained_backbone and mask.model.trainable_layers == 3
    assert (mask.dropit.enabled, mask.dropit.strategy, mask.dropit.gamma) == (True, "mink", 0.8)
    assert mask.solver.lr_steps == [16, 22] and mask.solver.epochs == 26
    assert mask.solver.batch_size * 8 == mask.solver.reference_batch == 16
    assert mask.data.aspect_ratio_group_factor == 3 and mask.model.max_size == 1333
    assert mask.model.num_classes == 81 and demo_classes() == 4
    backbone_only = load_config(CONFIGS / "maskrcnn_g0.8_backbone.yaml")
    assert backbone_only.dropit.include == ["backbone.*"]
    same = load_config(CONFIGS / "maskrcnn_g0.8.yaml", ["dropit.include=[backbone.*]"])
    assert {**backbone_only.to_dict(), "name": None} == {**same.to_dict(), "name": None}
    faster = load_config(CONFIGS / "fasterrcnn_g0.9.yaml")
    assert faster.model.arch == "fasterrcnn" and faster.dropit.gamma == 0.9
    assert not load_config(CONFIGS / "fasterrcnn_baseline.yaml").dropit.enabled
    demo = load_config(CONFIGS / "demo/maskrcnn_shapes_g0.8.yaml")
    assert demo.data.dataset == "shapes" and demo.model.backbone == "resnet18"
    assert not demo.model.pretrained_backbone and demo.dropit.enabled
    # make demo trains the COCO config's 4-bit DropIT section on every saved activation: the
    # norm inputs and the max-pool too, no layer excluded (the study's quant_4bit_all)
    quant = load_config(CONFIGS / "demo/maskrcnn_shapes_quant4.yaml")
    coco = load_config(CONFIGS / "maskrcnn_quant4.yaml").dropit
    assert quant.dropit == dataclasses.replace(coco, norm=True, pool=True, exclude=[])
    assert (quant.dropit.strategy, quant.dropit.options) == ("quant", {"bits": 4})
    assert {**quant.to_dict(), "name": None, "dropit": None} == {
        **demo.to_dict(),
        "name": None,
        "dropit": None,
    }
    assert "configs/demo/maskrcnn_shapes_quant4.yaml" in (CONFIGS.parent / "Makefile").read_text()


def test_every_config_trains_in_fp32_as_the_paper_did():
    # the published settings reproduce the paper's fp32 runs; fp16 (the GPU tables' precision)
    # is one --opts away (docs/training.md says why)
    configs = [*CONFIGS.glob("*.yaml"), *(CONFIGS / "demo").glob("*.yaml")]
    configs += [p for p in (CONFIGS / "study").glob("*.yaml") if p.name != "plan.yaml"]
    assert {"maskrcnn_baseline.yaml", "maskrcnn_g0.8.yaml"} <= {p.name for p in configs}
    for path in configs:
        assert load_config(path).solver.amp == "none", path.name
    fp16 = load_config(CONFIGS / "maskrcnn_g0.8.yaml", ["solver.amp=fp16"])
    assert fp16.solver.amp == "fp16"


def test_each_config_the_study_plan_names_trains_its_setting():
    # the config a user gets for a study setting is the COCO recipe with that setting's overrides
    from instruments.measure.study_plan import load_plan

    plan = load_plan(CONFIGS / "study/plan.yaml")
    assert {"mink_0.8", "quant_4bit_predictors"} <= set(plan.configs)
    recipe = load_config(CONFIGS / "maskrcnn_baseline.yaml")
    for setting, path in plan.configs.items():
        shipped = load_config(path)
        expected = with_overrides(recipe, plan.settings[setting], source=setting)
        assert {**shipped.to_dict(), "name": None} == {**expected.to_dict(), "name": None}, setting


def test_a_mapping_valued_key_takes_the_override_as_written():
    quant4 = CONFIGS / "maskrcnn_quant4.yaml"  # dropit.options: {bits: 4}
    # the options of another strategy: what a base set no longer applies, and {} clears it
    cfg = load_config(quant4, ["dropit.strategy=mink", "dropit.options={}"])
    assert (cfg.dropit.strategy, cfg.dropit.options) == ("mink", {})
    assert load_config(quant4, ["dropit.options={group: 64}"]).dropit.options == {"group": 64}
    # one key inside it, and a whole section, still merge
    assert load_config(quant4, ["dropit.options.group=64"]).dropit.options == {
        "bits": 4,
        "group": 64,
    }
    section = load_config(quant4, ["dropit={gamma: 0.5}"]).dropit
    assert (section.strategy, section.options, section.gamma) == ("quant", {"bits": 4}, 0.5)


def test_dump_and_reload_round_trip(tmp_path: Path):
    cfg = load_config(
        CONFIGS / "maskrcnn_g0.8.yaml",
        ["dropit.strategy=parallel_mink", "dropit.options={chunk: 4}", "solver.lr=1e-3"],
    )
    (tmp_path / "config.yaml").write_text(config_yaml(cfg))  # a run's config.yaml
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert config_from_dict(cfg.to_dict()) == cfg


def test_config_from_dict_validates():
    with pytest.raises(ValueError, match=r"config dict: unknown key 'model\.depth'"):
        config_from_dict({"model": {"depth": 50}})
    with pytest.raises(ValueError, match=r"dropit\.gamma = 2\.0"):
        config_from_dict({"dropit": {"gamma": 2}})


def demo_classes() -> int:
    """Model classes of the shapes demo: 3 shapes + background."""
    return load_config(CONFIGS / "demo/fasterrcnn_shapes.yaml").model.num_classes


def test_anchor_sizes_default_and_validation() -> None:
    from rcnn_dropit.config import load_config

    cfg = load_config("configs/maskrcnn_baseline.yaml")
    assert cfg.model.anchor_sizes == [32, 64, 128, 256, 512]
    with pytest.raises(ValueError, match=r"model.anchor_sizes \[64, 32, 128, 256, 512\]"):
        load_config("configs/maskrcnn_baseline.yaml", ["model.anchor_sizes=[64,32,128,256,512]"])


@pytest.mark.parametrize(
    "opts, pattern",
    [
        (["dropit.options={rescale: l2}"], r"dropit.options: .*rescale='l2' is invalid"),
        (["dropit.options={chunk: 4}"], r"'chunk' does not apply to strategy 'mink'"),
        (["dropit.strategy=threshold", "dropit.options={sample: x}"], r"sample='x'.*wrong type"),
        (["dropit.options={relu: 1}"], r"relu=1 must be true or false"),
    ],
)
def test_dropit_options_are_checked_when_the_config_loads(opts: list[str], pattern: str):
    with pytest.raises(ValueError, match=pattern):
        load_config(CONFIGS / "maskrcnn_g0.8.yaml", ["dropit.enabled=true", *opts])
    load_config(
        CONFIGS / "maskrcnn_g0.8.yaml", ["dropit.enabled=false", *opts[-1:]]
    )  # DropIT off: its options are unused
    cfg = load_config(
        CONFIGS / "maskrcnn_g0.8.yaml",
        ["dropit.enabled=true", "dropit.options={rescale: norm, relu: false}"],
    )
    assert cfg.dropit.options == {"rescale": "norm", "relu": False}


def test_config_strategy_choices_derive_from_the_registry() -> None:
    field = DropITConfig.__dataclass_fields__["strategy"]
    assert field.metadata["choices"] == REGISTRY.names == STRATEGIES
    assert STRATEGIES[0] == "mink" == field.default  # the published method comes first
    for name in STRATEGIES:
        cls = REGISTRY.get(name)
        assert cls.name == name and cls.keeps and cls.cache_bytes
