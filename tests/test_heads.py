"""Head pruning of the attention layouts people use: timm's fused ``qkv`` Attention and
``nn.MultiheadAttention`` (torchvision's ViT, ``nn.TransformerEncoderLayer``), through
torch-pruning; on model code others wrote, built from configs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchtame import apply_pass, load_data
from torchtame.data import SyntheticData
from torchtame.passes.attention import SplitMultiheadAttention, split_multihead


def _images(n: int = 32):
    return load_data(SyntheticData(source="synthetic", shape=[3, 32, 32], num_samples=n, batch_size=8), 0)


@pytest.mark.parametrize("batch_first", [True, False])
def test_split_multihead_computes_what_multihead_attention_does(batch_first: bool) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
    split = SplitMultiheadAttention.from_mha(mha).eval()
    x = torch.randn(3, 7, 32) if batch_first else torch.randn(7, 3, 32)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(7).bool()
    for kwargs in ({}, {"key_padding_mask": pad}, {"attn_mask": causal, "need_weights": False}):
        want, want_w = mha(x, x, x, **kwargs)
        got, got_w = split(x, x, x, **kwargs)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        if want_w is not None:
            torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-4)
    # nn.TransformerEncoderLayer calls it through its plain path
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    twin = copy.deepcopy(layer)
    assert split_multihead(twin, []) == ["self_attn"]
    y = torch.randn(2, 5, 32)
    torch.testing.assert_close(twin(y), layer(y), atol=1e-5, rtol=1e-4)


def test_timm_fused_qkv_heads_are_pruned_and_the_model_exports(tmp_path) -> None:
    import timm

    torch.manual_seed(0)
    vit = timm.create_model(
        "vit_small_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10
    ).eval()
    data = _images()
    v = apply_pass("prune.structured", vit, data, {"ratio": 0.25})
    assert v.info["attention_heads"] == {"blocks.0.attn": [6, 4], "blocks.1.attn": [6, 4]}
    attn = v.module.blocks[0].attn
    assert attn.qkv.out_features == 3 * 4 * 64 and attn.proj.in_features == 4 * 64
    assert attn.head_dim == 64 and attn.attn_dim == 256  # head width, hence the softmax scale, kept
    assert v.module.patch_embed.proj.out_channels == 384  # the model width is kept
    assert v.info["macs_fraction"] < 0.8
    onnx = apply_pass("export.onnx", v.module, data, work_dir=tmp_path)
    assert onnx.info["parity"]["max_abs_error"] < 1e-3
    # heads only: `ratio: 0` with a `head_ratio` leaves every other layer whole
    heads = apply_pass("prune.structured", vit, data, {"ratio": 0.0, "head_ratio": 0.25})
    assert heads.info["attention_heads"]["blocks.1.attn"] == [6, 4]
    assert heads.module.blocks[0].mlp.fc1.out_features == vit.blocks[0].mlp.fc1.out_features


def test_torchvision_vit_heads_are_pruned_and_distillation_recovers(tmp_path) -> None:
    import torchvision

    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=12, hidden_dim=192, mlp_dim=384, num_classes=10
    ).eval()
    nn.init.normal_(vit.heads.head.weight, std=0.2)  # torchvision starts the head at zero
    data = _images(128)
    # without the least-squares refit (tests/test_reconstruct.py), so distillation has a gap to close
    v = apply_pass("prune.structured", vit, data, {"ratio": 0.25, "reconstruct": False})
    assert v.info["multihead_split"] == [f"encoder.layers.encoder_layer_{i}.self_attention" for i in (0, 1)]
    assert v.info["attention_heads"]["encoder.layers.encoder_layer_0.self_attention"] == [12, 9]
    assert v.module.conv_proj.out_channels == 192
    x = torch.cat([b for b, _ in data.evaluation])

    def cosine(m: nn.Module) -> float:
        with torch.no_grad():
            return nn.functional.cosine_similarity(m(x), vit(x)).mean().item()

    before = cosine(v.module)
    tuned = apply_pass(
        "finetune", v.module, data, {"loss": "distill", "steps": 100, "lr": 2e-3}, baseline=vit
    )
    # random weights and inputs: distillation moves fidelity on held-apart inputs, if not to float's
    assert cosine(tuned.module) > before + 0.03, (before, cosine(tuned.module))
    onnx = apply_pass("export.onnx", tuned.module, data, work_dir=tmp_path)
    assert onnx.info["parity"]["max_abs_error"] < 1e-3


def _attention_error(student: nn.Module, teacher: nn.Module, names: list[str], x: torch.Tensor) -> float:
    """Mean normalised MSE of the named modules' outputs, student against teacher."""
    from torchtame.training import _outputs_of, intermediate_loss

    with torch.no_grad(), _outputs_of(student, names) as s, _outputs_of(teacher, names) as t:
        student(x), teacher(x)
        return intermediate_loss(s, t).item()


def test_distillation_can_match_attention_outputs_after_head_pruning() -> None:
    """`intermediate: attention` finds timm's and torchvision's attention modules (the split
    MultiheadAttention of a pruned torchvision ViT under the same name) and teaches each pruned one
    what the full one computed: its outputs come closer than logits-only distillation brings them."""
    import timm
    import torchvision

    from torchtame.training import intermediate_modules

    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)
    vit = vit.eval()
    data = _images(64)
    pruned = apply_pass(
        "prune.structured", vit, data, {"ratio": 0.0, "head_ratio": 0.25, "reconstruct": False}
    )
    names = intermediate_modules(vit, pruned.module, "attention")
    assert names == ["blocks.0.attn", "blocks.1.attn"]
    tv = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=12, hidden_dim=192, mlp_dim=384
    ).eval()
    split = apply_pass("prune.structured", tv, data, {"ratio": 0.0, "head_ratio": 0.25}).module
    assert intermediate_modules(tv, split, "attention") == [
        f"encoder.layers.encoder_layer_{i}.self_attention" for i in (0, 1)
    ]
    x = torch.cat([b for b, _ in data.evaluation])
    train = {"loss": "distill", "steps": 30, "lr": 1e-3, "logits_loss": "cosine"}
    errors = {"before": _attention_error(pruned.module, vit, names, x)}
    for which in ("none", "attention"):
        tuned = apply_pass("finetune", pruned.module, data, {**train, "intermediate": which}, baseline=vit)
        errors[which] = _attention_error(tuned.module, vit, names, x)
    assert errors["attention"] < 0.6 * errors["none"] and errors["attention"] < 0.9 * errors["before"], errors


def test_intermediate_distillation_refuses_what_it_cannot_match() -> None:
    import timm

    from torchtame.errors import DataError

    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=10)
    vit = vit.eval()
    data = _images(32)
    pruned = apply_pass("prune.structured", vit, data, {"ratio": 0.25, "reconstruct": False}).module
    train = {"loss": "distill", "steps": 2}
    with pytest.raises(ValueError, match="set `loss: distill`"):
        apply_pass("finetune", pruned, data, {"intermediate": "attention", "steps": 2}, baseline=vit)
    with pytest.raises(DataError, match=r"does not have: blocks\.7\.attn"):
        apply_pass("finetune", pruned, data, {**train, "intermediate": ["blocks.7.attn"]}, baseline=vit)
    # the FFN's hidden width was pruned: its outputs cannot be compared
    with pytest.raises(DataError, match=r"module blocks.0.mlp.fc1 gives shape .* in the model being trained"):
        apply_pass("finetune", pruned, data, {**train, "intermediate": ["blocks.0.mlp.fc1"]}, baseline=vit)
