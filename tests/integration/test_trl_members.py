"""Contract tests: each private TRL / transformers member named in `trl_stable.integration.trl_members`, and each piece
of TRL logic named in `trl_stable.integration.mirrored`, is what trl_stable relies on.

A TRL or transformers upgrade that renames a member, reorders its parameters, changes its return arity or the keys of
its batch dict, or rewrites logic trl_stable mirrors fails here, with the member's name in the message.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
import trl
from datasets import Dataset
from tiny_configs import tiny_grpo_args
from tiny_data import length_reward

from trl_stable import GRPOTrainer
from trl_stable.integration.mirrored import LOGPS_FORWARD_SNIPPETS, MIRRORED
from trl_stable.integration.patching import wrapped_method
from trl_stable.integration.trl_members import (
    CONFIG_NAME_ATTRIBUTE,
    ENGINE_MEMBERS,
    GRPO_BATCH_KEYS,
    GRPO_MEMBERS,
    GRPO_OPTIONAL_BATCH_KEYS,
    GRPO_PADDING,
    HELPER_MEMBERS,
    PPO_MEMBERS,
    TRANSFORMERS_MEMBERS,
    VLLM_MEMBERS,
)
from trl_stable.testing import build_causal_lm
from trl_stable.trainers.grpo.forward_passes import is_reference_pass, with_mask_position_ids
from trl_stable.trainers.grpo.trl_batch import (
    concat_rows,
    forward_kwargs,
    loss_mask,
    multimodal_forward_keys,
    num_items_in_batch,
    process_slice,
    select_rows,
)
from trl_stable.trainers.grpo.trl_logs import replace_logged_advantages


def _resolve(dotted: str):
    """A module, or an attribute path inside the longest importable module prefix (`a.b.Class.method`)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _calls(function) -> set[str]:
    """Every call in `function`'s body, as the AST spells its callee (``self.save_model``, ``os.path.join``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


METHODS = [
    m
    for m in GRPO_MEMBERS + TRANSFORMERS_MEMBERS + HELPER_MEMBERS + PPO_MEMBERS + ENGINE_MEMBERS
    if m.kind != "attribute"
]
METHODS += [m for m in VLLM_MEMBERS if m.kind == "call"]
ATTRIBUTES = [m for m in GRPO_MEMBERS if m.kind == "attribute"]


@pytest.mark.parametrize("member", METHODS, ids=lambda m: f"{m.owner}.{m.name}")
def test_method_exists_with_the_parameters_we_pass(member):
    owner = _resolve(member.owner)
    assert hasattr(owner, member.name), f"{member.owner}.{member.name} is gone (used in {', '.join(member.used_in)})"
    params = [p for p in inspect.signature(getattr(owner, member.name)).parameters if p != "self"]
    assert tuple(params[: len(member.params)]) == member.params, (
        f"{member.owner}.{member.name}: trl_stable relies on the leading parameters {member.params}, TRL now has "
        f"{tuple(params)} (used in {', '.join(member.used_in)})"
    )


def test_configs_carry_the_name_they_were_loaded_from(tmp_path, tokenizer):
    model = build_causal_lm("gpt2", tokenizer)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(loaded.config, CONFIG_NAME_ATTRIBUTE) == str(tmp_path), (
        f"transformers.PretrainedConfig.{CONFIG_NAME_ATTRIBUTE} no longer holds the load path (used in "
        "trl_stable/trainers/ppo/ppo_trainer.py and ppo_rewards.py)"
    )


def test_ppo_helpers_return_what_ppo_reads():
    from trl.trainer.utils import selective_log_softmax_and_entropy

    logits, index = torch.randn(2, 3, 5), torch.randint(5, (2, 3))
    logps, entropy = selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=False, temperature=2.0)
    expected = (logits / 2.0).log_softmax(-1)
    torch.testing.assert_close(logps, expected.gather(-1, index.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(entropy, -(expected.exp() * expected).sum(-1))


def test_multimodal_forward_keys_are_the_ones_trl_forwards():
    # if TRL adds one, trl_stable follows it; this pins the set so the change is noticed and reviewed
    assert set(multimodal_forward_keys()) == {
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    }, "trl.GRPOTrainer._get_per_token_logps_and_entropies: its multimodal parameters changed"
    assert forward_kwargs({"pixel_values": 1, "prompt_ids": 2}) == {"pixel_values": 1}


@pytest.mark.parametrize("mirror", MIRRORED, ids=lambda m: f"{m.trl_member}->{m.ours.rsplit('.', 1)[-1]}")
def test_mirrored_trl_logic_is_unchanged(mirror):
    _resolve(mirror.ours)  # trl_stable's side still exists under the name the registry gives
    assert mirror.relation in ("mirrors", "relies on"), mirror.relation
    member = _resolve(mirror.trl_member)
    source = inspect.getsource(member)
    for snippet in mirror.snippets:
        assert snippet in source, (
            f"{mirror.trl_member} no longer contains {snippet!r}, which {mirror.ours} {mirror.relation}: update "
            f"{mirror.ours}"
        )
    if mirror.calls:
        calls = _calls(member)
        assert calls == set(mirror.calls), (
            f"{mirror.trl_member} now calls {sorted(calls - set(mirror.calls))} and no longer calls "
            f"{sorted(set(mirror.calls) - calls)}: {mirror.ours} repeats its steps, update it"
        )


def test_logps_pass_calls_the_model_with_ids_and_mask_only():
    """`with_mask_position_ids` wraps the model TRL's log-prob pass calls: TRL must call it with the chunk's ids and
    mask as keywords and set no position ids itself (else the wrapper's would be overridden or duplicated)."""
    source = inspect.getsource(trl.GRPOTrainer._get_per_token_logps_and_entropies)
    for snippet in LOGPS_FORWARD_SNIPPETS:
        assert snippet in source, (
            f"trl.GRPOTrainer._get_per_token_logps_and_entropies no longer contains {snippet!r}, which "
            "trl_stable.trainers.grpo.forward_passes.with_mask_position_ids relies on"
        )
    assert '"position_ids"' not in source, (
        "trl.GRPOTrainer._get_per_token_logps_and_entropies now sets position_ids: check "
        "trl_stable.trainers.grpo.forward_passes.with_mask_position_ids"
    )


class _NoPositions(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids


class _Positions(torch.nn.Module):
    config = "cfg"

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return position_ids


def test_with_mask_position_ids_adds_them_only_where_the_forward_takes_them(trained):
    trainer, _ = trained
    plain = _NoPositions()
    assert with_mask_position_ids(trainer, plain) is plain  # as generate: no position ids for such a model
    wrapped = with_mask_position_ids(trainer, _Positions())
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert wrapped(input_ids=mask, attention_mask=mask).tolist() == [[0, 0, 1], [0, 1, 2]]
    given = torch.tensor([[5, 6, 7]])
    assert wrapped(input_ids=given, attention_mask=mask[:1], position_ids=given) is given  # never overridden
    assert wrapped.config == "cfg" and wrapped.training  # attribute reads reach the model


class _Recorder(GRPOTrainer):
    """Records what TRL's members returned, through trl_stable's overrides."""

    def _generate_single_turn(self, *args, **kwargs):
        out = super()._generate_single_turn(*args, **kwargs)
        self.single_turn_out = out
        return out

    def _tokenize_prompts(self, prompts):
        out = super()._tokenize_prompts(prompts)
        self.tokenize_out, self.tokenized_prompts = out, list(prompts)
        return out

    def _generate(self, prompts):
        out = super()._generate(prompts)
        self.generate_out, self.generate_prompts = out, list(prompts)
        return out

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self.logps_out = out
        return out

    def _calculate_rewards(self, inputs, prompts, *args):
        out = super()._calculate_rewards(inputs, prompts, *args)
        self.rewards_out, self.num_prompts = out, len(prompts)
        self.rewards_args = (list(prompts), *args)
        return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from trl_stable.testing import build_tokenizer, save_tiny

    tokenizer = build_tokenizer()
    args = tiny_grpo_args(
        tmp_path_factory.mktemp("internals"), max_completion_length=4, num_iterations=2, seed=0,
        beta=0.1, capture_sampler_logps=True,  # TRL's reference pass and the sampler's log-probs in the batch
    )  # fmt: skip
    path = save_tiny(tmp_path_factory.mktemp("policy"), build_causal_lm("qwen2", tokenizer, seed=0), tokenizer)
    trainer = _Recorder(
        model=path, reward_funcs=length_reward, args=args,  # TRL loads the KL reference (beta=0.1) from the path
        train_dataset=Dataset.from_dict({"prompt": ["the cat sat", "hello there"]}), processing_class=tokenizer,
    )  # fmt: skip
    batch = trainer._generate_and_score_completions([{"prompt": "the cat sat"}] * 2 + [{"prompt": "hello"}] * 2)
    return trainer, batch


def test_return_arities_on_a_tiny_model(trained):
    trainer, _ = trained
    assert len(trainer.single_turn_out) == 2, "trl.GRPOTrainer._generate_single_turn: expected (ids, logprobs)"
    assert len(trainer.generate_out) == 8, "trl.GRPOTrainer._generate: expected an 8-tuple"
    prompt_ids = trainer.tokenize_out[0]
    assert len(trainer.tokenize_out) == 3 and len(prompt_ids) == len(trainer.tokenized_prompts), (
        "trl.GRPOTrainer._tokenize_prompts: expected (prompt_ids, images, multimodal_fields), one row per prompt"
    )
    assert all(isinstance(ids, list) and ids and isinstance(ids[0], int) for ids in prompt_ids), (
        "trl.GRPOTrainer._tokenize_prompts: prompt_ids rows are not lists of token ids"
    )
    assert [list(ids) for ids in trainer.generate_out[0]] == prompt_ids, (
        "trl.GRPOTrainer._tokenize_prompts: its prompt_ids are not the ones `_generate` generates from"
    )
    assert isinstance(trainer.generate_out[5], dict), "trl.GRPOTrainer._generate: extra_fields (index 5) not a dict"
    assert len(trainer.logps_out) == 3, "trl.GRPOTrainer._get_per_token_logps_and_entropies: expected a 3-tuple"
    rewards = trainer.rewards_out
    assert rewards.shape == (trainer.num_prompts, 1), "trl.GRPOTrainer._calculate_rewards: expected [N, K]"


def test_calculate_rewards_gets_what_generate_returned(trained):
    # GRPOTrainer scores early (in `_generate`) with these arguments; TRL's own later call must be the same
    trainer, _ = trained
    prompts, completions, completion_ids = trainer.rewards_args
    assert prompts == trainer.generate_prompts, "trl.GRPOTrainer: _calculate_rewards got other prompts than _generate"
    assert completions == trainer.generate_out[3], "trl.GRPOTrainer._generate: completions are no longer index 3"
    assert completion_ids == trainer.generate_out[1], "trl.GRPOTrainer._generate: completion ids are no longer index 1"


def test_batch_dict_keys_we_read(trained):
    _, batch = trained
    missing = [key for key in GRPO_BATCH_KEYS if key not in batch]
    assert not missing, f"trl.GRPOTrainer._generate_and_score_completions no longer returns {missing}"
    # num_iterations=2: TRL's old log-probs; beta=0.1: its reference log-probs; capture_sampler_logps: the HF
    # sampler's, which TRL takes from `_generate_single_turn` (tool_mask needs tools, the IS ratio vLLM: see below)
    for key in ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps"):
        assert key in GRPO_OPTIONAL_BATCH_KEYS and batch[key].shape == batch["completion_ids"].shape, key


def _function_ast(function) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def test_batch_keys_are_where_trl_puts_them():
    """The required keys are the ones of TRL's `output = {...}`; each optional key is one TRL sets conditionally."""
    tree = _function_ast(trl.GRPOTrainer._generate_and_score_completions)
    literal, assigned = set(), set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Dict)
            and ast.unparse(node.targets[0]) == "output"
        ):
            literal = {key.value for key in node.value.keys}
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            target = node.targets[0]
            if ast.unparse(target.value) == "output" and isinstance(target.slice, ast.Constant):
                assigned.add(target.slice.value)
    assert literal == set(GRPO_BATCH_KEYS), f"TRL's batch dict now has {sorted(literal)}"
    assert set(GRPO_OPTIONAL_BATCH_KEYS) <= assigned, sorted(set(GRPO_OPTIONAL_BATCH_KEYS) - assigned)


