"""Model building: architectures, box head, norms, frozen stages, weight files, DropIT hook-up."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from urllib.error import URLError

import pytest
import torch
from torch import nn
from torchvision.models import resnet18, resnet34
from torchvision.models.detection.faster_rcnn import TwoMLPHead
from torchvision.ops.misc import FrozenBatchNorm2d

from dropit_core import FrozenBatchNorm2d as LeanFrozenBatchNorm2d
from dropit_core import dropit_record, to_dropit
from rcnn_dropit.config import config_from_dict, load_config
from rcnn_dropit.config_schema import PAPER_EXCLUDE
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models import MLPHead, build_backbone, build_model, fitting_exclude, paper_exclude
from rcnn_dropit.models.sampling import count_roi_samples, roi_sample_counter
from rcnn_dropit.rng import seed_all
from tests.helpers import REPO

TINY = {
    "backbone": "resnet18",
    "pretrained_backbone": False,
    "trainable_layers": 5,
    "norm": "bn",
    "num_classes": 3,
    "min_size": 64,
    "max_size": 64,
    "box_batch_size_per_image": 32,
    "rpn_batch_size_per_image": 32,
    "box_detections_per_img": 7,
    "rpn_pre_nms_top_n_train": 300,
    "rpn_post_nms_top_n_test": 50,
}
LOSSES = {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"}


def tiny_cfg(**model):
    """A validated config for a small ResNet-18 detector, with `model` keys changed."""
    dropit = model.pop("dropit", {})
    return config_from_dict({"model": {**TINY, **model}, "dropit": dropit})


def sample():
    """One 64x64 image with one box and its mask."""
    torch.manual_seed(0)
    mask = torch.zeros(1, 64, 64, dtype=torch.uint8)
    mask[0, 10:40, 12:50] = 1
    target = {
        "boxes": torch.tensor([[12.0, 10.0, 50.0, 40.0]]),
        "labels": torch.tensor([1]),
        "masks": mask,
    }
    return [torch.rand(3, 64, 64)], [target]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "expected"), [("maskrcnn", LOSSES | {"loss_mask"}), ("fasterrcnn", LOSSES)]
)
def test_build_and_train_forward(arch: str, expected: set[str]):
    model, record = build_model(tiny_cfg(arch=arch))
    assert record == [] and record.settings == ()  # an empty DropITRecord, not a bare list
    # torchvision's class, with the toolkit's lean forward (dropit_core.detection.forward)
    plain = {"maskrcnn": "MaskRCNN", "fasterrcnn": "FasterRCNN"}[arch]
    assert type(model).__name__ == "Lean" + plain and type(model).__mro__[2].__name__ == plain
    assert isinstance(model.roi_heads.box_head, MLPHead)
    assert model.roi_heads.box_predictor.cls_score.out_features == 3
    assert model.transform.min_size == (64,) and model.transform.max_size == 64
    assert model.roi_heads.detections_per_img == 7
    assert model.roi_heads.fg_bg_sampler.batch_size_per_image == 32
    assert model.rpn.fg_bg_sampler.batch_size_per_image == 32
    assert model.rpn._pre_nms_top_n == {"training": 300, "testing": 1000}
    assert model.rpn._post_nms_top_n == {"training": 2000, "testing": 50}
    assert model.roi_heads.score_thresh == 0.05
    model.train()
    losses = model(*sample())
    assert set(losses) == expected
    assert all(math.isfinite(v.item()) and v.item() >= 0 for v in losses.values())
    sum(losses.values()).backward()
    assert model.roi_heads.box_head.fc6.weight.grad.abs().sum() > 0


def test_head_matches_torchvision_two_mlp_head():
    torch.manual_seed(0)
    ours, theirs = MLPHead(16 * 2 * 2, 8), TwoMLPHead(16 * 2 * 2, 8)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 16, 2, 2)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    relus = [name for name, mod in ours.named_modules() if isinstance(mod, nn.ReLU)]
    assert relus == ["relu6", "relu7"]
    assert sum(p.numel() for m in (ours.relu6, ours.relu7) for p in m.parameters()) == 0


@pytest.mark.parametrize(
    ("norm", "frozen_bn", "kind"),
    [
        ("frozen_bn", "lean", LeanFrozenBatchNorm2d),
        ("frozen_bn", "torchvision", FrozenBatchNorm2d),
        ("bn", "lean", nn.BatchNorm2d),
    ],
)
def test_norm_layer_types(norm: str, frozen_bn: str, kind: type):
    body = build_backbone("resnet18", norm=norm, trainable_layers=5, frozen_bn=frozen_bn).body
    norms = (nn.BatchNorm2d, FrozenBatchNorm2d, LeanFrozenBatchNorm2d)
    assert {type(m) for m in body.modules() if isinstance(m, norms)} == {kind}


@pytest.mark.parametrize(
    ("layers", "trainable"),
    [
        (0, set()),
        (3, {"layer2", "layer3", "layer4"}),
        (5, {"conv1", "bn1", "layer1", "layer2", "layer3", "layer4"}),
    ],
)
def test_trainable_layers_freeze_the_stem_first(layers: int, trainable: set[str]):
    backbone = build_backbone("resnet18", norm="bn", trainable_layers=layers)
    stages = {n.split(".")[0] for n, p in backbone.body.named_parameters() if p.requires_grad}
    assert stages == trainable
    assert all(p.requires_grad for p in backbone.fpn.parameters())


def test_backbone_weights_from_local_file(tmp_path: Path):
    torch.manual_seed(1)
    imagenet = resnet18()  # stands for an ImageNet checkpoint: body + fc classifier
    torch.save(imagenet.state_dict(), tmp_path / "r18.pth")
    for norm in ("frozen_bn", "bn"):
        body = build_backbone("resnet18", norm=norm, weights_path=tmp_path / "r18.pth").body
        torch.testing.assert_close(body.conv1.weight, imagenet.conv1.weight)
        torch.testing.assert_close(
            body.layer4[1].bn2.running_var, imagenet.layer4[1].bn2.running_var
        )


def test_backbone_weights_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"model\.backbone_weights: file .*none\.pth"):
        build_model(tiny_cfg(backbone_weights=str(tmp_path / "none.pth")))
    torch.save(resnet34().state_dict(), tmp_path / "r34.pth")
    with pytest.raises(
        ValueError, match=r"r34\.pth' does not match the model: unexpected .*layer1\.2"
    ):
        build_backbone("resnet18", weights_path=tmp_path / "r34.pth")
    (tmp_path / "junk.pth").write_text("not a tensor file")
    with pytest.raises(ValueError, match="not a loadable torch file"):
        build_backbone("resnet18", weights_path=tmp_path / "junk.pth")


def test_pretrained_download_failure_says_what_to_do(monkeypatch: pytest.MonkeyPatch):
    def offline(*args, **kwargs):
        raise URLError("no network")

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", offline)
    with pytest.raises(UsageError, match=r"could not be downloaded.*model\.backbone_weights"):
        build_backbone("resnet18", pretrained=True)


@pytest.fixture(scope="module")
def saved_faster(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """A tiny Faster R-CNN's state_dict and a folder holding it raw and as a checkpoint."""
    torch.manual_seed(2)
    state = build_model(tiny_cfg(arch="fasterrcnn"))[0].state_dict()
    folder = tmp_path_factory.mktemp("weights")
    torch.save(state, folder / "raw.pth")
    torch.save({"model": state, "epoch": 3}, folder / "ckpt.pth")
    return state, folder


