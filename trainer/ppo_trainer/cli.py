"""`ppo-train CONFIG`: run a PPOJob's spec on a local Ray (the default) or on a cluster (`--address`).

CONFIG is a PPOJob manifest or its bare spec (YAML); `image` defaults to "local". `--critic-config`
merges a per-role YAML of critic overrides into `spec.critic`, checked by the same parser (unknown
or removed keys named with their replacement, "1e-5" read as a number). A bad config, custom
advantage or reward function, remote reward URL or header, reward model directory, or a prompt
file (data.prompts, data.validation.prompts) that is missing, does not parse, lacks a label that
an ExactAnswer reward needs, or holds chat prompts the policy's tokenizer cannot render (all
checked before Ray starts) exits with code 2 and its message, never a traceback; an error raised
inside Ray is shown as its cause, in one line. Ray's token authentication is set explicitly: a
private token and temp dir per local run; on a cluster, token mode with the token the operator
provides (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH). SIGTERM stops the run between two steps with the
steps since the last checkpoint saved, exit code 143 (`graceful_stop`); `--pid-file` tells the Ray
head's preStop hook whom to send it to.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ppo_trainer.data import Prompt
from ppojob_api.spec import PPOJobSpec, SpecError, spec_from_manifest
from ppojob_api.vocabulary import RuleReward

EXIT_CONFIG = 2


class ConfigError(ValueError):
    """The config file or the command line cannot describe a run."""


def _read_yaml(path: str, what: str) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path}: not valid YAML ({exc})") from exc


def load_config(path: str, *, critic_config: str | None = None) -> tuple[PPOJobSpec, str]:
    """The spec of CONFIG (critic overrides merged in) and the job's name."""
    document = _read_yaml(path, "config")
    if not isinstance(document, dict):
        raise ConfigError(f"config {path}: expected a PPOJob manifest or its spec (a mapping)")
    is_manifest = "spec" in document and document.get("kind") in (None, "PPOJob")
    raw = dict(document["spec"] if is_manifest else document)
    name = (document.get("metadata") or {}).get("name", "ppojob") if is_manifest else Path(path).stem
    raw.setdefault("image", "local")
    if critic_config:
        overrides = _read_yaml(critic_config, "critic config")
        if not isinstance(overrides, dict):
            raise ConfigError(f"critic config {critic_config}: expected a mapping of critic settings")
        raw["critic"] = _merge(dict(raw.get("critic") or {}), overrides)
    try:
        return spec_from_manifest({"kind": "PPOJob", "spec": raw}), str(name)
    except SpecError as exc:
        source = f" (with the critic overrides of {critic_config})" if critic_config else ""
        raise ConfigError(f"config {path}{source}: {exc}") from None


def _merge(base: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = _merge(dict(base[key]), value)
        else:
            base[key] = value
    return base


def check_advantage_function(ref: str) -> None:
    """Load the custom advantage function and call it once on a small batch, before any Ray work."""
    import torch

    from ppo_trainer.algorithms import AdvantageInputs, compute_custom_advantages, load_advantage_function

    function = load_advantage_function(ref)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    probe = AdvantageInputs(rewards=torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]), values=torch.zeros(2, 3),
                            mask=mask, scores=torch.tensor([1.0, 0.5]), gamma=1.0, lam=0.95)
    compute_custom_advantages(function, probe)


def check_reward(spec: PPOJobSpec) -> None:
    """Build the rule-based reward as each rollout engine will, before any Ray work: a custom function
    is imported and its parameters checked; a remote endpoint's URL and headers are checked, but it is
    not called (it may start with the job, or be reachable from the Ray pods only). A reward model's
    directory is checked (a sequence classifier with one label, and a tokenizer), its weights not read."""
    from ppo_trainer.reward_model import check_reward_model
    from ppo_trainer.roles.rollout import build_rule_reward

    build_rule_reward(spec)
    if spec.reward.model.path is not None:
        check_reward_model(spec.reward.model.path)


def check_prompt_files(spec: PPOJobSpec) -> None:
    """Read the training and held-out prompt files, before any Ray work: a missing or malformed one, a
    record without a label for reward.type ExactAnswer, or chat prompts the policy's tokenizer cannot
    render, is a ConfigError naming its field."""
    from ppo_trainer.prompt_files import load_prompt_file

    data = spec.data
    for field, path in (("data.prompts", data.prompts), ("data.validation.prompts", data.validation.prompts)):
        if path in (None, "synthetic"):
            continue
        try:
            prompts = load_prompt_file(path, prompt_key=data.prompt_key, label_key=data.label_key,
                                       require_labels=spec.reward.rule == RuleReward.EXACT_ANSWER)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{field}: {exc}; fix the file or point {field} at another") from None
        check_chat_prompts(spec, f"{field} ({path})", prompts)