def test_padding_table_is_trls():
    """`GRPO_PADDING` (what `concat_rows` pads with) is, key for key, how TRL's batch builder calls TRL's `pad`."""
    found = {}
    for node in ast.walk(_function_ast(trl.GRPOTrainer._generate_and_score_completions)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value.func
            call = call.value if isinstance(call, ast.Attribute) and call.attr == "to" else call
            call = call.func if isinstance(call, ast.Call) else None
            if call is not None and ast.unparse(call) == "pad":
                keywords = {k.arg: ast.unparse(k.value) for k in node.value.func.value.keywords}
                value = keywords["padding_value"]
                value = "pad_token_id" if value == "self._tokenizer.pad_token_id" else ast.literal_eval(value)
                found[ast.unparse(node.targets[0])] = (ast.literal_eval(keywords["padding_side"]), value)
    assert found == GRPO_PADDING


def test_concat_rows_pads_each_key_as_trl_does():
    pad_id = 9
    a = {
        "prompt_ids": torch.tensor([[1, 2, 3]]), "prompt_mask": torch.tensor([[1, 1, 1]]),
        "completion_ids": torch.tensor([[4, 5]]), "completion_mask": torch.tensor([[1, 1]]),
        "sampling_per_token_logps": torch.tensor([[-0.5, -0.25]]), "advantages": torch.tensor([1.5]),
        "num_items_in_batch": torch.tensor(5),
    }  # fmt: skip
    b = {
        "prompt_ids": torch.tensor([[7, 8]]), "prompt_mask": torch.tensor([[1, 1]]),
        "completion_ids": torch.tensor([[6, 6, 6]]), "completion_mask": torch.tensor([[1, 1, 0]]),
        "sampling_per_token_logps": torch.tensor([[-1.0, -2.0, -3.0]]), "advantages": torch.tensor([-0.5]),
        "tool_mask": torch.tensor([[1, 0, 1]]), "num_items_in_batch": torch.tensor(7),
    }  # fmt: skip
    merged = concat_rows([a, b], pad_id)
    assert merged["prompt_ids"].tolist() == [[1, 2, 3], [pad_id, 7, 8]]  # left
    assert merged["prompt_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert merged["completion_ids"].tolist() == [[4, 5, pad_id], [6, 6, 6]]  # right
    assert merged["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 0]]
    assert merged["sampling_per_token_logps"].tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    assert merged["tool_mask"].tolist() == [[1, 1, 1], [1, 0, 1]]  # a part without one counts every token
    assert merged["advantages"].tolist() == [1.5, -0.5] and merged["num_items_in_batch"].item() == 5
    assert loss_mask(merged).tolist() == [[1, 1, 0], [1, 0, 0]]
    assert [select_rows(merged, torch.tensor([False, True]))[k].tolist() for k in ("advantages", "prompt_ids")] == [
        [-0.5],
        [[pad_id, 7, 8]],
    ]


def test_normaliser_and_process_slice_are_trls(trained):
    trainer, batch = trained
    assert torch.equal(num_items_in_batch(batch, trainer.accelerator), batch["num_items_in_batch"])
    assert torch.equal(loss_mask(batch), batch["completion_mask"])  # no tool_mask in this batch
    second = SimpleNamespace(process_index=1)
    assert process_slice(second, 4) == slice(4, 8) and process_slice(trainer.accelerator, 4) == slice(0, 4)


def test_proximal_pass_is_trls_old_logprob_pass(trained):
    """`_compute_proximal_logps` sets TRL's old-logprob pass up as TRL does: on the same weights it gives TRL's
    `old_per_token_logps` exactly."""
    trainer, batch = trained
    torch.testing.assert_close(trainer._compute_proximal_logps(batch), batch["old_per_token_logps"], rtol=0, atol=0)


def test_two_dimensional_advantages_reach_trls_loss_as_they_are(trained):
    """TRL's `_compute_loss` unsqueezes (B,) advantages only: (B, T) ones (the decoupled loss, dense rewards) are
    used per token, so a (B, T) copy of the same values gives the same loss, and a per-token change moves it."""
    trainer, batch = trained
    per_token = dict(batch, advantages=batch["advantages"].unsqueeze(1).expand_as(batch["completion_mask"]).clone())
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, batch)
        assert torch.equal(trainer._compute_loss(trainer.model, per_token), loss)
        per_token["advantages"][:, 0] += 1.0
        assert not torch.equal(trainer._compute_loss(trainer.model, per_token), loss)


def test_the_last_logged_advantages_are_this_calls(trained):
    """`replace_logged_advantages` replaces the last N entries of TRL's advantage column: TRL writes it once per
    call, all of the call's (gathered) advantages, last."""
    trainer, batch = trained
    source = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert source.count('self._logs["advantages"]') == 1, "TRL now writes the advantage column more than once"
    assert list(trainer._logs["advantages"])[-4:] == batch["advantages"].tolist()
    logged = deque([0.0, 1.0, 2.0, 3.0], maxlen=4)  # TRL's bounded column
    replace_logged_advantages(SimpleNamespace(_logs={"advantages": logged}), [7.0, 8.0])
    assert list(logged) == [0.0, 1.0, 7.0, 8.0]


ALL_MEMBERS = GRPO_MEMBERS + TRANSFORMERS_MEMBERS + HELPER_MEMBERS + PPO_MEMBERS + ENGINE_MEMBERS + VLLM_MEMBERS


@pytest.mark.parametrize("member", ALL_MEMBERS, ids=lambda m: f"{m.owner}.{m.name}")
def test_used_in_names_the_modules_that_use_it(member):
    """Each module an entry names exists and mentions the member (a dunder method: its class), so the registry
    says where to look when TRL changes it."""
    import trl_stable

    root = Path(trl_stable.__file__).parent.parent
    word = member.owner.rsplit(".", 1)[-1] if member.name.startswith("__") else member.name
    for path in member.used_in:
        assert (root / path).is_file(), f"{member.owner}.{member.name}: {path} does not exist"
        assert word in (root / path).read_text(encoding="utf-8"), f"{path} does not use {member.owner}.{member.name}"


@pytest.mark.parametrize("member", ATTRIBUTES, ids=lambda m: m.name)
def test_private_attributes_we_read(trained, member):
    trainer, _ = trained
    if member.name == "async_loop":  # created only when a reward function is async
        source = inspect.getsource(trl.GRPOTrainer.__init__)
        assert "self.async_loop" in source, "trl.GRPOTrainer.async_loop is no longer created in __init__"
        return
    assert hasattr(trainer, member.name), f"{member.owner}.{member.name} is gone (used in {member.used_in})"
    if member.name == "_metrics":
        assert set(trainer._metrics) == {"train", "eval"}, "trl.GRPOTrainer._metrics: keys are not train/eval"
    if member.name == "_logs":
        assert "advantages" in trainer._logs, "trl.GRPOTrainer._logs has no 'advantages' column"


def test_logits_processor_patch_point_returns_a_list():
    assert hasattr(transformers.GenerationMixin, "_get_logits_processor")
    from trl_stable.testing import build_tokenizer
    from trl_stable.trainers.sampler_logprobs import record_sampler_logps

    tokenizer = build_tokenizer()
    model = build_causal_lm("qwen2", tokenizer, seed=0).eval()
    ids = torch.tensor([tokenizer("the cat").input_ids])
    with record_sampler_logps(model) as recorder:
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=True)
    completion = out[0, ids.shape[1] :].tolist()
    logps = recorder.per_token_logps([completion])[0]
    assert len(logps) == 3 and all(v <= 0 for v in logps), "GenerationMixin._get_logits_processor: recorder unused"
    assert "_get_logits_processor" not in vars(model)


def test_is_reference_pass_reads_the_model_state(trained):
    peft = pytest.importorskip("peft")
    trainer, _ = trained
    from trl_stable.testing import build_tokenizer

    model = peft.get_peft_model(
        build_causal_lm("qwen2", build_tokenizer(), seed=0),
        peft.LoraConfig(r=2, target_modules=["q_proj"], lora_alpha=4),
    )
    assert not is_reference_pass(trainer, model)
    with model.disable_adapter():
        assert is_reference_pass(trainer, model)
    assert not is_reference_pass(trainer, model)
    assert not is_reference_pass(trainer, trainer.model)
    if trainer.ref_model is not None:
        assert is_reference_pass(trainer, trainer.ref_model)


def test_sync_gradients_setter_drives_what_backward_reads():
    # engines.sync_gradients relies on the private setter changing the flag `Accelerator.backward` hands DeepSpeed
    from accelerate.state import GradientState

    state = GradientState()
    before = state.sync_gradients
    try:
        state._set_sync_gradients(False)
        assert state.sync_gradients is False
        state._set_sync_gradients(True)
        assert state.sync_gradients is True
    finally:
        state._set_sync_gradients(before)


def test_vllm_helper_reads_what_ppo_sets_and_patches():
    """PPO's vLLM rollouts set `max_completion_length` per call, wrap `llm.generate` and replace the module's `LLM`
    while the helper is built: each must still be what TRL's `VLLMGeneration` reads (vLLM itself is not needed)."""
    from trl.generation.vllm_generation import VLLMGeneration

    generate = inspect.getsource(VLLMGeneration.generate)
    assert "max_completion_length = self.max_completion_length" in generate, "generate no longer reads the cap"
    assert "self.llm.generate(" in generate, "colocate generate no longer calls self.llm.generate (R3 capture)"
    assert "self.llm = LLM(" in inspect.getsource(VLLMGeneration._init_vllm), "the engine is no longer built by LLM"
    assert "return prompt_ids, completion_ids, logprobs, logprob_token_ids" in generate


def test_wrapped_method_patches_the_instance_only_and_restores_it():
    class Thing:
        def f(self):
            return 1

    a, b = Thing(), Thing()
    with wrapped_method(a, "f", lambda original: lambda: original() + 10):
        assert (a.f(), b.f()) == (11, 1)  # the class and other instances are untouched
    assert "f" not in vars(a) and a.f() == 1  # an inherited method: the instance attribute is deleted again
    a.f = lambda: 5
    with pytest.raises(RuntimeError), wrapped_method(a, "f", lambda original: lambda: original() * 2):
        assert a.f() == 10
        raise RuntimeError("restored on error too")
    assert a.f() == 5  # an instance attribute the object had is put back
