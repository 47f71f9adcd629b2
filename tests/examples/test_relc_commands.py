"""Every RELC `.sh` training command, transcribed flag for flag, parses in our matching script and lands on the right
config values; the flags with no meaning here are recorded and named in one warning.

The commands are google-research/relc/llm-intrinsic-reward/examples/research_projects/*/*.sh. They name hub models
and data, so these tests parse them (and build the trainer's config) without running: the runs themselves are the
embedded smoke tests of test_research_examples.py. `$HOME`, `$SCRATCH` and `$CKPT_DIR` paths are shortened,
`$PERSPECTIVE_API_KEY` is a literal stand-in, and RELC's critic templates (`prompt_<task>_3shot_v2.txt`, not shipped
here; the critic checks that its template exists) are our `prompts/critic_<task>.txt`.
"""

import json
import shlex
import warnings

import pytest

# ppo-intrinsic-rewards-sentiment.sh -> sentiment/ppo_intrinsic.py
SENTIMENT_INTRINSIC = """--use_instric_reward --positive_reward_value 0.8 --negative_reward_value -0.8
--intrinsic_reward_threshold 10 --prompt_file prompts/critic_sentiment.txt --epochs 2
--query_dataset "imdb" --min_new_tokens 15 --max_new_tokens 20 --num_shared_layers 20 --save_freq 50
--model_save_path ckpts/sentiment/ppo-intrinsic-sentiment-gpt2large --ppo_config.model_name "gpt2-large"
--ppo_config.log_with "wandb" --ppo_config.learning_rate 1.41e-5 --ppo_config.batch_size 16
--ppo_config.mini_batch_size 16 --ppo_config.gradient_accumulation_steps 1 --ppo_config.target_kl 6.0
--ppo_config.kl_penalty "kl" --ppo_config.ppo_epochs 4
--ppo_config.tracker_project_name "trl-fgrlaif-sentiment-gpt2large" """
# ppo-sentiment.sh (RELC's PPO baseline, flat argparse flags, `--epoch` for --epochs) -> sentiment/ppo_intrinsic.py
SENTIMENT_BASELINE = """--model_name "lvwerra/gpt2-imdb" --log_with "wandb" --learning_rate 1.41e-5 --batch_size 128
--mini_batch_size 128 --gradient_accumulation_steps 1 --target_kl 6.0 --kl_penalty "kl" --ppo_epochs 4
--tracker_project_name "trl-fgrlaif-sentiment" --epoch 1"""
# ppo-intrinsic-rewards-toxicity.sh -> toxicity/ppo_intrinsic.py
TOXICITY_INTRINSIC = """--use_intrinsic_reward --prompt_file prompts/critic_toxicity.txt
--positive_reward_value 0.1 --negative_reward_value -0.5 --intrinsic_reward_threshold 1.0
--perspective_api PERSPECTIVE-KEY-STAND-IN --model_name gpt2-large --log_with "wandb"
--model_save_path ckpts/toxicity/ppo_intrinsic_epoch5_threshold1.0_bs64_mbs64 --epochs 5 --prompt_toxicity_level 0.6
--output_min_length 10 --output_max_length 14 --learning_rate 1.41e-5 --batch_size 64 --mini_batch_size 64
--gradient_accumulation_steps 1 --ppo_epochs 4 --tracker_project_name "trl-fgrlaif-toxicity-perspective" """
# ppo-intrinsic-rewards-toxicity-peft.sh (as committed: the PPO baseline; its intrinsic flags are commented out)
TOXICITY_PEFT = """--perspective_api PERSPECTIVE-KEY-STAND-IN --model_name meta-llama/Llama-2-7b-chat-hf
--log_with "wandb" --model_save_path ckpts/toxicity/ppo_baseline_llama2_epoch2_bs32_mbs16_grad-step-2 --epochs 2
--prompt_toxicity_level 0.6 --output_min_length 10 --output_max_length 14 --learning_rate 1.41e-5 --batch_size 32
--mini_batch_size 16 --gradient_accumulation_steps 2 --ppo_epochs 4
--tracker_project_name "trl-fgrlaif-toxicity-perspective" """
# the same file's commented-out intrinsic flags, switched on
TOXICITY_PEFT_INTRINSIC_FLAGS = """--use_intrinsic_reward --prompt_file prompts/critic_toxicity.txt
--positive_reward_value 0.0 --negative_reward_value -0.5 --intrinsic_reward_threshold 0.9"""
# ppo_summ_rouge.sh -> summarization/ppo_rouge.py. The .sh ends its command with a stray `;` after
# `--intrinsic_reward_threshold 100`, so bash ran the script with the first four flags only; this is the command
# the file means, every flag of it.
SUMMARIZATION_ROUGE = """--use_instric_reward --positive_reward_value 0.5 --negative_reward_value -0.5
--intrinsic_reward_threshold 100 --use_score_scaling --num_shared_layers 12
--model_name ckpts/summarization/sft_gpt2-medium/checkpoint-1000
--model_save_path ckpts/summarization/ppo-intrinsic-rouge --epochs 5 --output_min_length 30 --output_max_length 50
--learning_rate 1.41e-5 --batch_size 8 --mini_batch_size 8
--gradient_accumulation_steps 1 --ppo_epochs 4 --prompt_file prompts/critic_summarization.txt"""


