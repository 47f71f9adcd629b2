"""SFT step loss masks, masked cross-entropy, the step-masked SFT trainer and step masks for RL.

Documentation: docs/agent_steps.md.
"""

from trl_stable.masking.completion_steps import CompletionStepMasker, apply_step_mask
from trl_stable.masking.loss import masked_cross_entropy
from trl_stable.masking.mask import StepMask, StepSpanError, build_step_loss_mask, char_span_to_tokens, decode_offsets
from trl_stable.masking.sft import (
    StepMaskCollator,
    StepMaskedSFTConfig,
    StepMaskedSFTTrainer,
    build_step_masked_dataset,
    step_mask_example,
)
from trl_stable.masking.transcript import TranscriptSteps, classify_exec_output, find_transcript_steps
from trl_stable.masking.validation import (
    StepVerdict,
    find_tool_call_spans,
    load_tools,
    normalize_signatures,
    parse_tool_call,
    schema_errors,
    validate_step,
    validate_tool_call,
)

__all__ = [
    "CompletionStepMasker",
    "StepMask",
    "StepMaskCollator",
    "StepMaskedSFTConfig",
    "StepMaskedSFTTrainer",
    "StepSpanError",
    "StepVerdict",
    "TranscriptSteps",
    "apply_step_mask",
    "build_step_loss_mask",
    "build_step_masked_dataset",
    "char_span_to_tokens",
    "classify_exec_output",
    "decode_offsets",
    "find_tool_call_spans",
    "find_transcript_steps",
    "load_tools",
    "masked_cross_entropy",
    "normalize_signatures",
    "parse_tool_call",
    "schema_errors",
    "step_mask_example",
    "validate_step",
    "validate_tool_call",
]
