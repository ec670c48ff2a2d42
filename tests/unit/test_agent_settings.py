"""The agent's settings: every one documented, and the README's reference is generated from them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dynsnap.agent.settings import AgentSettings, reference_table
from dynsnap.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_readme_reference_is_the_generated_table() -> None:
    assert reference_table() in (ROOT / "README.md").read_text()


def test_every_setting_says_why() -> None:
    assert all(f.description and len(f.description) > 20 for f in AgentSettings.model_fields.values())


def test_environment_then_flags() -> None:
    env = {"DYNSNAP_AGENT_NODE_NAME": "n1", "DYNSNAP_AGENT_CRIU_TIMEOUT": "12"}
    s = AgentSettings.from_env({"criu_timeout": "30"}, environ=env)
    assert s.node_name == "n1" and s.criu_timeout == 30.0


def test_bad_values_are_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="criu_timeout"):
        AgentSettings.from_env({"criu_timeout": "-1"}, environ={})


def test_cli_bad_setting_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["agent", "--criu-timeout", "soon", "exec", "capture", "--pod-uid", "x", "--tier", "suspend"])
    assert e.value.code == 2 and "criu_timeout" in capsys.readouterr().err


def test_cli_exec_refuses_a_malformed_pod_uid(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["agent", "exec", "capture", "--pod-uid", "../../etc", "--tier", "suspend"])
    assert e.value.code == 2 and "not a pod UID" in capsys.readouterr().err


def test_criu_read_threads_reach_criu_only_when_set(tmp_path: Path) -> None:
    from dynsnap.agent.executor import Executor, Subject
    from dynsnap.models.ids import PodUID

    subject = Subject("ns", "w", PodUID("u-1"))
    default = Executor(AgentSettings(images_root=tmp_path))._criu_env(subject)
    assert "DYNSNAP_CRIU_READ_THREADS" not in default  # CRIU's own default: one per CPU, at most 16
    four = Executor(AgentSettings(images_root=tmp_path, criu_read_threads=4))._criu_env(subject)
    assert four == {"DYNSNAP_CRIU_READ_THREADS": "4"}  # and nothing that names the helper (issue 18)
    with pytest.raises(ValidationError, match="criu_read_threads"):
        AgentSettings.from_env({"criu_read_threads": "17"}, environ={})