def parse(module, cls_name: str, command: str):
    """(args, the one RELC warning's text or None, the trainer's PPOConfig) of a command."""
    from ppo_args import loop_ppo_config
    from script_args import parse_script_args

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_script_args(getattr(module, cls_name), shlex.split(command))
    relc = [str(w.message) for w in caught if "Ignored RELC flags" in str(w.message)]
    assert len(relc) <= 1, relc  # one warning for all of them, never one per flag or per parse
    return args, (relc[0] if relc else None), loop_ppo_config(args.ppo_config, "unused_output_dir")


def ppo_values(config, *names: str) -> dict:
    return {name: getattr(config, name) for name in names}


PPO_FIELDS = ("model_name", "learning_rate", "batch_size", "mini_batch_size", "gradient_accumulation_steps")
PPO_FIELDS += ("ppo_epochs", "min_new_tokens", "max_new_tokens", "report_to")


@pytest.fixture()
def scripts(load_script):
    return {
        "sentiment": load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic"),
        "toxicity": load_script("toxicity/ppo_intrinsic.py", "toxicity_ppo_intrinsic"),
        "peft": load_script("toxicity/ppo_intrinsic_peft.py", "toxicity_ppo_intrinsic_peft"),
        "summarization": load_script("summarization/ppo_rouge.py", "summarization_ppo_rouge"),
    }


def test_sentiment_intrinsic_command(scripts, tmp_path):
    from run_saving import save_run_args

    args, warning, cfg = parse(scripts["sentiment"], "ScriptArguments", SENTIMENT_INTRINSIC)
    critic = args.critic
    assert critic.use_intrinsic_reward is True  # RELC's misspelled --use_instric_reward
    assert (critic.positive_reward_value, critic.negative_reward_value, critic.intrinsic_reward_threshold) == (
        0.8,
        -0.8,
        10.0,
    )
    assert critic.prompt_file == "prompts/critic_sentiment.txt"
    assert (args.epochs, args.query_dataset, args.save_freq) == (2, "imdb", 50)
    assert args.model_save_path == "ckpts/sentiment/ppo-intrinsic-sentiment-gpt2large"
    assert ppo_values(cfg, *PPO_FIELDS) == {
        "model_name": "gpt2-large",
        "learning_rate": 1.41e-5,
        "batch_size": 16,
        "mini_batch_size": 16,
        "gradient_accumulation_steps": 1,
        "ppo_epochs": 4,
        # RELC's LengthSampler(15, 20) drew 15..19; ours includes both bounds
        "min_new_tokens": 15,
        "max_new_tokens": 19,
        "report_to": ["wandb"],  # --ppo_config.log_with: PPOConfig's alias of report_to
    }
    assert (cfg.target_kl, cfg.kl_penalty, cfg.num_shared_layers) == (6.0, "kl", 20)
    assert warning is not None and "--ppo_config.tracker_project_name 'trl-fgrlaif-sentiment-gpt2large'" in warning
    assert "WANDB_PROJECT" in warning
    save_run_args(args, str(tmp_path))
    saved = json.loads((tmp_path / "run_args.json").read_text())
    assert saved["ppo_config"]["tracker_project_name"] == "trl-fgrlaif-sentiment-gpt2large"
    assert (saved["max_new_tokens"], saved["ppo_config"]["max_new_tokens"]) == (20, 19)


