"""to_dropit / from_dropit on a small detector-shaped model: paths, patterns, state_dicts, copies
and every user error."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dropit_core import (
    AppliedSetting,
    ConvertedLayer,
    DropITRecord,
    check_rules,
    dropit_record,
    from_dropit,
    is_dropit,
    to_dropit,
)
from dropit_core.layers.conv import DropITConv2d, DropITConvTranspose2d
from dropit_core.layers.linear import DropITLinear
from dropit_core.layers.relu import DropITReLU


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())

    def forward(self, x):
        return self.layer1(self.relu(self.conv1(x)))


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x):
        return self.body(x)


class BoxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc6 = nn.Linear(4 * 4 * 4, 8)
        self.relu6 = nn.ReLU()
        self.fc7 = nn.Linear(8, 8)
        self.relu7 = nn.ReLU()

    def forward(self, x):
        return self.relu7(self.fc7(self.relu6(self.fc6(x.flatten(1)))))


class BoxPredictor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls_score = nn.Linear(8, 3)
        self.bbox_pred = nn.Linear(8, 12)

    def forward(self, x):
        return self.cls_score(x), self.bbox_pred(x)


class MaskPredictor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv5_mask = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.relu = nn.ReLU(inplace=True)
        self.mask_fcn_logits = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.mask_fcn_logits(self.relu(self.conv5_mask(x)))


class RoIHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.box_head = BoxHead()
        self.box_predictor = BoxPredictor()
        self.mask_predictor = MaskPredictor()


class TinyDetector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.roi_heads = RoIHeads()

    def forward(self, x):
        feats = self.backbone(x)
        pooled = nn.functional.adaptive_avg_pool2d(feats, 4)
        cls, box = self.roi_heads.box_predictor(self.roi_heads.box_head(pooled))
        masks = self.roi_heads.mask_predictor(pooled)
        return cls.pow(2).mean() + box.pow(2).mean() + masks.pow(2).mean()


ALL = [
    ("backbone.body.conv1", "Conv2d"),
    ("backbone.body.relu", "ReLU"),
    ("backbone.body.layer1.0", "Conv2d"),
    ("backbone.body.layer1.1", "ReLU"),
    ("roi_heads.box_head.fc6", "Linear"),
    ("roi_heads.box_head.relu6", "ReLU"),
    ("roi_heads.box_head.fc7", "Linear"),
    ("roi_heads.box_head.relu7", "ReLU"),
    ("roi_heads.box_predictor.cls_score", "Linear"),
    ("roi_heads.box_predictor.bbox_pred", "Linear"),
    ("roi_heads.mask_predictor.conv5_mask", "ConvTranspose2d"),
    ("roi_heads.mask_predictor.relu", "ReLU"),
    ("roi_heads.mask_predictor.mask_fcn_logits", "Conv2d"),
]
FC67 = ["roi_heads.box_head.fc6", "roi_heads.box_head.fc7"]
CONFIG_EXCLUDE = (
    "backbone.body.conv1",
    "roi_heads.box_predictor.*",
    "roi_heads.mask_predictor.mask_fcn_logits",
)


def _model() -> TinyDetector:
    torch.manual_seed(0)
    return TinyDetector()


def _image() -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _converted_paths(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if is_dropit(m)]


def _expect(paths: list[str]) -> list[tuple[str, str]]:
    return [(p, k) for p, k in ALL if p in paths]


def test_default_converts_everything_with_kinds_and_labels() -> None:
    model = _model()
    assert to_dropit(model, strategy="mink", gamma=0.8) is model  # as convert_sync_batchnorm
    record = dropit_record(model)
    assert [(r.path, r.kind) for r in record] == ALL
    assert len(record) == 13
    for r in record:
        assert r.strategy == ("relu-mask" if r.kind == "ReLU" else "mink(gamma=0.8)")
    assert _converted_paths(model) == [p for p, _ in ALL]
    classes = {
        "Conv2d": DropITConv2d,
        "ConvTranspose2d": DropITConvTranspose2d,
        "Linear": DropITLinear,
        "ReLU": DropITReLU,
    }
    modules = dict(model.named_modules())
    for path, kind in ALL:
        assert type(modules[path]) is classes[kind]
    # One cache shared by all converted conv/linear layers (so shared inputs pack once).
    caches = {id(m.dropit_cache) for m in model.modules() if hasattr(m, "dropit_cache")}
    assert len(caches) == 1


def test_config_default_exclude() -> None:
    model = _model()
    record = dropit_record(to_dropit(model, exclude=CONFIG_EXCLUDE))
    expected = _expect(
        [
            "backbone.body.relu",
            "backbone.body.layer1.0",
            "backbone.body.layer1.1",
            "roi_heads.box_head.fc6",
            "roi_heads.box_head.relu6",
            "roi_heads.box_head.fc7",
            "roi_heads.box_head.relu7",
            "roi_heads.mask_predictor.conv5_mask",
            "roi_heads.mask_predictor.relu",
        ]
    )
    assert [(r.path, r.kind) for r in record] == expected
    assert type(model.backbone.body.conv1) is nn.Conv2d
    assert type(model.roi_heads.box_predictor.cls_score) is nn.Linear


@pytest.mark.parametrize(
    "include,exclude,paths",
    [
        # A plain name covers its children.
        (("roi_heads",), (), [p for p, _ in ALL if p.startswith("roi_heads.")]),
        (("backbone.body.layer1",), (), ["backbone.body.layer1.0", "backbone.body.layer1.1"]),
        (("*",), ("roi_heads",), [p for p, _ in ALL if p.startswith("backbone.")]),
        # Wildcards.
        (("*.fc?",), (), FC67),
        (("roi_heads.box_head.*",), ("*relu*",), FC67),
        (("*conv*",), ("backbone.*",), ["roi_heads.mask_predictor.conv5_mask"]),
        # A name does not cover a sibling that only shares its prefix.
        (("backbone.body.conv1", "roi_heads.box_head.fc7"), (), ["backbone.body.conv1",
                                                                  "roi_heads.box_head.fc7"]),
    ],
)  # fmt: skip
def test_include_exclude_patterns(include, exclude, paths) -> None:
    model = _model()
    record = dropit_record(to_dropit(model, include=include, exclude=exclude))
    assert [(r.path, r.kind) for r in record] == _expect(paths)
    assert _converted_paths(model) == [p for p, _ in _expect(paths)]


@pytest.mark.parametrize(
    "include,exclude,paths",
    [
        (("*",), ("roi_heads.*_predictor",), [p for p, _ in ALL if "_predictor" not in p]),
        (("backbone.body.layer?",), (), ["backbone.body.layer1.0", "backbone.body.layer1.1"]),
    ],
)
def test_wildcard_pattern_covers_children(include, exclude, paths) -> None:
    model = _model()
    record = dropit_record(to_dropit(model, include=include, exclude=exclude))
    assert [(r.path, r.kind) for r in record] == _expect(paths)


def test_relu_false_leaves_relus() -> None:
    model = _model()
    record = dropit_record(to_dropit(model, relu=False))
    assert [(r.path, r.kind) for r in record] == [(p, k) for p, k in ALL if k != "ReLU"]
    for path, module in model.named_modules():
        if path.endswith(("relu", ".1", "relu6", "relu7")) and isinstance(module, nn.ReLU):
            assert type(module) is nn.ReLU


def _same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_state_dict_unchanged_and_from_dropit_restores() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {p: type(m) for p, m in model.named_modules()}
    to_dropit(model, exclude=CONFIG_EXCLUDE)
    _same_state(model.state_dict(), before)
    assert from_dropit(model) is model
    _same_state(model.state_dict(), before)
    assert {p: type(m) for p, m in model.named_modules()} == classes
    assert not any(hasattr(m, "dropit_cache") for m in model.modules())
    assert _converted_paths(model) == []
    # It can be converted again after being restored.
    record = dropit_record(to_dropit(model))
    assert len(record) == 13


def test_from_dropit_on_a_part_leaves_the_whole_record_counting_the_rest() -> None:
    model = to_dropit(_model(), rules=MIXED)
    whole = dropit_record(model)
    before = whole.summary()
    from_dropit(model.roi_heads)  # a part: its record is the whole's, out of its reach
    record = dropit_record(model)
    assert [r.path for r in record] == BACKBONE
    assert [r.path for r in record] == _converted_paths(model)
    backbone, heads = record.settings
    assert (backbone.layers, backbone.relus) == (2, 2)
    assert (heads.layers, heads.relus, heads.norms, heads.pools) == (0, 0, 0, 0)
    assert "quant(bits=4, group=256): 0 conv/linear layers and 0 ReLUs" in record.summary()
    assert whole.summary() == before  # a record already handed out is not changed under it
    from_dropit(model)
    with pytest.raises(ValueError, match="no DropIT record"):
        dropit_record(model)


def test_forward_unchanged_by_conversion() -> None:
    plain = _model()
    drop = copy.deepcopy(plain)
    to_dropit(drop, strategy="parallel_mink", gamma=0.8, chunk=64)
    x = _image()
    assert torch.equal(drop(x), plain(x))


def test_load_state_dict_across_plain_and_dropit() -> None:
    source = _model()
    drop = TinyDetector()  # other random weights
    to_dropit(drop)
    result = drop.load_state_dict(source.state_dict())
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    _same_state(drop.state_dict(), source.state_dict())
    assert all(is_dropit(m) for p, m in drop.named_modules() if p in dict(ALL))

    other = _model()
    to_dropit(other, strategy="channel_mink", gamma=0.5)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    plain = TinyDetector()
    plain.load_state_dict(other.state_dict())
    _same_state(plain.state_dict(), other.state_dict())


def _train_step(model: nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(_image()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("strategy,options", [("mink", {}), ("random", {"seed": 3})])
def test_copies_of_a_converted_model_train(how: str, strategy: str, options) -> None:
    model = _model()
    to_dropit(model, strategy=strategy, gamma=0.8, **options)
    ref_grads = _train_step(model)  # also leaves a warm cache behind
    clone = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert _converted_paths(clone) == [p for p, _ in ALL]
    caches = {id(m.dropit_cache) for m in clone.modules() if hasattr(m, "dropit_cache")}
    assert len(caches) == 1
    assert caches.isdisjoint({id(model.backbone.body.conv1.dropit_cache)})
    _same_state(clone.state_dict(), model.state_dict())
    grads = _train_step(clone)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert bool(torch.isfinite(g).all()), name
        if strategy == "mink":
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)
    # Optimiser step works on the copy.
    opt = torch.optim.SGD(clone.parameters(), lr=0.1)
    before = clone.roi_heads.box_head.fc6.weight.detach().clone()
    opt.step()
    assert not torch.equal(clone.roi_heads.box_head.fc6.weight, before)
    # And the copy can be turned back into a plain model.
    from_dropit(clone)
    assert _converted_paths(clone) == []


# ------------------------------------------------------------------------------------- user errors


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"gamma": 1.0}, "gamma=1.0 .*allowed 0 <= gamma < 1"),
        ({"gamma": -0.1}, "gamma=-0.1 .*allowed 0 <= gamma < 1"),
        ({"gamma": "0.8"}, "gamma='0.8' .*allowed 0 <= gamma < 1"),
        ({"gamma": True}, "gamma=True .*allowed 0 <= gamma < 1"),
        ({"gamma": None}, "gamma=None .*allowed 0 <= gamma < 1"),
        ({"strategy": "minkk"}, "'minkk'.*allowed mink, parallel_mink, random"),
        (
            {"strategy": "mink", "chunk": 64},
            "'chunk'.*'mink'.*allowed int4_chunk, int8_chunk, positions, rescale, values",
        ),
        ({"strategy": "parallel_mink", "chunk": "64"}, "chunk='64'.*expected int"),
        ({"strategy": "parallel_mink", "chunk": 64.0}, "chunk=64.0.*expected int"),
        ({"strategy": "random", "seed": True}, "seed=True.*expected int"),
        ({"values": "int2"}, "values='int2'.*allowed.*'same', 'fp16', 'bf16', 'int8', 'int4'"),
        ({"values": 8}, "values=8.*expected str"),
        ({"relu": "yes"}, "relu='yes'"),
        ({"include": "roi_heads"}, "include.*'roi_heads'"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, pattern: str) -> None:
    model = _model()
    with pytest.raises(ValueError, match=pattern):
        to_dropit(model, **kwargs)
    assert _converted_paths(model) == []


def test_include_matching_nothing_names_the_pattern() -> None:
    model = _model()
    with pytest.raises(ValueError, match=re.escape("'roi_heads.box_hed'") + ".*matches no module"):
        to_dropit(model, include=("roi_heads.box_hed",))
    with pytest.raises(ValueError, match=re.escape("'nothing.here*'")):
        to_dropit(model, exclude=("nothing.here*",))
    assert _converted_paths(model) == []


def test_exclude_everything_raises() -> None:
    model = _model()
    with pytest.raises(ValueError, match="selects no Conv2d/ConvTranspose2d/Linear layer"):
        to_dropit(model, exclude=("*",))
    assert _converted_paths(model) == []


def test_exclude_everything_message_names_the_patterns() -> None:
    with pytest.raises(ValueError, match=re.escape("roi_heads")):
        to_dropit(_model(), include=("roi_heads",), exclude=("roi_heads",))


def test_rejected_conversion_leaves_the_model_untouched() -> None:
    model = _model()
    with pytest.raises(ValueError, match="selects no Conv2d/ConvTranspose2d/Linear layer"):
        to_dropit(model, include=("backbone.body.relu",))
    assert _converted_paths(model) == []


def test_converting_twice_raises() -> None:
    model = _model()
    to_dropit(model, exclude=CONFIG_EXCLUDE)
    with pytest.raises(ValueError, match="already has DropIT layers.*from_dropit"):
        to_dropit(model)
    # Also when the second call would touch other layers only.
    with pytest.raises(ValueError, match="already has DropIT layers"):
        to_dropit(model, include=("roi_heads.box_predictor",))


# ------------------------------------------------------------------------------- per-group rules

BACKBONE = [p for p, _ in ALL if p.startswith("backbone.")]
HEADS = [p for p, _ in ALL if p.startswith("roi_heads.")]
MIXED = [
    {"include": ["backbone"], "strategy": "mink", "gamma": 0.8},
    {"include": ["roi_heads"], "strategy": "quant", "options": {"bits": 4}},
]


def test_rules_give_each_group_its_own_setting_and_cache() -> None:
    model = _model()
    record = dropit_record(to_dropit(model, rules=MIXED))
    assert [(r.path, r.kind) for r in record] == ALL
    for r in record:
        if r.kind == "ReLU":
            assert r.strategy == "relu-mask"
        elif r.path.startswith("backbone."):
            assert (r.strategy, r.rule) == ("mink(gamma=0.8)", 0)
        else:
            assert (r.strategy, r.rule) == ("quant(bits=4, group=256)", 1)
    caches = {m.dropit_cache for m in model.modules() if hasattr(m, "dropit_cache")}
    assert sorted((c.stream, c.strategy.name) for c in caches) == [(0, "mink"), (1, "quant")]
    # The backbone trains exactly as a backbone-only mink conversion: same kept sets.
    plain = _model()
    x = _image()
    assert torch.equal(model(x), plain(x))
    alone = _model()
    to_dropit(alone, include=["backbone"], gamma=0.8)
    grads, ref = _train_step(model), _train_step(alone)
    for name, g in grads.items():
        assert bool(torch.isfinite(g).all()), name
        if name.startswith("backbone."):
            assert torch.equal(g, ref[name]), name


def test_a_rule_falls_back_to_the_call_for_what_it_leaves_out() -> None:
    model = _model()
    rules = [{"include": ["backbone"]}, {"include": ["roi_heads"], "gamma": 0.5, "relu": False}]
    to_dropit(
        model, strategy="parallel_mink", gamma=0.9, chunk=8, rules=rules, exclude=CONFIG_EXCLUDE
    )
    labels = {r.path: r.strategy for r in dropit_record(model)}
    assert labels["backbone.body.layer1.0"] == "parallel_mink(gamma=0.9, chunk=8)"
    assert labels["roi_heads.box_head.fc6"] == "parallel_mink(gamma=0.5, chunk=8)"
    assert "backbone.body.relu" in labels and "roi_heads.box_head.relu6" not in labels
    # the call's exclude applies to every rule
    assert "backbone.body.conv1" not in labels and "roi_heads.box_predictor.cls_score" not in labels
    # a rule without include takes the call's include
    record = dropit_record(
        to_dropit(_model(), include=["roi_heads.box_head"], rules=[{"gamma": 0.5}])
    )
    assert [r.path for r in record] == [p for p in HEADS if ".box_head." in p]
    # relu in a rule's options is the rule's relu, as in a config's dropit.options
    options = {"relu": False, "values": "int8"}
    (rule,) = check_rules([{"include": ["roi_heads"], "options": options}])
    assert rule.relu is False and rule.options == {"values": "int8"}


@pytest.mark.parametrize(
    "rules,kwargs,message",
    [
        (
            [{"include": ["backbone"]}, {"include": ["roi_head"]}],
            {},
            r"DropIT rules\[1\] include pattern 'roi_head' matches no module; did you mean",
        ),
        (
            [{"include": ["backbone"], "exclude": ["backbone.nope"]}],
            {},
            r"DropIT rules\[0\] exclude pattern 'backbone.nope' matches no module",
        ),
        (
            [{"include": ["backbone"]}],
            {"exclude": ["nope"]},
            "DropIT exclude pattern 'nope' matches no module",
        ),
        (
            [{"include": ["*"]}, {"include": ["roi_heads"], "strategy": "quant"}],
            {},
            r"DropIT rules\[0\] and rules\[1\] both claim layer 'roi_heads.box_head.fc6': narrow",
        ),
        (
            [{"include": ["backbone"], "strategy": "minkk"}],
            {},
            r"DropIT rules\[0\]: unknown DropIT",
        ),
        (
            [{"include": ["backbone"]}, {"include": ["roi_heads"], "gamma": 1.5}],
            {},
            r"DropIT rules\[1\]: gamma=1.5 is out of range: allowed 0 <= gamma < 1",
        ),
        (
            [{"include": ["roi_heads"], "strategy": "quant", "options": {"bits": 3}}],
            {},
            r"DropIT rules\[0\]: option bits=3 is invalid: allowed \(2, 4, 8\)",
        ),
        (
            [{"include": ["roi_heads"], "strategy": "quant"}],
            {"values": "int8"},  # the call's options reach a rule that gives none
            r"DropIT rules\[0\]: option 'values' does not apply to strategy 'quant'",
        ),
        ([{"include": ["backbone"], "gama": 0.5}], {}, "unknown key 'gama'.*did you mean 'gamma'"),
        ([{"include": "backbone"}], {}, "DropIT rules\\[0\\] include must be a list of patterns"),
        ([{"include": ["backbone"], "options": [1]}], {}, "rules\\[0\\] options must be a dict"),
        ([{"include": ["backbone"], "relu": "no"}], {}, "rules\\[0\\]: option relu='no'"),
        (
            [{"include": ["backbone"], "relu": False, "options": {"relu": True}}],
            {},
            r"DropIT rules\[0\] gives relu twice, as a key and in options: keep one",
        ),
        (
            [{"include": ["backbone"], "options": {"norm": True}}],
            {},  # norm in options is the flag, checked as a rule key is: mink keeps too few
            r"DropIT rules\[0\]: option norm=true packs normalisation inputs",
        ),
        ({"include": ["backbone"]}, {}, "DropIT rules must be a list of rule dicts"),
        ([], {}, "DropIT rules is empty"),
        (["backbone"], {}, "DropIT rules\\[0\\] must be a dict"),
        (
            [{"include": ["backbone.body.relu"]}],
            {},
            r"DropIT rules\[0\] include=\['backbone.body.relu'\] .*selects no Conv2d",
        ),
    ],
)
def test_rule_errors_name_the_rule_and_leave_the_model_untouched(rules, kwargs, message) -> None:
    model = _model()
    with pytest.raises(ValueError, match=message):
        to_dropit(model, rules=rules, **kwargs)
    assert _converted_paths(model) == []


def test_check_rules_needs_no_model() -> None:
    checked = check_rules(MIXED, exclude=["roi_heads.box_predictor"], values="int8")
    assert [r.index for r in checked] == [0, 1]
    assert checked[0].strategy.describe() == "mink(gamma=0.8)"
    assert checked[0].strategy.codec.fmt == "int8"  # the call's options: rule 0 gives none
    assert checked[1].strategy.describe() == "quant(bits=4, group=256)"
    assert checked[1].exclude == ("roi_heads.box_predictor",)
    with pytest.raises(ValueError, match=r"rules\[1\]: unknown DropIT strategy 'q'"):
        check_rules([{"include": ["a"]}, {"include": ["b"], "strategy": "q"}])
    (only,) = check_rules(None, "random", 0.5, seed=3)
    assert only.index is None and only.strategy.describe() == "random(gamma=0.5)"


# -------------------------------------------------------------------------- the returned record


def test_the_record_says_which_setting_was_applied() -> None:
    record = dropit_record(to_dropit(_model(), strategy="parallel_mink", gamma=0.9, chunk=64))
    (setting,) = record.settings
    assert isinstance(setting, AppliedSetting)
    assert (setting.rule, setting.strategy, setting.gamma) == (None, "parallel_mink", 0.9)
    assert setting.options == {"chunk": 64}
    assert setting.description == "parallel_mink(gamma=0.9, chunk=64)"
    assert (setting.include, setting.exclude) == (("*",), ())
    assert (setting.layers, setting.relus) == (8, 5)
    assert record.skipped == ()
    assert record.summary() == (
        "DropIT parallel_mink(gamma=0.9, chunk=64): 8 conv/linear layers and 5 ReLUs (include *)"
    )


def test_the_record_of_rules_has_one_setting_per_rule() -> None:
    record = dropit_record(to_dropit(_model(), rules=MIXED, exclude=["roi_heads.box_predictor"]))
    assert [(s.rule, s.strategy, s.gamma, s.layers, s.relus) for s in record.settings] == [
        (0, "mink", 0.8, 2, 2),
        (1, "quant", 0.8, 4, 3),
    ]
    assert record.settings[1].options == {"bits": 4}
    assert record.settings[1].exclude == ("roi_heads.box_predictor",)
    assert record.summary().splitlines() == [
        "DropIT rules[0] mink(gamma=0.8): 2 conv/linear layers and 2 ReLUs "
        "(include backbone; exclude roi_heads.box_predictor)",
        "DropIT rules[1] quant(bits=4, group=256): 4 conv/linear layers and 3 ReLUs "
        "(include roi_heads; exclude roi_heads.box_predictor)",
    ]


def test_the_record_is_still_the_list_of_converted_layers() -> None:
    record = dropit_record(to_dropit(_model(), exclude=CONFIG_EXCLUDE))
    assert isinstance(record, list) and isinstance(record, DropITRecord)
    assert all(isinstance(r, ConvertedLayer) for r in record)
    assert record == list(record) and len(record) == 9 and record[0].path == "backbone.body.relu"
    assert [r.path for r in record[1:3]] == ["backbone.body.layer1.0", "backbone.body.layer1.1"]
    for again in (copy.deepcopy(record), pickle.loads(pickle.dumps(record))):
        assert again == record and again.settings == record.settings
        assert again.summary() == record.summary()


def test_to_dropit_returns_the_module_and_dropit_record_gives_what_it_converted() -> None:
    model = _model()
    before = model.state_dict().keys()
    converted = to_dropit(model, rules=MIXED, exclude=["roi_heads.box_predictor"])
    assert converted is model and isinstance(converted, TinyDetector)
    record = dropit_record(model)
    assert isinstance(record, DropITRecord)
    assert [r.path for r in record] == [p for p, _ in ALL if not p.startswith("roi_heads.box_p")]
    assert [(s.rule, s.strategy) for s in record.settings] == [(0, "mink"), (1, "quant")]
    assert model.state_dict().keys() == before  # the record is no buffer
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        again = dropit_record(copied)
        assert again is not record and again == record and again.summary() == record.summary()


def test_from_dropit_removes_the_record_and_a_plain_model_has_none() -> None:
    with pytest.raises(ValueError, match="TinyDetector has no DropIT record: it was not converted"):
        dropit_record(_model())
    model = _model()
    to_dropit(model, exclude=CONFIG_EXCLUDE)
    from_dropit(model)
    with pytest.raises(ValueError, match="from_dropit undid it"):
        dropit_record(model)
    # a submodule converted alone loses its record when its parent is turned back
    to_dropit(model.roi_heads)
    assert len(dropit_record(model.roi_heads)) > 0
    from_dropit(model)
    with pytest.raises(ValueError, match="no DropIT record"):
        dropit_record(model.roi_heads)


# ------------------------------------------------------------------ with activation checkpointing


class CheckpointedSequential(nn.Sequential):
    """A stand-in for dropit_core.recompute's subclasses: its forward runs under checkpoint."""

    dropit_checkpointed = True

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


