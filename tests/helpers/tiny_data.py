"""The prompts and the simple reward functions the trainer tests share (imported by module name, like
`tiny_configs`)."""

# 3 tokens each with the tiny kit's tokenizer: a batch of them needs no padding.
PROMPTS = ["The movie was", "I think the", "The weather today", "She walked to"]
# 2 or 3 tokens each.
SHORT_PROMPTS = ["The movie", "A story", "I think", "We saw"]


def length_reward(completions, **kwargs) -> list[float]:
    """A tenth of each completion's length in characters."""
    return [float(len(c)) / 10.0 for c in completions]


def env_reward(completions, **kwargs) -> list[float]:
    """A sequence-level environment reward in [0, 1): longer completions score higher."""
    return [min(len(c), 40) / 41 for c in completions]