def test_sentiment_baseline_command(scripts):
    args, warning, cfg = parse(scripts["sentiment"], "ScriptArguments", SENTIMENT_BASELINE)
    assert args.critic.use_intrinsic_reward is False and args.epochs == 1  # --epoch
    assert ppo_values(cfg, *PPO_FIELDS) == {
        "model_name": "lvwerra/gpt2-imdb",
        "learning_rate": 1.41e-5,
        "batch_size": 128,
        "mini_batch_size": 128,
        "gradient_accumulation_steps": 1,
        "ppo_epochs": 4,
        "min_new_tokens": 15,  # the script's defaults; RELC's baseline always generated 32 tokens
        "max_new_tokens": 20,
        "report_to": ["wandb"],
    }
    assert (cfg.target_kl, cfg.kl_penalty) == (6.0, "kl")
    assert warning is not None and "--ppo_config.tracker_project_name 'trl-fgrlaif-sentiment'" in warning


def test_toxicity_intrinsic_command(scripts, tmp_path):
    from run_saving import save_run_args

    args, warning, cfg = parse(scripts["toxicity"], "ToxicityArguments", TOXICITY_INTRINSIC)
    critic = args.critic
    assert critic.use_intrinsic_reward is True and critic.prompt_file == "prompts/critic_toxicity.txt"
    assert (critic.positive_reward_value, critic.negative_reward_value, critic.intrinsic_reward_threshold) == (
        0.1,
        -0.5,
        1.0,
    )
    assert args.perspective_api == "PERSPECTIVE-KEY-STAND-IN"
    assert (args.epochs, args.prompt_toxicity_level) == (5, 0.6)
    assert args.model_save_path == "ckpts/toxicity/ppo_intrinsic_epoch5_threshold1.0_bs64_mbs64"
    assert ppo_values(cfg, *PPO_FIELDS) == {
        "model_name": "gpt2-large",
        "learning_rate": 1.41e-5,
        "batch_size": 64,
        "mini_batch_size": 64,
        "gradient_accumulation_steps": 1,
        "ppo_epochs": 4,
        "min_new_tokens": 10,  # --output_min_length 10 --output_max_length 14: RELC drew 10..13
        "max_new_tokens": 13,
        "report_to": ["wandb"],
    }
    assert warning is not None and "--ppo_config.tracker_project_name 'trl-fgrlaif-toxicity-perspective'" in warning
    assert "PERSPECTIVE-KEY-STAND-IN" not in warning
    save_run_args(args, str(tmp_path))
    saved = json.loads((tmp_path / "run_args.json").read_text())
    assert saved["ppo_config"]["tracker_project_name"] == "trl-fgrlaif-toxicity-perspective"
    assert saved["perspective_api"] == "<redacted>"


@pytest.mark.parametrize("intrinsic", [False, True])
def test_toxicity_peft_command(scripts, intrinsic):
    command = TOXICITY_PEFT + (" " + TOXICITY_PEFT_INTRINSIC_FLAGS if intrinsic else "")
    # ppo_intrinsic_peft.py becomes the toxicity script with --use_peft and the flags given
    launched = scripts["peft"].command(shlex.split(command))
    assert launched[1] == scripts["toxicity"].__file__ and launched[2] == "--use_peft"
    args, warning, cfg = parse(scripts["toxicity"], "ToxicityArguments", shlex.join(launched[2:]))
    assert args.use_peft is True
    assert ppo_values(cfg, *PPO_FIELDS) == {
        "model_name": "meta-llama/Llama-2-7b-chat-hf",
        "learning_rate": 1.41e-5,
        "batch_size": 32,
        "mini_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "ppo_epochs": 4,
        "min_new_tokens": 10,
        "max_new_tokens": 13,
        "report_to": ["wandb"],
    }
    assert (args.epochs, args.prompt_toxicity_level, args.lora_r) == (2, 0.6, 16)
    assert args.critic.use_intrinsic_reward is intrinsic
    if intrinsic:
        assert (args.critic.positive_reward_value, args.critic.intrinsic_reward_threshold) == (0.0, 0.9)
    assert warning is not None and "tracker_project_name" in warning


