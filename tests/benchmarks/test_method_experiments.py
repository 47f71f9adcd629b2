"""The method experiments (`benchmarks/exp_*.py`) run in their `--quick` mode, and what they measure is measured right:
each quick run is checked against an independent count (TRL's own metric, the arms' shared start) or a property of
its injected fault."""

from __future__ import annotations

import exp_gdpo
import exp_icepop
import exp_ngrpo
import exp_routing_replay
import numpy as np
import pytest
import torch

from trl_stable.testing import build_causal_lm


def test_ngrpo_quick(tmp_path):
    png = tmp_path / "ngrpo.png"
    summary = exp_ngrpo.main(["--quick", "--png", str(png)])
    assert png.stat().st_size > 0
    for init in ("random", "confident"):
        grpo, ngrpo = summary[f"{init}/grpo"], summary[f"{init}/ngrpo"]
        # under GRPO a group has no gradient exactly when its rewards are all equal: TRL's own count
        np.testing.assert_allclose(grpo["zero_grad"], grpo["trl_frac_reward_zero_std"])
        # step 1 (same weights, same samples in both arms): at 1-3% success no group is all right, so under NGRPO
        # every group carries a gradient, while GRPO loses its all-wrong groups
        for seed in range(2):
            assert ngrpo["zero_grad"][seed][0] == 0.0
            assert grpo["zero_grad"][seed][0] > 0.0


def test_ngrpo_start_distribution_is_a_distribution():
    for init in ("confident", "plausible"):
        target = exp_ngrpo.start_distribution(init, 100, wrong=3, alternatives=list(range(10, 26)), prob=0.8)
        assert torch.isclose(target.sum(), torch.tensor(1.0)) and (target >= 0).all()
        assert target[3].item() == pytest.approx(0.8)
    plausible = exp_ngrpo.start_distribution("plausible", 100, wrong=3, alternatives=list(range(10, 26)), prob=0.8)
    assert plausible[10:26].sum().item() == pytest.approx(0.2 * 3 / 4 + 0.2 / 4 * 16 / 99)


def test_gdpo_quick(tmp_path):
    summary = exp_gdpo.main(["--quick", "--png", str(tmp_path / "gdpo.png")])
    for name in ("coverage", "answer"):
        # both arms of a seed start from the same weights and draw the same first batch
        assert summary["grpo"][name]["start"] == summary["gdpo"][name]["start"]
        assert all(np.isfinite(summary[arm][name]["final"]).all() for arm in ("grpo", "gdpo"))


def test_mismatched_sampler_only_perturbs_generation(tokenizer):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    ids = torch.tensor([tokenizer("The movie was")["input_ids"]])
    with torch.no_grad():
        clean = model(ids).logits
        sampler = exp_icepop.MismatchedSampler(model, prob=1.0, std=2.0, temperature=1.0, seed=0)
        assert torch.equal(model(ids).logits, clean)  # the trainer's passes see the policy itself
        with sampler.perturbed():
            noisy = model(ids).logits
        assert not torch.allclose(noisy, clean)
        assert torch.equal(model(ids).logits, clean)
    assert not exp_icepop.MismatchedSampler(model, prob=0.0, std=0.0, temperature=1.0, seed=0).active


def test_icepop_quick(tmp_path):
    summary = exp_icepop.main(["--quick", "--png", str(tmp_path / "icepop.png")])
    assert set(summary) == set(exp_icepop.ARMS)
    for arm in exp_icepop.ARMS:
        assert np.isfinite(summary[arm]["rel_var"]).all() and np.isfinite(summary[arm]["cos_median"]).all()
    # the injected noise hits 25% of the sampler's positions: IcePop's ratio band catches a large share of them
    assert min(summary["icepop"]["masked"]) > 0.05
    assert summary["trl"]["masked"] is None and summary["decoupled"]["masked"] is None


def _logps(model, enc):
    logits = model(**enc).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, enc["input_ids"][:, 1:, None])[..., 0]


def test_noisy_routing_flips_experts_and_replay_reproduces_the_recorded_pass(tokenizer):
    from trl_stable.moe import RoutingReplay, mask_routing

    enc = tokenizer(
        ["The movie was great and the cast", "I think the weather today is"], return_tensors="pt", padding=True
    )
    model = exp_routing_replay.drifting_moe(tokenizer, seed=0, init_range=0.2, expert_scale=10.0).eval()
    with torch.no_grad():
        clean = _logps(model, enc)
        replay = RoutingReplay(model)  # hooked before the noise: the noise hook still runs first
        silent = exp_routing_replay.NoisyRouting(model, std=0.0, seed=0)
        assert torch.equal(_logps(model, enc), clean)  # the family's own gates at the router's own experts
        for handle in silent.handles:
            handle.remove()
        exp_routing_replay.NoisyRouting(model, std=0.3, seed=0)
        with replay.record():
            recorded = _logps(model, enc)
        routing = mask_routing(replay.export(), enc["attention_mask"])
        again = _logps(model, enc)
        with replay.replay(routing):
            replayed = _logps(model, enc)
    assert not torch.allclose(recorded, again)  # fresh noise, other experts, other log-probs
    torch.testing.assert_close(replayed, recorded, rtol=0, atol=1e-6)  # replay overrides the noise


def test_routing_replay_quick(tmp_path):
    summary = exp_routing_replay.main(["--quick", "--png", str(tmp_path / "routing.png")])
    assert set(summary) == {"r3/off", "r3/R3", "r2/off", "r2/R2"}
    # step 1, same weights and noise draws in both arms: replaying the sampler's experts brings the trainer's
    # log-probs back to the sampler's, so the largest behaviour weight shrinks toward 1
    for off, replayed in zip(summary["r3/off"]["spread_first"], summary["r3/R3"]["spread_first"]):
        assert replayed < off