@pytest.mark.parametrize("name", ["raw.pth", "ckpt.pth"])
def test_weights_init_round_trip(saved_faster: tuple[dict, Path], name: str):
    state, folder = saved_faster
    torch.manual_seed(3)
    model, _ = build_model(tiny_cfg(arch="fasterrcnn", weights=str(folder / name)))
    loaded = model.state_dict()
    assert list(loaded) == list(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_weights_with_other_num_classes_is_rejected(saved_faster: tuple[dict, Path]):
    weights = str(saved_faster[1] / "raw.pth")
    with pytest.raises(ValueError, match=r"model\.weights: .*shape .*cls_score\.weight"):
        build_model(tiny_cfg(arch="fasterrcnn", num_classes=5, weights=weights))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["maskrcnn", "fasterrcnn"])
def test_dropit_is_applied_per_config(arch: str):
    cfg = tiny_cfg(arch=arch, dropit={"enabled": True, "strategy": "mink", "gamma": 0.8})
    model, record = build_model(cfg)
    paths = [entry.path for entry in record]
    assert len(record) > 0
    assert "backbone.body.conv1" not in paths and "roi_heads.box_predictor.cls_score" not in paths
    assert "roi_heads.box_head.fc6" in paths
    model.train()
    losses = model(*sample())
    assert all(math.isfinite(v.item()) for v in losses.values())


