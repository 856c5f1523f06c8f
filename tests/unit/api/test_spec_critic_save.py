"""critic.save on a job with a checkpoint volume: a folder under checkpoint.path, or refused (CEL and
check_semantics, one message), since the claim mounted there is the only storage that outlives the pods."""

from pathlib import Path

import pytest
import yaml

from ppojob_api.spec import CRITIC_SAVE_OFF_THE_VOLUME, SpecError, is_folder_under, parse_spec

CRD = Path(__file__).resolve().parents[3] / "crds" / "ppojobs.ppojob.io.yaml"
VOLUME = {"path": "/checkpoints", "volumeClaim": "ppo-checkpoints"}


def spec_with(checkpoint: dict, save: str | None) -> dict:
    critic = {"save": save} if save is not None else {}
    return {"image": "ppojob/trainer:test", "checkpoint": checkpoint, "critic": critic}


@pytest.mark.parametrize("save", ["/critic", "/checkpoints", "/checkpoints/", "/checkpointsx/critic",
                                  "/checkpoints/../critic", "/checkpoints/critic/..", "checkpoints/critic"])
def test_critic_save_off_the_checkpoint_volume_is_refused_naming_both_fields(save):
    with pytest.raises(SpecError) as info:
        parse_spec(spec_with(VOLUME, save))
    assert info.value.problems == [CRITIC_SAVE_OFF_THE_VOLUME]
    assert "critic.save" in CRITIC_SAVE_OFF_THE_VOLUME and "under checkpoint.path" in CRITIC_SAVE_OFF_THE_VOLUME


@pytest.mark.parametrize("checkpoint, save", [
    (VOLUME, "/checkpoints/critic"),
    (VOLUME, "/checkpoints/runs/a/critic"),
    ({"path": "/checkpoints/", "volumeClaim": "c"}, "/checkpoints/critic"),
    ({"path": "/data/ckpt", "volumeClaim": "c"}, "/data/ckpt/..critic"),  # a name that starts with dots, not '..'
    (VOLUME, None),
    ({"path": "/checkpoints"}, "/elsewhere/critic"),  # no claim: the rule does not apply (a local run's own disk)
])
def test_critic_save_under_checkpoint_path_or_without_a_claim_is_accepted(checkpoint, save):
    assert parse_spec(spec_with(checkpoint, save)).critic.save == save


def test_the_crd_states_the_same_rule_with_the_same_message_on_critic_save():
    rules = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = [r for r in rules["x-kubernetes-validations"] if r.get("message") == CRITIC_SAVE_OFF_THE_VOLUME]
    assert rule["fieldPath"] == ".critic.save"
    assert "self.checkpoint.volumeClaim" in rule["rule"] and "self.critic.save.startsWith" in rule["rule"]


def test_is_folder_under_reads_paths_by_their_characters():
    assert is_folder_under("/a/b", "/a") and is_folder_under("/a/b", "/a/")
    assert not is_folder_under("/a", "/a") and not is_folder_under("/ab", "/a") and not is_folder_under("/a/../b", "/a")
