"""Least-squares reconstruction of the layers whose inputs pruning removed."""

from __future__ import annotations

import copy

import torch
from torch import nn

from torchtame import apply_pass, load_data
from torchtame.data import SyntheticData
from torchtame.passes.reconstruct import reconstruct_pruned_linears


def _pruned_pair(dependent: bool) -> tuple[nn.Module, nn.Module]:
    """An MLP and a copy with 4 of its 16 hidden units removed by hand (no activation between, so
    where the removed units are linear combinations of the kept ones, nothing is lost)."""
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 16), nn.Identity(), nn.Linear(16, 4))
    with torch.no_grad():
        if dependent:
            mix = torch.randn(4, 12)
            full[0].weight[12:] = mix @ full[0].weight[:12]
            full[0].bias[12:] = mix @ full[0].bias[:12]
    pruned = copy.deepcopy(full)
    keep = slice(0, 12)
    pruned[0] = nn.Linear(8, 12)
    pruned[2] = nn.Linear(12, 4)
    with torch.no_grad():
        pruned[0].weight.copy_(full[0].weight[keep])
        pruned[0].bias.copy_(full[0].bias[keep])
        pruned[2].weight.copy_(full[2].weight[:, keep])
        pruned[2].bias.copy_(full[2].bias)
    return full, pruned


def test_a_removed_unit_that_the_kept_ones_span_is_recovered_exactly() -> None:
    full, pruned = _pruned_pair(dependent=True)
    batches = [torch.randn(32, 8) for _ in range(4)]
    info = reconstruct_pruned_linears(pruned, full, batches, damp=1e-9)
    before, after = info["relative_error"]["2"]
    assert before > 0.1 and after < 1e-4, info
    x = torch.randn(64, 8)
    torch.testing.assert_close(pruned(x), full(x), atol=1e-3, rtol=1e-3)
    assert info["layers"] == 1 and "skipped" not in info


def test_reconstruction_lowers_the_error_and_never_raises_it() -> None:
    full, pruned = _pruned_pair(dependent=False)
    x = torch.randn(256, 8)
    err = lambda: ((pruned(x) - full(x)).norm() / full(x).norm()).item()  # noqa: E731
    with torch.no_grad():
        start = err()
        info = reconstruct_pruned_linears(pruned, full, [x[:128], x[128:]])
        assert err() < start
    before, after = info["relative_error"]["2"]
    assert after <= before


def test_a_layer_called_twice_is_left_as_pruned() -> None:
    class Twice(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, width), nn.Linear(width, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.b(self.a(x))[..., : self.b.in_features])

    torch.manual_seed(0)
    full, pruned = Twice(6), Twice(5)  # the pruned layer b takes fewer inputs
    weight = pruned.b.weight.detach().clone()
    info = reconstruct_pruned_linears(pruned, full, [torch.randn(8, 4)])
    assert info == {**info, "layers": 0, "skipped": ["b"]}
    torch.testing.assert_close(pruned.b.weight, weight)


def test_pruning_timm_heads_reconstructs_and_fidelity_rises() -> None:
    import timm

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10).eval()
    data = load_data(SyntheticData(source="synthetic", shape=[3, 32, 32], num_samples=128, batch_size=16), 0)
    x = torch.cat([b for b, _ in data.evaluation])
    cos = lambda m: nn.functional.cosine_similarity(m(x), vit(x)).mean().item()  # noqa: E731
    plain = apply_pass("prune.structured", vit, data, {"ratio": 0.25, "reconstruct": False})
    refit = apply_pass("prune.structured", vit, data, {"ratio": 0.25})
    assert "reconstruction" not in plain.info
    info = refit.info["reconstruction"]
    assert sorted(info["relative_error"]) == [
        f"blocks.{i}.{n}" for i in (0, 1) for n in ("attn.proj", "mlp.fc2")
    ]
    assert all(after < before for before, after in info["relative_error"].values())
    with torch.no_grad():
        # held-apart inputs: the refit generalises beyond the calibration batches it was fitted on
        assert cos(refit.module) > cos(plain.module) + 0.05, (cos(plain.module), cos(refit.module))
    assert refit.info["macs_fraction"] == plain.info["macs_fraction"]


def test_finetune_keeps_the_weights_with_the_lowest_calibration_loss(trained_cnn, digits) -> None:
    """Fine-tuning at too high a rate only raises the held-apart loss: `keep_best` returns the
    weights it started from and says so; the training itself is the same run as without it (its
    scoring leaves the random stream of dropout alone). Weights the refit fitted on calibration
    batches are not judged on those: the later batches judge, or where the refit read them all the
    best trained epoch is kept (on them the refit always looked best: the quickstart's pruned CNN
    lost 0.75 points of top-1 that fine-tuning had won)."""
    opts = {"epochs": 2, "lr": 0.05}
    raw = trained_cnn
    kept = apply_pass("finetune", raw, digits, opts)
    last = apply_pass("finetune", raw, digits, {**opts, "keep_best": False})
    assert kept.info["epoch_losses"] == last.info["epoch_losses"]
    losses = kept.info["held_out_loss"]
    assert len(losses) == 3 and kept.info["kept_epoch"] == losses.index(min(losses))
    assert kept.info["kept_epoch"] == 0 and "lower `lr`" in kept.info["kept"], losses
    for a, b in zip(kept.module.state_dict().values(), raw.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(last.module.state_dict().values(), raw.state_dict().values(), strict=True)
    )
    batches = len(digits.calibration)
    assert batches >= 2
    refit_all = apply_pass("prune.structured", trained_cnn, digits, {"ratio": 0.5})
    assert refit_all.info["reconstruction"]["batches"] == batches
    tuned = apply_pass("finetune", refit_all, digits, opts)
    assert tuned.info["kept_epoch"] >= 1 and "start_not_judged" in tuned.info, tuned.info
    refit_one = apply_pass("prune.structured", trained_cnn, digits, {"ratio": 0.5, "reconstruct_batches": 1})
    tuned = apply_pass("finetune", refit_one, digits, {"epochs": 1, "lr": 2e-3})
    assert tuned.info["held_out_on"].startswith("calibration batches after the 1 ")
    assert "start_not_judged" not in tuned.info
    # where training helps (no refit), the later weights are kept
    raw = apply_pass("prune.structured", trained_cnn, digits, {"ratio": 0.5, "reconstruct": False})
    tuned = apply_pass("finetune", raw, digits, {"epochs": 2, "lr": 2e-3})
    assert tuned.info["kept_epoch"] > 0 and "kept" not in tuned.info, tuned.info["held_out_loss"]