def test_summarization_rouge_command(scripts):
    args, warning, cfg = parse(scripts["summarization"], "SummarizationArguments", SUMMARIZATION_ROUGE)
    critic = args.critic
    assert critic.use_intrinsic_reward is True and critic.prompt_file == "prompts/critic_summarization.txt"
    assert (critic.positive_reward_value, critic.negative_reward_value, critic.intrinsic_reward_threshold) == (
        0.5,
        -0.5,
        100.0,
    )
    assert args.epochs == 5 and args.model_save_path == "ckpts/summarization/ppo-intrinsic-rouge"
    assert ppo_values(cfg, *PPO_FIELDS) == {
        "model_name": "ckpts/summarization/sft_gpt2-medium/checkpoint-1000",
        "learning_rate": 1.41e-5,
        "batch_size": 8,
        "mini_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "ppo_epochs": 4,
        "min_new_tokens": 30,  # --output_min_length 30 --output_max_length 50: RELC drew 30..49
        "max_new_tokens": 49,
        "report_to": [],
    }
    assert (cfg.use_score_scaling, cfg.num_shared_layers) == (True, 12)
    assert warning is None  # nothing to ignore in this one


def test_length_flags_keep_relc_meaning_and_ours_stay_inclusive(scripts):
    """RELC's flags exclude their upper bound; PPOConfig's own `--max_new_tokens` includes it, and is no longer
    overridden by a default of the RELC flag."""
    from script_args import parse_script_args

    tox, summ, sent = scripts["toxicity"], scripts["summarization"], scripts["sentiment"]
    assert parse_script_args(tox.ToxicityArguments, []).ppo_config.max_new_tokens == 14  # no RELC flag: ours
    ours = parse_script_args(tox.ToxicityArguments, ["--min_new_tokens", "4", "--max_new_tokens", "6"]).ppo_config
    assert (ours.min_new_tokens, ours.max_new_tokens) == (4, 6)
    paper = parse_script_args(summ.SummarizationArguments, ["--model_name", "m"]).ppo_config
    embedded = parse_script_args(summ.SummarizationArguments, ["--max_new_tokens", "12"]).ppo_config
    assert (paper.min_new_tokens, paper.max_new_tokens, embedded.min_new_tokens, embedded.max_new_tokens) == (
        30,
        49,
        8,
        12,
    )
    nested = parse_script_args(sent.ScriptArguments, ["--ppo_config.max_new_tokens", "20"]).ppo_config
    assert nested.max_new_tokens == 20
    only_max = parse_script_args(sent.ScriptArguments, ["--max_new_tokens", "17"]).ppo_config
    assert (only_max.min_new_tokens, only_max.max_new_tokens) == (15, 16)
    with pytest.raises(ValueError, match=r"\[5, 5\) is empty"):
        parse_script_args(tox.ToxicityArguments, ["--output_min_length", "5", "--output_max_length", "5"])


def test_no_warning_without_ignored_flags(scripts):
    _, warning, _ = parse(scripts["toxicity"], "ToxicityArguments", "--use_intrinsic_reward --batch_size 4")
    assert warning is None


def test_toxicity_positive_reward_value_has_relcs_meaning():
    """RELC's toxicity `--positive_reward_value` (+0.1 in its .sh) rewards every token outside a toxic span: our
    toxicity port maps it onto `outside_span_reward_value`, so RELC's command gives RELC's token rewards."""
    from relc_flags import relc_toxicity_values

    from trl_stable.rewards import CriticRewardConfig

    relc = CriticRewardConfig(critic_task="toxicity", positive_reward_value=0.1, negative_reward_value=-0.5)
    mapped = relc_toxicity_values(relc)
    assert (mapped.positive_reward_value, mapped.negative_reward_value, mapped.outside_span_reward_value) == (
        0.0,
        -0.5,
        0.1,
    )
    both = CriticRewardConfig(
        critic_task="toxicity", positive_reward_value=0.1, negative_reward_value=-0.5, outside_span_reward_value=0.2
    )
    with pytest.raises(ValueError, match="name the same reward"):
        relc_toxicity_values(both)