def test_paper_exclusions_fit_the_model_they_are_given():
    mask, _ = build_model(tiny_cfg(arch="maskrcnn"))
    faster, _ = build_model(tiny_cfg(arch="fasterrcnn"))
    assert paper_exclude(mask) == list(PAPER_EXCLUDE) == tiny_cfg().dropit.exclude
    assert paper_exclude(faster) == ["backbone.body.conv1", "roi_heads.box_predictor.*"]
    # the one call that fits both: no "matches no module" on the Faster R-CNN
    record = dropit_record(to_dropit(faster, "mink", 0.8, exclude=paper_exclude(faster)))
    paths = {r.path for r in record}
    assert "roi_heads.box_head.fc6" in paths and "backbone.body.conv1" not in paths
    assert not any(p.startswith("roi_heads.box_predictor") for p in paths)
    # a config's own patterns stay as given; only the paper's missing ones are left out
    custom = ["backbone.body.layer1.*", "roi_heads.mask_predictor.mask_fcn_logits"]
    assert fitting_exclude(faster, custom) == ("backbone.body.layer1.*",)
    assert fitting_exclude(mask, custom) == tuple(custom)


def test_with_the_paper_exclusions_the_relus_that_feed_a_plain_layer_stay_plain():
    # a plain layer reading a ReLU's output keeps it whole: a mask there would free nothing
    _, record = build_model(tiny_cfg(dropit={"enabled": True, "strategy": "quant"}))
    relus = {r.path for r in record if r.kind == "ReLU"}
    assert {"roi_heads.box_head.relu6", "roi_heads.mask_head.0.1", "rpn.head.conv.0.1"} <= relus
    plain = {"backbone.body.relu", "roi_heads.box_head.relu7", "roi_heads.mask_predictor.relu"}
    assert not plain & relus  # read by the max-pool, the box predictor, mask_fcn_logits


def test_a_dropit_pattern_of_the_config_that_matches_nothing_is_a_usage_error():
    cfg = tiny_cfg(dropit={"enabled": True, "include": ["roi_heads.box_hed.*"]})
    with pytest.raises(UsageError, match="include pattern 'roi_heads.box_hed.*' matches no module"):
        build_model(cfg)


def test_dropit_settings_reach_to_dropit(monkeypatch: pytest.MonkeyPatch):
    calls = []

    def to_dropit(model, **kwargs):  # stand-in that records what build_model asks for
        calls.append(kwargs)
        return model

    monkeypatch.setattr("rcnn_dropit.models.build.to_dropit", to_dropit)
    monkeypatch.setattr("rcnn_dropit.models.build.dropit_record", lambda model: ["converted"])
    dropit = {
        "enabled": True,
        "strategy": "parallel_mink",
        "gamma": 0.5,
        "include": ["roi_heads.*"],
        "options": {"chunk": 4},
    }
    model, record = build_model(tiny_cfg(arch="fasterrcnn", dropit=dropit))
    assert record == ["converted"] and isinstance(model.roi_heads.box_head, MLPHead)
    assert calls == [
        {
            "strategy": "parallel_mink",
            "gamma": 0.5,
            "include": ("roi_heads.*",),
            "exclude": ("backbone.body.conv1", "roi_heads.box_predictor.*"),  # no mask branch
            "rules": None,  # no dropit.rules: the keys above are the one rule
            "norm": False,
            "pool": False,
            "chunk": 4,
        }
    ]