def _checkpointed_model() -> TinyDetector:
    model = _model()
    model.backbone.body.layer1.__class__ = CheckpointedSequential
    return model


def test_layers_inside_a_checkpointed_module_stay_plain_and_are_recorded() -> None:
    model = _checkpointed_model()
    record = dropit_record(to_dropit(model, exclude=CONFIG_EXCLUDE))
    inside = ["backbone.body.layer1.0", "backbone.body.layer1.1"]
    assert record.skipped == tuple(inside)
    assert [r.path for r in record] == [
        "backbone.body.relu",
        "roi_heads.box_head.fc6",
        "roi_heads.box_head.relu6",
        "roi_heads.box_head.fc7",
        "roi_heads.box_head.relu7",
        "roi_heads.mask_predictor.conv5_mask",
        "roi_heads.mask_predictor.relu",
    ]
    assert type(model.backbone.body.layer1[0]) is nn.Conv2d
    assert type(model.backbone.body.layer1[1]) is nn.ReLU
    assert is_dropit(model.backbone.body.relu)
    assert record.settings[0].layers == 3 and record.settings[0].relus == 4
    assert record.summary().endswith(
        "left plain inside checkpointed modules: 2 layers "
        "(backbone.body.layer1.0, backbone.body.layer1.1)"
    )
    # The checkpointed layers' gradients are the plain model's, exactly.
    plain = _checkpointed_model()
    grads, ref = _train_step(model), _train_step(plain)
    for name in ("backbone.body.layer1.0.weight", "backbone.body.layer1.0.bias"):
        torch.testing.assert_close(grads[name], ref[name], rtol=0, atol=0)


