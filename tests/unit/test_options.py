"""Boolean options and annotations are `true` or `false`, nothing else (node_agent.options)."""

from __future__ import annotations

import pytest

from node_agent import errors
from node_agent.podformat import SUPPORTED_OPTIONS, parse_all_options, parse_options
from node_agent.options import boolean
from node_agent.admission import RESTORE_OPTIONS, parse_restore_options

LOOSE = ["", "1", "0", "yes", "no", "TRUE", "False", " true", "true ", "on", "y", "2"]


@pytest.mark.parametrize("value", LOOSE)
@pytest.mark.parametrize("key", SUPPORTED_OPTIONS)
def test_every_checkpoint_option_is_strict(key: str, value: str) -> None:
    for parse in (parse_all_options, parse_options):
        with pytest.raises(errors.InvalidArgument) as e:
            parse({key: value})
        assert key in str(e.value) and "expected true or false" in str(e.value)


@pytest.mark.parametrize("value", LOOSE)
@pytest.mark.parametrize("key", sorted(RESTORE_OPTIONS))
def test_every_restore_option_is_strict(key: str, value: str) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        parse_restore_options({key: value})
    assert key in str(e.value)


def test_true_and_false_are_what_they_say() -> None:
    assert boolean("true", "x") is True and boolean("false", "x") is False
    assert parse_all_options({"file-locks": "false", "pre-dump": "true"})[0].file_locks is False
    with pytest.raises(errors.InvalidArgument):
        boolean(True, "x")  # a JSON or YAML boolean is not the string an option carries