def test_per_group_rules_of_the_config_give_each_group_its_setting():
    rules = [
        {"include": ["backbone.*"], "strategy": "mink", "gamma": 0.8},
        {"include": ["rpn.*", "roi_heads.*"], "strategy": "quant", "options": {"bits": 4}},
    ]
    model, record = build_model(tiny_cfg(dropit={"enabled": True, "rules": rules}))
    by_path = {r.path: r.strategy for r in record if r.kind != "ReLU"}
    assert by_path["backbone.body.layer2.0.conv1"] == "mink(gamma=0.8)"
    assert by_path["roi_heads.box_head.fc6"].startswith("quant(bits=4")
    assert by_path["rpn.head.cls_logits"].startswith("quant(bits=4")
    assert [s.strategy for s in record.settings] == ["mink", "quant"]
    assert "backbone.body.conv1" not in by_path  # the paper's exclusions hold for every rule


def test_a_rule_of_the_config_is_checked_on_load_and_against_the_model():
    bad = [{"include": ["backbone.*"], "strategy": "mink", "gamma": 1.5}]
    with pytest.raises(UsageError, match=r"dropit.rules: DropIT rules\[0\].*gamma"):
        tiny_cfg(dropit={"enabled": True, "rules": bad})
    overlap = [{"include": ["backbone.*"]}, {"include": ["backbone.fpn.*"], "strategy": "quant"}]
    with pytest.raises(UsageError, match="backbone.fpn"):
        build_model(tiny_cfg(dropit={"enabled": True, "rules": overlap}))


def test_activation_checkpointing_of_the_config_recomputes_and_leaves_dropit_off_there():
    from dropit_core import is_checkpointed

    stages = ["backbone.body.layer3", "backbone.body.layer4"]
    plain, _ = build_model(tiny_cfg())
    model, record = build_model(tiny_cfg(activation_checkpointing=stages, dropit={"enabled": True}))
    body = model.backbone.body
    assert is_checkpointed(body.layer3) and is_checkpointed(body.layer4)
    assert not is_checkpointed(model.backbone.body.layer2)
    converted = {r.path for r in record}
    assert "backbone.body.layer2.0.conv1" in converted
    assert not any(p.startswith(tuple(stages)) for p in converted)
    assert record.skipped and all(p.startswith(tuple(stages)) for p in record.skipped)
    # the same weights: checkpoints move between checkpointed and plain runs
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    with pytest.raises(UsageError, match="model.activation_checkpointing: .*layer5"):
        build_model(tiny_cfg(activation_checkpointing=["backbone.body.layer5"]))


def test_default_widths_match_torchvision_maskrcnn():
    """Default widths build torchvision's own shapes, so COCO weights files keep loading."""
    from torchvision.models.detection import maskrcnn_resnet50_fpn

    ours, _ = build_model(tiny_cfg(backbone="resnet50", num_classes=91))
    theirs = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=91)
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    ref = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert mine == ref


def test_width_options_build_narrow_parts():
    model, _ = build_model(
        tiny_cfg(fpn_channels=32, box_head_width=64, mask_head_channels=16, mask_head_convs=2)
    )
    fpn = model.backbone.fpn
    assert model.backbone.out_channels == 32
    assert [b[0].out_channels for b in fpn.layer_blocks] == [32] * 4
    assert [b[0].in_channels for b in fpn.inner_blocks] == [64, 128, 256, 512]
    assert model.rpn.head.conv[0][0].in_channels == 32
    heads = model.roi_heads
    assert (heads.box_head.fc6.in_features, heads.box_head.fc6.out_features) == (32 * 49, 64)
    assert heads.box_predictor.cls_score.in_features == 64
    assert heads.box_predictor.cls_score.out_features == 3
    assert [m[0].out_channels for m in heads.mask_head] == [16, 16]
    assert heads.mask_head[0][0].in_channels == 32
    assert heads.mask_predictor.conv5_mask.in_channels == 16
    assert heads.mask_predictor.mask_fcn_logits.out_channels == 3
    # and it trains: every loss is finite and every trainable parameter gets a gradient
    model.train()
    images, targets = sample()
    losses = model(images, targets)
    sum(losses.values()).backward()
    assert all(torch.isfinite(v) for v in losses.values())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_width_options_are_validated():
    with pytest.raises(ValueError, match="model.fpn_channels"):
        tiny_cfg(fpn_channels=0)