def test_a_rule_whose_layers_are_all_checkpointed_converts_nothing_without_an_error() -> None:
    model = _checkpointed_model()
    rules = [{"include": ["backbone.body.layer1"]}, {"include": ["roi_heads"], "gamma": 0.5}]
    record = dropit_record(to_dropit(model, rules=rules))
    assert record.skipped == ("backbone.body.layer1.0", "backbone.body.layer1.1")
    assert [(s.layers, s.relus) for s in record.settings] == [(0, 0), (6, 3)]
    # The whole model checkpointed: nothing converted.
    whole = _model()
    whole.__class__ = type("CheckpointedDetector", (TinyDetector,), {"dropit_checkpointed": True})
    record = dropit_record(to_dropit(whole))
    assert list(record) == [] and len(record.skipped) == 13


def test_a_truthy_attribute_that_is_not_true_does_not_count() -> None:
    model = _model()
    model.backbone.body.layer1.__class__ = type(
        "Marked", (nn.Sequential,), {"dropit_checkpointed": "yes"}
    )
    record = dropit_record(to_dropit(model))
    assert record.skipped == () and len(record) == 13


def test_autocast_casts_are_asked_with_the_one_call_check() -> None:
    # casts.autocast_inputs asks torch's one-call "any autocast?" first, then the device's flag:
    # the casts autocast makes, outside autocast and in it.
    from dropit_core.layers import casts

    conv = to_dropit(nn.Sequential(nn.Conv2d(2, 3, 3)), strategy="quant", bits=4)[0]
    x = torch.randn(1, 2, 5, 5)
    w, b, dtype = casts.autocast_inputs(x, conv.weight, conv.bias, conv.dropit_cache)
    assert (w, b, dtype) == (conv.weight, conv.bias, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w, b, dtype = casts.autocast_inputs(x, conv.weight, conv.bias, conv.dropit_cache)
    assert dtype == torch.bfloat16 and w.dtype == b.dtype == torch.bfloat16
    assert torch.equal(w, conv.weight.to(torch.bfloat16))
