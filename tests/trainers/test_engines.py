"""PPOTrainer under accelerate's engines (`trl_stable.trainers.ppo.engines`, reading Trainer's engine state): the
shipped accelerate configs, the refusals, DeepSpeed ZeRO-2/3 end to end in one CPU process (generate, step,
checkpoint, resume), and FSDP2's generation through the root in two gloo processes.

What needs a GPU (two-process ZeRO, accelerate's FSDP path) is in scripts/gpu_check.sh: accelerate counts one process
under DeepSpeed on a machine without GPUs, and sends FSDP to plain CPU data parallel there.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from two_processes import HELPERS, free_port

from trl_stable import PPOConfig
from trl_stable.trainers.ppo import engines
from trl_stable.trainers.ppo.engines import check_engine, require_deepspeed_if_asked

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "accelerate_configs"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _args(**kw) -> PPOConfig:
    return PPOConfig(output_dir="unused", report_to="none", **kw)


# ------------------------------------------------------------------ the accelerate configs
@pytest.mark.parametrize(
    ("name", "kind", "detail"),
    [
        ("multi_gpu", "MULTI_GPU", {}),
        ("deepspeed_zero1", "DEEPSPEED", {"zero_stage": 1}),
        ("deepspeed_zero2", "DEEPSPEED", {"zero_stage": 2}),
        ("deepspeed_zero3", "DEEPSPEED", {"zero_stage": 3, "zero3_init_flag": True, "zero3_save_16bit_model": True}),
        ("fsdp", "FSDP", {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}),
    ],
)
def test_accelerate_config_loads_as_the_engine_it_names(name, kind, detail):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert str(config.distributed_type).rsplit(".", 1)[-1] == kind
    section = config.deepspeed_config if kind == "DEEPSPEED" else config.fsdp_config if kind == "FSDP" else {}
    assert {k: section[k] for k in detail} == detail
    assert config.use_cpu is False


# ------------------------------------------------------------------ refusals, read from Trainer's engine state
def _trainer(zero_stage=None, fsdp_version=None, **kwargs):
    """What `check_engine` reads of a Trainer: `is_deepspeed_enabled` / `is_fsdp_enabled`, accelerate's plugins."""
    ds = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    fsdp = None if fsdp_version is None else SimpleNamespace(fsdp_version=fsdp_version)
    state = SimpleNamespace(deepspeed_plugin=ds, fsdp_plugin=fsdp)
    return SimpleNamespace(
        args=_args(**kwargs),
        is_deepspeed_enabled=ds is not None,
        is_fsdp_enabled=fsdp is not None,
        accelerator=SimpleNamespace(state=state, num_processes=2),
    )


@pytest.mark.parametrize(
    ("engine", "kwargs", "quantized", "match"),
    [
        ({"fsdp_version": 1}, {}, False, "fsdp_version: 2"),
        ({"zero_stage": 2}, {"early_stopping": False}, True, "load_in_4bit"),
        ({"fsdp_version": 2}, {}, True, "load_in_4bit"),
        ({"zero_stage": 3}, {"num_shared_layers": 1, "target_kl": None}, False, "num_shared"),
        ({"fsdp_version": 2}, {"num_shared_layers": 1}, False, "num_shared_layers=None"),
        ({"zero_stage": 1}, {}, False, "early_stopping=False"),
    ],
)
def test_unsupported_combinations_are_refused_with_the_fix(engine, kwargs, quantized, match):
    with pytest.raises(ValueError, match=match):
        check_engine(_trainer(**engine, **kwargs), quantized=quantized)


@pytest.mark.parametrize(
    ("engine", "kwargs"),
    [
        ({}, {"num_shared_layers": 1}),  # DDP: everything, early stopping included
        ({"zero_stage": 2}, {"num_shared_layers": 1, "early_stopping": False}),  # ZeRO-2 does not shard parameters
        ({"zero_stage": 3}, {"target_kl": None}),
        ({"fsdp_version": 2}, {}),
    ],
)
def test_supported_combinations_pass(engine, kwargs):
    check_engine(_trainer(**engine, **kwargs), quantized=not engine)