def test_exported_backbone_loads_as_backbone_weights(tmp_path: Path):
    """A detector checkpoint's body, exported, initialises a new detector's body exactly."""
    from rcnn_dropit.models.weights import export_backbone

    source, _ = build_model(tiny_cfg(fpn_channels=32))
    torch.save({"model": source.state_dict(), "iteration": 3}, tmp_path / "ckpt.pth")
    digest = export_backbone(tmp_path / "ckpt.pth", tmp_path / "out" / "body.pth")
    assert len(digest) == 64
    target, _ = build_model(
        tiny_cfg(
            norm="frozen_bn", trainable_layers=3, backbone_weights=str(tmp_path / "out/body.pth")
        )
    )
    body, ref = target.backbone.body.state_dict(), source.backbone.body.state_dict()
    assert body.keys() <= ref.keys() and len(body) > 50
    assert all(torch.equal(body[k], ref[k]) for k in body)
    with pytest.raises(ValueError, match="no 'backbone.body"):
        torch.save({"x": torch.zeros(1)}, tmp_path / "bad.pth")
        export_backbone(tmp_path / "bad.pth", tmp_path / "never.pth")
    assert not (tmp_path / "never.pth").exists()


def test_dropit_norm_and_pool_convert_the_batchnorms_and_the_stem_max_pool():
    from dropit_core.layers.norm import DropITBatchNorm2d
    from dropit_core.layers.pooling import DropITMaxPool2d

    dropit = {"enabled": True, "strategy": "quant", "options": {"bits": 4}}
    cfg = tiny_cfg(norm="bn", trainable_layers=5, dropit={**dropit, "norm": True, "pool": True})
    model, record = build_model(cfg)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(type(m) is DropITBatchNorm2d for m in norms)
    assert type(model.backbone.body.maxpool) is DropITMaxPool2d
    assert record.settings[0].norms == len(norms) and record.settings[0].pools == 1
    images, targets = sample()
    losses = model.train()(images, targets)
    sum(losses.values()).backward()  # the packed norm inputs rebuild in backward
    assert all(p.grad is not None for p in model.backbone.body.layer1.parameters())
    # without them, the same config leaves the norms and the max-pool plain
    model, _ = build_model(tiny_cfg(norm="bn", trainable_layers=5, dropit=dropit))
    assert not any(isinstance(m, (DropITBatchNorm2d, DropITMaxPool2d)) for m in model.modules())


def test_dropit_saved_bits_compresses_what_a_model_saves_with_or_without_converted_layers():
    from dropit_core import saved_compression
    from dropit_core.memory import saved_activations
    from instruments.measure.grad_fidelity import approximated_layers

    def saved_mb(model: nn.Module) -> float:
        images, targets = sample()
        model.train()
        # The same proposals for every model: sampling draws from the global RNG, and the RoI
        # heads' saved bytes follow the proposals (unseeded, the ratio below moved with the
        # tests run before this one in the process)
        torch.manual_seed(1)
        losses, report = saved_activations(model, lambda: model(images, targets))
        sum(losses.values()).backward()  # the packs rebuild in backward
        return report.total_bytes

    torch.manual_seed(0)
    plain, _ = build_model(tiny_cfg(norm="bn", trainable_layers=5))
    torch.manual_seed(0)  # the same weights
    hooked, record = build_model(tiny_cfg(norm="bn", trainable_layers=5, dropit={"saved_bits": 4}))
    handle = saved_compression(hooked)
    assert handle is not None and handle.options["bits"] == 4 and len(record) == 0
    # no layer is converted, and every layer's weight gradient is computed from rebuilt tensors
    weighted = {
        n for n, m in hooked.named_modules() if isinstance(getattr(m, "weight", None), nn.Parameter)
    }
    assert weighted <= approximated_layers(hooked)
    assert saved_mb(hooked) < 0.35 * saved_mb(plain)
    assert handle.last.packs > 20
    both, record = build_model(
        tiny_cfg(dropit={"enabled": True, "strategy": "quant", "saved_bits": 2})
    )
    assert len(record) > 0 and saved_compression(both).options["bits"] == 2
    with pytest.raises(ValueError, match="dropit.saved_bits"):
        tiny_cfg(dropit={"saved_bits": 3})


