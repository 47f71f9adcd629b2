"""The HF-generate sampler log-prob recorder sees exactly the distribution `generate` samples from."""

import pytest
import torch
from transformers import GenerationConfig

from trl_stable.testing import build_causal_lm
from trl_stable.trainers.sampler_logprobs import record_sampler_logps


@pytest.mark.parametrize(
    "family, sampling",
    [
        ("qwen2", {"temperature": 1.0}),
        ("qwen2", {"temperature": 0.7, "top_k": 20, "top_p": 0.9}),
        ("gpt2", {"temperature": 1.3, "min_p": 0.001, "repetition_penalty": 1.2}),
    ],
)
def test_recorder_matches_generate_processed_scores(tokenizer, family, sampling):
    model = build_causal_lm(family, tokenizer, seed=0)
    enc = tokenizer(["The movie was", "I think the weather today"], return_tensors="pt", padding=True)
    config = GenerationConfig(
        max_new_tokens=6,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        output_scores=True,
        return_dict_in_generate=True,
        **sampling,
    )
    torch.manual_seed(0)
    with record_sampler_logps(model) as recorder:
        out = model.generate(**enc, generation_config=config)
    assert "_get_logits_processor" not in vars(model)  # the patch is undone
    completions = out.sequences[:, enc["input_ids"].size(1) :]
    # `scores` are the processed scores generate sampled from (after every warper)
    expected = torch.log_softmax(torch.stack(out.scores, 1), -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    ragged = [row[: 3 + i].tolist() for i, row in enumerate(completions)]  # rows may end early (EOS)
    recorded = recorder.per_token_logps(ragged)
    for i, row in enumerate(recorded):
        assert len(row) == len(ragged[i])
        torch.testing.assert_close(torch.tensor(row), expected[i, : len(row)])
    assert all(torch.isfinite(torch.tensor(row)).all() for row in recorded)


def test_recorder_restores_on_error(tokenizer):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    with pytest.raises(RuntimeError, match="boom"):
        with record_sampler_logps(model):
            raise RuntimeError("boom")
    assert "_get_logits_processor" not in vars(model)