def test_deepspeed_config_without_deepspeed_is_a_clear_import_error(monkeypatch, tokenizer):
    from trl_stable import PPOTrainer
    from trl_stable.testing import build_causal_lm

    args = _args()  # made before the environment asks for DeepSpeed (e.g. in a notebook, then a launch)
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ImportError, match="pip install deepspeed"):
        require_deepspeed_if_asked()
    with pytest.raises(ImportError, match="multi_gpu.yaml or fsdp.yaml"):
        PPOTrainer(build_causal_lm("qwen2", tokenizer, seed=0), args=args, processing_class=tokenizer)
    if not HAS_DEEPSPEED:
        # made under the launch, the config fails first, in transformers' own requirement check naming deepspeed
        with pytest.raises(ImportError, match="deepspeed"):
            _args()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    require_deepspeed_if_asked()  # not asked: no error, whatever is installed


def test_deepspeed_gets_ppo_batch_sizes_and_clipping_through_trainer():
    # Trainer fills DeepSpeed's "auto" values from the config: the micro-batch is per_device_train_batch_size (RELC's
    # mini_batch_size), and a number in the DeepSpeed config that disagrees is refused by transformers
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "zero_optimization": {"stage": 2},
    }
    args = _args(batch_size=6, mini_batch_size=2, gradient_accumulation_steps=3, max_grad_norm=0.5)
    deepspeed = HfTrainerDeepSpeedConfig(config)
    deepspeed.trainer_config_process(args)
    config = deepspeed.config
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 3
    assert config["gradient_clipping"] == 0.5
    stage3 = {"zero_optimization": {"stage": 3}}
    plugin = SimpleNamespace(deepspeed_config=stage3, zero_stage=3)
    engines.configure_deepspeed(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))
    assert stage3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