@pytest.mark.parametrize("arch", ["maskrcnn", "fasterrcnn"])
def test_v2_heads_are_torchvisions_fpn_v2_model_state_dict_and_outputs(arch):
    """heads v2 with a BatchNorm body is torchvision's *_resnet50_fpn_v2: its state_dict keys
    and shapes, so its COCO weights load, and with them its outputs."""
    from torchvision.models import detection

    factory = getattr(detection, f"{arch}_resnet50_fpn_v2")
    theirs = factory(weights=None, weights_backbone=None, num_classes=91).eval()
    ours, _ = build_model(tiny_cfg(arch=arch, backbone="resnet50", num_classes=91, heads="v2"))
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mine == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    ours.load_state_dict(theirs.state_dict())
    ours.eval()
    theirs.transform = ours.transform  # the tiny config's 64 px images, for both
    with torch.no_grad():
        images = [torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(3))]
        features = ours.backbone(images[0][None])
        expected = theirs.backbone(images[0][None])
        assert all(torch.equal(features[k], expected[k]) for k in expected)
        mine_rpn = sum(ours.rpn.head(list(features.values())), [])
        their_rpn = sum(theirs.rpn.head(list(expected.values())), [])
        assert all(torch.equal(a, b) for a, b in zip(mine_rpn, their_rpn, strict=True))
        rois = torch.randn(3, 256, 7, 7, generator=torch.Generator().manual_seed(4))
        mine_box, their_box = ours.roi_heads.box_head(rois), theirs.roi_heads.box_head(rois)
        assert torch.equal(mine_box, their_box)
        assert torch.equal(ours.roi_heads.box_predictor(mine_box)[0],
                           theirs.roi_heads.box_predictor(their_box)[0])  # fmt: skip
        if arch == "maskrcnn":
            rois = torch.randn(3, 256, 14, 14, generator=torch.Generator().manual_seed(5))
            mask = ours.roi_heads.mask_predictor(ours.roi_heads.mask_head(rois))
            assert torch.equal(
                mask, theirs.roi_heads.mask_predictor(theirs.roi_heads.mask_head(rois))
            )


def test_v2_heads_put_a_norm_after_every_fpn_and_head_conv_and_train():
    model, _ = build_model(tiny_cfg(heads="v2", fpn_channels=32, mask_head_channels=32))
    fpn, heads = model.backbone.fpn, model.roi_heads
    assert all(isinstance(b[1], nn.BatchNorm2d) for b in [*fpn.inner_blocks, *fpn.layer_blocks])
    assert len(model.rpn.head.conv) == 2  # two RPN convs, no norm (torchvision's v2)
    assert [type(b[1]) for b in list(heads.box_head)[:4]] == [nn.BatchNorm2d] * 4
    assert heads.box_head[5].out_features == 1024 and heads.box_predictor.cls_score.in_features
    assert [type(b[1]) for b in heads.mask_head] == [nn.BatchNorm2d] * 4
    model.train()
    images, targets = sample()
    losses = model(images, targets)
    sum(losses.values()).backward()
    assert all(torch.isfinite(v) for v in losses.values())


@pytest.mark.slow
def test_group_norm_body_and_heads_and_dropit_converts_them():
    cfg = tiny_cfg(
        norm="gn",
        heads="v2",
        head_norm="gn",
        fpn_channels=32,
        mask_head_channels=32,
        dropit={"enabled": True, "strategy": "quant", "options": {"bits": 4}, "norm": True},
    )
    model, record = build_model(cfg)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert all(type(m).__name__ == "DropITGroupNorm" for m in norms)
    assert model.backbone.body.bn1.num_groups == 32
    converted = {layer.path for layer in record}
    assert {"roi_heads.box_head.0.1", "roi_heads.mask_head.0.1"} <= converted
    assert "backbone.fpn.inner_blocks.0.1" in converted
    model.train()
    images, targets = sample()
    sum(model(images, targets).values()).backward()


