"""Structured pruning with torch-pruning: criteria, ratios, targets, fine-tuning, reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchtame import PassError, apply_pass
from torchtame.artifacts import load_module, save_module
from torchtame.evaluate.macs import count_macs_params

from .conftest import accuracy


@pytest.mark.parametrize("criterion", ["l1", "l2", "bn_scale", "taylor", "lamp", "fpgm", "random"])
def test_each_criterion_prunes_as_asked(trained_cnn, digits, criterion) -> None:
    v = apply_pass("prune.structured", trained_cnn, digits, {"importance": criterion, "ratio": 0.5})
    assert v.module.features[0].out_channels == 8  # 16 -> 8
    assert v.module.features[3].out_channels == 16  # 32 -> 16
    assert v.module.classifier[4].out_features == 10  # the head is left alone
    assert v.info["ignored_layers"] == ["classifier.4"]
    with torch.inference_mode():
        assert v.module(digits.example_input(3)).shape == (3, 10)


def test_criteria_choose_different_channels(trained_cnn, digits) -> None:
    kept = {}
    for criterion in ("l2", "random"):
        v = apply_pass("prune.structured", trained_cnn, digits, {"importance": criterion, "ratio": 0.5})
        kept[criterion] = v.module.features[0].weight.detach().clone()
    assert not torch.equal(kept["l2"], kept["random"])


def _planted_mlp() -> nn.Module:
    """Four hidden channels on digits where the criteria must disagree: c0 many small weights
    (large L1, small L2), c1 one large weight on pixel 0, which is 0 in every digit (large norm,
    no gradient), c2 tiny, c3 nearly parallel to c1 but also on a central pixel."""
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 10))
    with torch.no_grad():
        w = torch.zeros(4, 64)
        w[0, 10:18] = 0.5  # L1 4.0, L2 1.41
        w[1, 0] = 3.0  # L1 3.0, L2 3.0, but its input is always 0
        w[2, 20:28] = 0.1  # L1 0.8, L2 0.28
        w[3, 0], w[3, 36] = 2.9, 0.3  # L1 3.2, L2 2.92, almost the direction of c1
        m[1].weight.copy_(w)
        m[1].bias.zero_()
        m[3].weight.fill_(0.1)
        m[3].bias.zero_()
    return m.eval()


@pytest.mark.parametrize(
    ("criterion", "check"),
    [
        ("l1", lambda kept: kept == {0, 3}),  # the largest sums of |w|
        ("l2", lambda kept: kept == {1, 3}),  # the largest norms
        ("lamp", lambda kept: kept == {1, 3}),  # within one layer LAMP keeps magnitude's order
        ("taylor", lambda kept: 1 not in kept),  # |w * grad| is 0 where the input is always 0
        ("fpgm", lambda kept: not {1, 3} <= kept),  # the geometric median drops one of a parallel pair
    ],
)
def test_each_criterion_chooses_by_its_own_rule(digits, criterion, check) -> None:
    planted = _planted_mlp()
    v = apply_pass("prune.structured", planted, digits, {"importance": criterion, "ratio": 0.5})
    rows = v.module[1].weight
    kept = {i for i in range(4) for row in rows if torch.equal(planted[1].weight[i], row)}
    assert len(kept) == 2 and check(kept), (criterion, sorted(kept))


def test_bn_scale_keeps_the_largest_gammas(trained_cnn, digits) -> None:
    gamma = trained_cnn.features[1].weight.detach().abs()
    keep = set(gamma.argsort(descending=True)[:8].tolist())
    v = apply_pass("prune.structured", trained_cnn, digits, {"importance": "bn_scale", "ratio": 0.5})
    kept = v.module.features[1].weight.detach().abs()
    assert sorted(kept.tolist()) == pytest.approx(sorted(gamma[list(keep)].tolist()))


def test_l2_beats_random_on_the_fixed_model(trained_cnn, digits) -> None:
    acc = {}
    for criterion in ("l2", "random"):
        opts = {"importance": criterion, "ratio": 0.5, "reconstruct": False}
        v = apply_pass("prune.structured", trained_cnn, digits, opts)
        acc[criterion] = accuracy(v.module, digits.evaluation)
    # without fine-tuning the criteria are erratic (random can win at 30%); at 50% on this seeded
    # model magnitude keeps far more: 74.8% vs 22.8% (the least-squares refit of the classifier
    # lifts both to about 95%, so the criteria are compared without it)
    assert acc["l2"] > acc["random"] + 10, acc


def test_layer_ratios_round_to_and_ignored(trained_cnn, digits) -> None:
    v = apply_pass(
        "prune.structured",
        trained_cnn,
        digits,
        {
            "ratio": 0.25,
            "layer_ratios": {"features.0": 0.5},
            "ignored_layers": ["features.7", "classifier.4"],
            "round_to": 4,
        },
    )
    assert v.module.features[0].out_channels == 8
    assert v.module.features[3].out_channels == 24
    assert v.module.features[7].out_channels == 64  # ignored
    for name, (_, after) in v.info["channels"].items():
        if name not in ("classifier.4",):
            assert after % 4 == 0, (name, after)


def test_global_pruning_and_iterative_steps(trained_cnn, digits) -> None:
    v = apply_pass(
        "prune.structured", trained_cnn, digits, {"ratio": 0.5, "global_pruning": True, "iterative_steps": 3}
    )
    assert len(v.info["steps"]) == 3
    macs = [s["macs"] for s in v.info["steps"]]
    assert macs[0] > macs[1] > macs[2]


@pytest.mark.parametrize("kind", ["macs", "params"])
def test_target_fraction_is_met(trained_cnn, digits, kind) -> None:
    example = digits.example_input(1)
    base_macs, base_params = count_macs_params(trained_cnn, example)
    v = apply_pass("prune.structured", trained_cnn, digits, {"target": {kind: 0.5}})
    macs, params = count_macs_params(v.module, example)
    frac = macs / base_macs if kind == "macs" else params / base_params
    assert frac <= 0.5, frac
    assert frac >= 0.25, frac  # it stopped near the target, not at the maximum


def test_finetune_recovers_accuracy(trained_cnn, digits) -> None:
    pruned = apply_pass("prune.structured", trained_cnn, digits, {"ratio": 0.6, "reconstruct": False})
    before = accuracy(pruned.module, digits.evaluation)
    tuned = apply_pass("finetune", pruned, digits, {"epochs": 3, "lr": 2e-3})
    after = accuracy(tuned.module, digits.evaluation)
    assert after > before, (before, after)
    assert after >= 94.0
    assert tuned.info["finetuned_from"] == pruned.name


def test_finetune_between_iterative_steps(trained_cnn, digits) -> None:
    opts = {"ratio": 0.6, "iterative_steps": 3}
    plain = apply_pass("prune.structured", trained_cnn, digits, opts)
    tuned = apply_pass("prune.structured", trained_cnn, digits, {**opts, "finetune_between": {"steps": 30}})
    assert accuracy(tuned.module, digits.evaluation) > accuracy(plain.module, digits.evaluation)


def test_pruned_model_reloads_with_equal_outputs(trained_cnn, digits, tmp_path: Path) -> None:
    v = apply_pass("prune.structured", trained_cnn, digits, {"ratio": 0.5})
    path = save_module(v, tmp_path, digits.example_input(1))
    again = load_module(path)
    x = digits.example_input(16)
    with torch.inference_mode():
        assert torch.equal(v.module(x), again(x))
    assert again.features[0].out_channels == 8


def test_multihead_attention_heads_are_pruned_and_the_width_kept(digits) -> None:
    """nn.MultiheadAttention ties its packed projection to the model width: it is split into q/k/v
    Linears, whose heads torch-pruning removes; the FFN is pruned consistently; the model runs.
    With ``prune_heads: false`` its heads stay whole."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 64, dropout=0.0, batch_first=True)
    model = nn.Sequential(
        nn.Flatten(1),
        nn.Unflatten(1, (8, 8)),
        nn.Linear(8, 16),
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
    )

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = model, nn.Linear(16, 10)

        def forward(self, x):
            return self.head(self.body(x).mean(1))

    v = apply_pass("prune.structured", Head().eval(), digits, {"ratio": 0.5})
    names = ["body.3.layers.0.self_attn", "body.3.layers.1.self_attn"]
    assert v.info["multihead_split"] == names  # split into q/k/v projections, then head-pruned
    assert v.info["attention_heads"] == {n: [4, 2] for n in names}
    assert [lyr.linear1.out_features for lyr in v.module.body[3].layers] == [32, 32]
    assert all(lyr.self_attn.embed_dim == 16 for lyr in v.module.body[3].layers)  # the width is kept
    kept = apply_pass("prune.structured", Head().eval(), digits, {"ratio": 0.5, "prune_heads": False})
    assert kept.info["heads_kept_whole"] == names
    with torch.inference_mode():
        assert v.module(digits.example_input(3)).shape == (3, 10)