def check_chat_prompts(spec: PPOJobSpec, where: str, prompts: list[Prompt]) -> None:
    """Render one chat prompt of each sequence of roles with the policy's tokenizer, as the rollout
    engines will: a tokenizer without a chat template, or a template that refuses those roles, is a
    ConfigError. (Templates decide on the roles, not on the words, so one of each is enough.)"""
    by_roles = {tuple(m.role for m in p.messages): p for p in prompts if p.messages is not None}
    if not by_roles:
        return
    from ppo_trainer.models.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(spec.model)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{where} holds chat prompts, rendered with the policy's tokenizer, which fails to load: {exc}"
        ) from None
    for prompt in by_roles.values():
        try:
            tokenizer.encode_prompt(prompt)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def configure_ray_auth(*, joining: bool) -> None:
    """Token authentication on, explicitly; a fresh private token for a local cluster. Must run
    before Ray is imported: Ray reads these variables once, at import."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    has_token = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if joining and os.environ["RAY_AUTH_MODE"] == "token" and not has_token:
        raise ConfigError("--address needs the cluster's Ray token: set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH")
    if not joining and not has_token:
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # private to this run, never written to disk


def start_ray(address: str | None, *, num_cpus: int, object_store_mb: int) -> None:
    configure_ray_auth(joining=bool(address))
    import ray

    if address:
        ray.init(address=address, logging_level="WARNING")
        return
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ppo-ray-"),
             object_store_memory=object_store_mb * 2**20, logging_level="WARNING", log_to_driver=False)


def build_reporter(*, run_dir: Path, total_steps: int, initial: int, as_json: bool):
    from ppo_trainer.reporting.kubernetes import KubernetesReporter
    from ppo_trainer.reporting.reporters import FanOut, JsonLinesReporter, TerminalReporter
    from ppo_trainer.reporting.tensorboard import TensorBoardReporter

    console = (
        TerminalReporter(total_steps=total_steps, initial=initial)
        if sys.stdout.isatty() and not as_json
        else JsonLinesReporter(sys.stdout)
    )
    reporters = [console, JsonLinesReporter(open(run_dir / "events.jsonl", "a")),  # noqa: SIM115 (closed by the reporter)
                 TensorBoardReporter(run_dir)]
    kubernetes = KubernetesReporter.from_environment()
    if kubernetes is not None:
        reporters.append(kubernetes)
    return FanOut(*reporters)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ppo-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a PPOJob manifest or its spec (YAML)")
    parser.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--run-dir", help="where logs, TensorBoard event files, the plot and (locally) checkpoints go; default runs/<name>")
    parser.add_argument("--critic-config", help="YAML of critic overrides merged into spec.critic")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout even on a terminal")
    parser.add_argument("--cpu-ranks", type=int, default=1, help="training ranks when there are no GPUs")
    parser.add_argument("--object-store-mb", type=int, default=1024, help="local Ray object store size")
    parser.add_argument("--pid-file", help="write this process' pid there, for the Ray head's preStop hook "
                        "(SIGTERM: the step in progress finishes, a checkpoint is written, exit 143)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ppo_trainer.algorithms import CustomAdvantageError
    from ppo_trainer.reward_model import RewardModelError
    from ppo_trainer.rewards import CustomRewardError, RemoteRewardError

    try:
        spec, name = load_config(args.config, critic_config=args.critic_config)
        if spec.ppo.custom_advantage_function:
            check_advantage_function(spec.ppo.custom_advantage_function)
        check_reward(spec)
        check_prompt_files(spec)
        run_dir = Path(args.run_dir or Path("runs") / name)
        checkpoint_dir = Path(spec.checkpoint.path) if args.address else run_dir / "checkpoints"
        if not args.resume and any(checkpoint_dir.glob("step-*")):
            raise ConfigError(f"{checkpoint_dir} already holds checkpoints: pass --resume, or choose another --run-dir")
        run_dir.mkdir(parents=True, exist_ok=True)
        start_ray(args.address, num_cpus=max(os.cpu_count() or 1, args.cpu_ranks + 1),
                  object_store_mb=args.object_store_mb)
    except (ConfigError, CustomAdvantageError, CustomRewardError, RemoteRewardError, RewardModelError) as exc:
        print(f"ppo-train: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return _run(spec, args, run_dir=run_dir, checkpoint_dir=checkpoint_dir)


def _run(spec: PPOJobSpec, args: argparse.Namespace, *, run_dir: Path, checkpoint_dir: Path) -> int:
    import ray

    from ppo_trainer.algorithms import CustomAdvantageError
    from ppo_trainer.failures import describe_failure, failure_cause
    from ppo_trainer.graceful_stop import EXIT_STOPPED, StopRequest, TrainerStopped, write_pid_file
    from ppo_trainer.reporting.metrics import StepMetrics, plot_run, summarize_run
    from ppo_trainer.train import run

    reporter = build_reporter(run_dir=run_dir, total_steps=spec.ppo.num_rollouts, initial=0, as_json=args.json)
    stop = StopRequest().install()  # after ray.init, so that the handler is ours
    if args.pid_file:
        write_pid_file(args.pid_file)
    try:
        use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        state = run(spec, reporter=reporter, checkpoint_dir=str(checkpoint_dir), resume=args.resume,
                    use_gpus=use_gpus, cpu_ranks=args.cpu_ranks, attempt=int(os.environ.get("PPOJOB_ATTEMPT", "0")),
                    stop=stop)
    except TrainerStopped as stopped:
        print(f"ppo-train: {stopped}", file=sys.stderr)
        return EXIT_STOPPED
    except Exception as exc:  # noqa: BLE001 (any failure: its cause in one line, exit 1; the reporter has the details)
        cause = failure_cause(exc)
        # The step's other calls, never awaited once this one failed, hold echoes of the same
        # failure, which Ray would print with its banner as their results are dropped.
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
        if isinstance(cause, CustomAdvantageError):
            print(f"ppo-train: {cause}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"ppo-train: the run failed: {describe_failure(cause)}", file=sys.stderr)
        return 1
    finally:
        reporter.close()
        ray.shutdown()
    history = [StepMetrics.from_dict(d) for d in state.history]
    summary = summarize_run(history)
    if state.last_export is not None:  # checkpoint.export: where the trained model is, for a user to load
        summary["export"] = state.last_export["path"]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if history and not args.address:
        plot_run(history, run_dir / "run.png")
    print(json.dumps({"summary": summary, "runDir": str(run_dir)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