def test_group_norm_refuses_imagenet_weights_and_widths_it_cannot_split():
    with pytest.raises(UsageError, match="model.pretrained_backbone: .*gn"):
        build_model(tiny_cfg(norm="gn", pretrained_backbone=True))
    with pytest.raises(UsageError, match="48 channels do not split into 32 groups"):
        build_model(tiny_cfg(heads="v2", head_norm="gn", fpn_channels=48))


def test_sync_bn_comes_before_dropit_so_the_synchronised_norms_are_dropits():
    from dropit_core.layers.norm import DropITSyncBatchNorm

    dropit = {"enabled": True, "strategy": "quant", "options": {"bits": 4}, "norm": True}
    model, record = build_model(tiny_cfg(heads="v2", dropit=dropit), sync_bn=True)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(type(m) is DropITSyncBatchNorm for m in norms)
    assert sum(1 for layer in record if layer.kind == "SyncBatchNorm") == len(norms)


def test_sync_bn_applies_where_a_batch_norm_trains():
    from rcnn_dropit.models.build import trainable_batch_norm

    def trains(**model):
        return trainable_batch_norm(tiny_cfg(**model).model)

    assert trains(norm="bn") and trains(norm="frozen_bn", heads="v2")
    assert not trains(norm="frozen_bn") and not trains(norm="gn")
    assert not trains(norm="frozen_bn", heads="v2", head_norm="gn")


# sha1 over (key, fp32 bytes) of the initial state_dict the demo configs build from their seed
# (42), recorded with the code of the committed runs (2060158, c8be5cb) and torch 2.14.1: a
# change of these means that no committed run (docs/results) can be trained again from its seed.
INITIAL_WEIGHTS_SHA1 = {
    "fasterrcnn_shapes": "fa440b94108a",
    "maskrcnn_shapes_quant4": "c296e39083cd",
}


@pytest.mark.skipif(torch.__version__.split("+")[0] != "2.14.1", reason="digests of torch 2.14.1")
@pytest.mark.parametrize("name", sorted(INITIAL_WEIGHTS_SHA1))
def test_a_seed_gives_the_initial_weights_of_the_committed_runs(name: str) -> None:
    # b9e33fa built the mask head before the box predictor (and for Faster R-CNN too), which
    # moved the global generator's draws: the same seed gave other head weights
    cfg = load_config(REPO / "configs/demo" / f"{name}.yaml")
    seed_all(cfg.train.seed)
    model, _record = build_model(cfg)
    digest = hashlib.sha1()
    for key, value in model.state_dict().items():
        digest.update(key.encode())
        digest.update(value.detach().float().numpy().tobytes())
    assert digest.hexdigest()[:12] == INITIAL_WEIGHTS_SHA1[name]


def test_the_roi_sample_counter_counts_what_the_sampler_picks_per_image() -> None:
    model, _ = build_model(tiny_cfg())
    counter = roi_sample_counter(model)
    assert counter is count_roi_samples(model)  # installed once, by build_model
    assert counter.take() == (0, 0, 0)
    # matched labels of two images: 3 positives and 5 negatives, then 1 and 0 (and -1: ignored)
    labels = [torch.tensor([1, 2, 3, 0, 0, 0, 0, 0]), torch.tensor([4, -1])]
    torch.manual_seed(0)
    pos, neg = counter(labels)
    assert [int(p.sum()) for p in pos] == [3, 1] and [int(n.sum()) for n in neg] == [5, 0]
    counter(labels[:1])
    assert counter.take() == (3 + 1 + 3, 5 + 0 + 5, 3) and counter.take() == (0, 0, 0)
    assert roi_sample_counter(torch.nn.Module()) is None