def test_unknown_attention_layout_is_named(digits) -> None:
    class FusedAttention(nn.Module):  # one fused qkv projection: no head layout torchtame knows
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out, self.heads = nn.Linear(16, 48), nn.Linear(16, 16), 4

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            return self.out(torch.softmax(q @ k.transpose(1, 2), -1) @ v)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.attn, self.head = nn.Linear(8, 16), FusedAttention(), nn.Linear(16, 10)

        def forward(self, x):
            return self.head(self.attn(self.proj(x.reshape(x.shape[0], 8, 8))).mean(1))

    with pytest.raises(PassError) as info:
        apply_pass("prune.structured", Model().eval(), digits, {"ratio": 0.5})
    assert "'attn'" not in str(info.value) and "attn (FusedAttention)" in str(info.value)
    assert "ignored_layers: [attn]" in str(info.value)
    v = apply_pass(
        "prune.structured", Model().eval(), digits, {"ratio": 0.5, "ignored_layers": ["attn", "head"]}
    )
    with torch.inference_mode():
        assert v.module(digits.example_input(2)).shape == (2, 10)


def test_prune_refuses_quantized_parent(trained_mlp, digits) -> None:
    q = apply_pass("quantize.dynamic", trained_mlp, digits)
    with pytest.raises(PassError, match="prune first"):
        apply_pass("prune.structured", q, digits)
