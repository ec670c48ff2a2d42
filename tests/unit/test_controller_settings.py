"""The controller's settings: every one documented, and the README's reference is generated from them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dynsnap.controller.settings import ControllerSettings, reference_table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_reference_is_the_generated_table() -> None:
    assert reference_table() in (ROOT / "README.md").read_text()


def test_every_setting_says_why() -> None:
    for name, f in ControllerSettings.model_fields.items():
        assert f.description and len(f.description) > 20, name


def test_environment_and_flags() -> None:
    s = ControllerSettings.from_env({"workers": "3"}, environ={"DYNSNAP_CONTROLLER_VERIFY_TIMEOUT": "7",
                                                               "DYNSNAP_CONTROLLER_WORKERS": "9"})
    assert s.verify_timeout == 7 and s.workers == 3  # the flag wins over the environment
    with pytest.raises(ValidationError, match="workers"):
        ControllerSettings.from_env({"workers": "0"}, environ={})