# ------------------------------------------------------------------ launched runs
def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), HELPERS, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def _run(cmd: list[str], what: str, timeout: int = 240) -> subprocess.CompletedProcess:
    try:
        # ~30 s on a loaded 2-core machine; the limit only turns a hang into a failure with its output
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} did not finish within {timeout} s; stderr tail:\n{(exc.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


ZERO_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from safetensors import safe_open
    from tiny_configs import tiny_ppo_args
    from trl_stable import PPOTrainer
    from trl_stable.testing import build_causal_lm, build_tokenizer

    out = sys.argv[1]
    tok = build_tokenizer()

    def make():
        args = tiny_ppo_args(out, batch_size=2, mini_batch_size=1, gradient_accumulation_steps=2, ppo_epochs=4,
                             max_new_tokens=4, early_stopping=False, seed=1)
        # under ZeRO-3 both models are partitioned as they are built: the reference is passed, not deep-copied
        return PPOTrainer(build_causal_lm("qwen2", tok, seed=0), args=args, processing_class=tok,
                          ref_model=build_causal_lm("qwen2", tok, seed=0))

    queries = [torch.tensor(tok("The movie")["input_ids"]), torch.tensor(tok("A story")["input_ids"])]

    def one_step(trainer):
        responses = trainer.generate(queries, return_prompt=False)
        stats = trainer.step(queries, responses, scores=[1.0, 0.0])
        return [len(r) for r in responses], {k: stats[k] for k in ("loss/policy", "loss/value", "objective/kl")}

    trainer = make()
    lengths, _ = one_step(trainer)
    checkpoint = trainer.save_checkpoint()
    after, stats = one_step(trainer)
    trainer.save_model(os.path.join(out, "final"))
    resumed = make()
    resumed.load_checkpoint(checkpoint)
    after_resumed, stats_resumed = one_step(resumed)
    with safe_open(os.path.join(out, "final", "model.safetensors"), framework="pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    plugin = trainer.accelerator.state.deepspeed_plugin
    record = {"deepspeed": trainer.is_deepspeed_enabled, "zero_stage": plugin.zero_stage,
              "wrapped": type(trainer.model_wrapped).__name__,
              "ref": type(trainer.ref_model).__name__, "lengths": lengths, "stats": stats,
              "stats_resumed": stats_resumed, "after": after, "after_resumed": after_resumed,
              "files": sorted(os.listdir(checkpoint)), "shapes": shapes,
              "final": sorted(os.listdir(os.path.join(out, "final")))}
    with open(os.path.join(out, "record.json"), "w") as f:
        json.dump(record, f)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed (pip install deepspeed; DS_BUILD_OPS=0)")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_generate_step_checkpoint_resume(tmp_path, stage):
    # one process: on a machine without GPUs accelerate's DeepSpeed path counts a single process whatever the world
    # size, so ZeRO's sharding over processes is left to the GPU check; one process still runs every code path
    config = (CONFIGS / f"deepspeed_zero{stage}.yaml").read_text()
    config = config.replace("num_processes: 8", "num_processes: 1")
    config = config.replace("mixed_precision: bf16", "mixed_precision: 'no'")
    (tmp_path / "accelerate.yaml").write_text(config)
    script = tmp_path / "run_zero.py"
    script.write_text(ZERO_SCRIPT)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml")]
    _run([*cmd, "--main_process_port", str(free_port()), str(script), str(out)], f"ZeRO-{stage}")
    record = json.loads((out / "record.json").read_text())
    assert record["deepspeed"] and record["zero_stage"] == stage
    assert record["wrapped"] == "DeepSpeedEngine" and record["ref"] == "DeepSpeedEngine"
    assert all(1 <= n <= 4 for n in record["lengths"])
    # Trainer's checkpoint with DeepSpeed's own shards (`latest` names them), marked complete, and resuming from it
    # repeats the next step
    assert {"latest", "trl_stable_checkpoint.json", "model.safetensors", "value_head.safetensors"} <= set(
        record["files"]
    )
    assert "trainable_weights.pt" not in record["files"]
    assert record["after_resumed"] == record["after"]
    assert record["stats_resumed"] == pytest.approx(record["stats"], rel=1e-6, abs=1e-8)
    # the saved model holds the full (gathered) weights, not ZeRO-3's empty partitions
    assert record["shapes"] and all(all(d > 0 for d in shape) for shape in record["shapes"].values())
    assert "value_head.safetensors" in record["final"]


FSDP2_SCRIPT = textwrap.dedent(
    """
    import copy, json, os, sys
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard
    from trl_stable.testing import build_causal_lm, build_tokenizer
    from types import SimpleNamespace
    from trl_stable.trainers.ppo.engines import generation_call
    from trl_stable.trainers.ppo.models import PolicyAndValue
    from trl_stable.trainers.ppo.value_head import ValueHead

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = build_tokenizer()
    policy = build_causal_lm("qwen2", tok, seed=0).eval()
    reference = copy.deepcopy(policy)
    wrapper = PolicyAndValue(policy, ValueHead(policy.config.hidden_size), None)
    # what accelerate's FSDP2 preparation does with TRANSFORMER_BASED_WRAP: one unit per decoder layer, then the root
    layer_names = set(wrapper._no_split_modules)
    for module in wrapper.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module)
    fully_shard(wrapper)
    sharded = [type(p).__name__ for p in policy.parameters()]
    # each rank its own prompt and length: generation must keep every rank in each decoding step's all-gathers
    prompt = ["The movie was", "A"][rank]
    ids = torch.tensor([tok(prompt)["input_ids"]])
    kwargs = dict(do_sample=False, max_new_tokens=3 + 2 * rank, pad_token_id=tok.pad_token_id, eos_token_id=None)
    # what generation_call reads of the trainer under FSDP2 (Trainer's is_fsdp_enabled, the wrapped root)
    trainer = SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=True, model_wrapped=wrapper,
                              accelerator=SimpleNamespace(num_processes=2))
    with torch.no_grad(), generation_call(trainer, policy) as sample:
        got = sample(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    with torch.no_grad():
        want = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"got": got.tolist(), "want": want.tolist(), "sharded": sharded}, f)
    dist.barrier()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)


def test_fsdp2_generation_runs_through_the_root(tmp_path):
    # accelerate sends FSDP to plain CPU data parallel on a machine without GPUs, so the FSDP2 wrapping is done here
    # by hand (torch's fully_shard over gloo), as accelerate does it
    script = tmp_path / "run_fsdp2.py"
    script.write_text(FSDP2_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    _run([*cmd, str(script), str(tmp_path)], "the FSDP2 generation run")
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(record["sharded"]) == {"DTensor"}  # the policy's parameters really are sharded
        assert record["got"] == record["want"]  # the same greedy tokens as the unsharded model
